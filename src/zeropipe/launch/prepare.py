"""Everything decided once, in the launcher, before any rank starts.

The run directory is laid out, the data read, validated and tokenized into a memory-mapped
cache (so bad data stops the run here, with a clear message, not hours in on every rank),
the tokenizer trained when the model has none, the number of steps computed and the
DeepSpeed JSON written. Ranks only read these files.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from zeropipe.checkpoint.manager import list_checkpoints, resolve_checkpoint, universal_dir, write_atomic
from zeropipe.checkpoint.universal import convert_to_universal, has_partitioned_state
from zeropipe.config.deepspeed import build_deepspeed_config, data_parallel_size, zero_stage_of
from zeropipe.config.load import config_changes, dump_config
from zeropipe.config.schema import RunConfig
from zeropipe.confine import confining
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.families import family_of
from zeropipe.models.common import encoder_precision_for
from zeropipe.launch.resolve import ResolvedRun
from zeropipe.launch.resume import (
    check_resume_schedule,
    prefer_exact_adam,
    resume_batch_shape,
    previous_total_steps,
    saved_batch_shape,
    saved_data_position,
)
from zeropipe.rundir import RunDir, RunPlan, plugins_in_use


@dataclass
class Prepared:
    run: RunDir
    plan: RunPlan
    config: RunConfig  # as written to config.yaml: resolved, with what preparation filled in (family, vocabulary size)
    notes: list[str] = field(default_factory=list)  # what the user should read before training starts


def run_dir_for(config: RunConfig) -> Path:
    return Path(config.run.output_dir) / (config.run.name or "run")


def prepare_run(resolved: ResolvedRun, resume: str | bool | None = None, new_schedule: bool = False) -> Prepared:
    """Lay out (or reopen, for a resume) the run directory and write what the ranks read.

    Args:
        resolved: the run as the command resolved it (:func:`resolve_run`): its config, hardware and the user's
            DeepSpeed JSON as read once; what resolving noted is the caller's to say.
        resume: False/None for a new run; True to continue the run directory's latest
            checkpoint; a path to a run directory or checkpoint to continue from.

    Raises:
        ZeroPipeError: with the fix, for anything that would make the ranks fail.
    """
    config, accelerator, world_size = resolved.config.model_copy(deep=True), resolved.accelerator, resolved.world_size
    notes: list[str] = []
    run = RunDir(run_dir_for(config))
    resume_tag = None
    if resume:
        run_path, info = resolve_checkpoint(run.path if resume is True else Path(resume))
        run = RunDir(run_path)
        run.claim()  # refuses a run directory a live launcher owns, before anything is read or moved
        resume_tag = info.tag
        saved = json.loads((info.path / "zeropipe_complete.json").read_text())
        previous_plan = run.read_plan_fields()  # the last attempt's run.json, before this one replaces it
        saved_shape = saved_batch_shape(saved, previous_plan)
        saved_world = saved.get("world_size") or (saved_shape[2] if saved_shape else world_size)
        other_rank_count = saved_world != world_size
        notes.append(f"resuming {run.path} from {info.tag} (step {info.step})" + (f", saved by {saved_world} ranks, on {world_size}" if other_rank_count else ""))
        saved_sp, sp = saved.get("sequence_parallel_size", 1), config.parallel.sequence_parallel_size
        if (saved_sp != sp or other_rank_count) and max(saved_sp, sp) > 1:
            # Only the same degree on the same ranks is verified exact (docs/parallel.md).
            raise ConfigError([(
                "parallel.sequence_parallel_size",
                f"{info.tag} was saved by {saved_world} ranks with sequence_parallel_size {saved_sp}; resuming on {world_size} ranks with {sp} "
                "is not supported yet (the data position and the batch are not converted between SP degrees): "
                f"resume with hardware.gpus={saved_world} and parallel.sequence_parallel_size={saved_sp}",
            )])
    else:
        run.claim()  # refuses a run directory a live launcher owns, even one that has written nothing yet
        if list_checkpoints(run.path, complete_only=False) or run.metrics.exists():
            raise ZeroPipeError(
                f"{run.path} already holds a run: continue it with --resume, or choose another run.name "
                f"(e.g. run.name={run.path.name}-2); nothing was overwritten"
            )
    run.path.mkdir(parents=True, exist_ok=True)
    # Errors recorded by an earlier attempt would mislead this attempt's diagnosis.
    shutil.rmtree(run.errors, ignore_errors=True)
    run.errors.mkdir()
    run.logs.mkdir(exist_ok=True)
    run.write_progress("preparing the data")

    family = family_of(config.model)
    # Written into config.yaml, so every rank and every later command agrees on it.
    config.model.family = family.name
    problems = family.config_problems(config)
    if problems:
        raise ConfigError(problems)
    # The batch shape is the config's own: a user's DeepSpeed JSON was folded into it (resolve_run).
    micro, accumulation = config.train.micro_batch_size, config.train.gradient_accumulation_steps
    if micro == "auto" or accumulation == "auto":
        raise ConfigError([("train.micro_batch_size", "the batch shape is still auto: resolve the config first (zeropipe train does)")])
    if resume_tag:
        # A resume keeps the global batch: on another rank count the accumulation makes up the difference.
        accumulation, shape_notes = resume_batch_shape(family, saved, previous_plan, micro, accumulation, world_size, info.tag)
        config.train.gradient_accumulation_steps = accumulation
        notes += shape_notes
    checked = config.model_copy(deep=True)
    run.confine_data(resolved.confinement)
    # A resume takes its adapters from the checkpoint: run.json keeps what the run started from.
    adapter_init = previous_plan.get("adapter_init") if resume_tag else None
    if config.model.lora is not None and config.model.lora.init_from and not resume_tag:
        # Read (and confined) before the data step: a missing or unreadable adapter stops the run here, not in every rank.
        from zeropipe.models.adapter_init import describe

        with confining(resolved.confinement):
            adapter_init = describe(config.model.lora.init_from)
        notes.append(f"LoRA starts from {adapter_init['path']} ({adapter_init['layout']} layout, {adapter_init['modules']} modules, rank {', '.join(map(str, adapter_init['rank']))})")
    with confining(resolved.confinement):  # a UI run's data preparation skips files that resolve outside its roots
        data = family.prepare_data(config, run, reuse=bool(resume_tag))
    notes += data.notes
    # What preparing the data learned (vocabulary size, an expert's noise range) is saved as its
    # own record beside config.yaml, which stays the config as it was resolved and checked.
    learned = config_changes(checked, config)

    # Sequence parallelism: groups of N ranks read one sample together, so the data is dealt over world / N.
    data_world = data_parallel_size(config, world_size)
    micro_batches_per_epoch = data.micro_batches_per_epoch(micro, data_world)
    steps_per_epoch = micro_batches_per_epoch // accumulation
    if steps_per_epoch == 0:
        raise ConfigError(
            [
                (
                    "train.micro_batch_size",
                    f"{data.examples} examples over {data_world} {'data-parallel ' if data_world != world_size else ''}ranks do not fill one step of micro-batch {micro} x accumulation {accumulation}"
                    f"{f' ({data.batching_note})' if data.batching_note else ''}: "
                    "lower train.micro_batch_size or train.gradient_accumulation_steps, or add data",
                )
            ]
        )
    if config.train.max_steps:
        total_steps = config.train.max_steps
    else:
        total_steps = max(1, math.ceil((config.train.epochs or 1) * steps_per_epoch))
    resume_universal, resume_position = False, None
    if resume_tag:
        saved_total = saved.get("total_steps", previous_total_steps(run))
        if other_rank_count and not config.train.max_steps and saved_total and saved_total != total_steps:
            # Counted from epochs, the length moves with how the examples round into steps of
            # the new shape; the run's schedule was set for the checkpoint's length.
            notes.append(f"run length kept at {saved_total} steps, the checkpoint's ({total_steps} counted for {world_size} ranks)")
            total_steps = saved_total
        # Before anything of the run is moved: a refused resume leaves the run as it was.
        notes += check_resume_schedule(saved_total, total_steps, resume_tag, new_schedule)
        position = saved_data_position(saved, previous_plan, info.step, saved_shape)
        resume_position = position.to_dict() if position else None
        if other_rank_count and has_partitioned_state(info.path):
            _, converted = convert_to_universal(run.path, info, run.logs, accelerator)
            resume_universal = True
            notes.append(f"{'converted' if converted else 'reusing'} {info.tag} as a universal checkpoint in {universal_dir(run.path) / info.tag} (the original is unchanged)")
        notes += set_aside_future(run, info.step)
    # The user's JSON as resolving read it (and, for a UI run, confined it): never read a second time.
    deepspeed = build_deepspeed_config(config, world_size, total_steps, data.hidden_size, user_json=resolved.user_ds_config)
    notes += warmup_notes(config.train.warmup_steps, total_steps, deepspeed.config, config.deepspeed.config_file)
    notes += [f"DeepSpeed {line}" for line in deepspeed.filled + prefer_exact_adam(deepspeed.config, accelerator)]
    if resume_tag:
        # A user's DeepSpeed JSON may name its own accumulation; the resume's global batch wins.
        deepspeed.config["gradient_accumulation_steps"] = accumulation
        deepspeed.config["train_batch_size"] = micro * accumulation * data_world
    if resume_universal:
        deepspeed.config.setdefault("checkpoint", {})["load_universal"] = True

    plan = RunPlan(
        world_size=world_size,
        accelerator=accelerator,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        micro_batches_per_epoch=micro_batches_per_epoch,
        examples=data.examples,
        micro_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        zero_stage=zero_stage_of(deepspeed.config),
        resume_from=resume_tag,
        resume_universal=resume_universal,
        resume_data_position=resume_position,
        generate_prompts=data.prompts,
        created_at=time.time(),
        node_setup=data.node_setup,
        native_precision=resolved.native_precision[0],
        native_precision_why=resolved.native_precision[1],
        confined_to=resolved.confinement.to_json() if resolved.confinement is not None else None,
        plugins=plugins_in_use(),
        adapter_init=adapter_init,
    )
    if data.node_setup:
        precision, why = encoder_precision_for(accelerator, *resolved.native_precision)
        where = "the node's first GPU" if accelerator == "cuda" else "the CPU"
        notes.append(f"one process fills the caches on {where} before the ranks start (one copy of each encoder per node); text encoders in {precision}: {why}")
    write_atomic(run.config, dump_config(checked))
    write_atomic(run.learned_file, json.dumps({"values": learned}, indent=2))
    write_atomic(run.ds_config, json.dumps(deepspeed.config, indent=2))
    run.write_plan(plan)
    return Prepared(run, plan, config, notes)


def set_aside_future(run: RunDir, step: int) -> list[str]:
    """Resuming from an older checkpoint: what came after it belongs to an abandoned timeline.

    Newer checkpoints are moved aside (never deleted) and later metrics rows dropped, so the
    resumed run writes its own steps without colliding with them.
    """
    notes = []
    newer = [info for info in list_checkpoints(run.path, complete_only=False) if info.step > step]
    if newer:
        aside = run.checkpoints / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir()
        for info in newer:
            info.path.rename(aside / info.tag)
        notes.append(f"moved {len(newer)} newer checkpoint(s) to {aside} (not deleted)")
    rows = run.read_metrics()
    if any(row.get("step", 0) > step for row in rows):
        kept = [json.dumps(row) for row in rows if row.get("step", 0) <= step]
        write_atomic(run.metrics, "".join(line + "\n" for line in kept))
    return notes


def warmup_notes(asked: int, total_steps: int, ds_config: dict, config_file: str | None) -> list[str]:
    """What the warm-up the run applies (the DeepSpeed JSON's scheduler) does with a run this short; said only as it happens."""
    params = (ds_config.get("scheduler") or {}).get("params") or {}
    applied = params.get("warmup_num_steps")
    if not isinstance(applied, int) or isinstance(applied, bool):
        return []
    if applied < asked:
        return [f"train.warmup_steps {asked} is not below the run's {total_steps} steps: warm-up shortened to {applied}"]
    if applied >= total_steps:
        where = f"{config_file}'s scheduler.params.warmup_num_steps" if config_file else "train.warmup_steps"
        return [f"{where} {applied} is not below the run's {total_steps} steps: the learning rate never reaches its peak"]
    return []
