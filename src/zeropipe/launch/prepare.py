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
from typing import Callable

from zeropipe.checkpoint.manager import list_checkpoints, resolve_checkpoint, write_atomic
from zeropipe.checkpoint.resume import check_resume_schedule, prefer_exact_adam, previous_total_steps
from zeropipe.config.deepspeed import build_deepspeed_config, effective_batch_shape, zero_stage_of
from zeropipe.config.load import dump_config
from zeropipe.config.schema import RunConfig
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.rundir import RunDir, RunPlan


@dataclass
class Prepared:
    run: RunDir
    plan: RunPlan
    notes: list[str] = field(default_factory=list)  # what the user should read before training starts


def detect_accelerator(config: RunConfig) -> tuple[str, int]:
    """(accelerator, number of ranks) for this machine and config."""
    import torch

    wanted = config.hardware.accelerator
    has_cuda = torch.cuda.is_available()
    if wanted == "cuda" and not has_cuda:
        raise ConfigError([("hardware.accelerator", "cuda was asked for but torch sees no CUDA device: set hardware.accelerator: auto or cpu")])
    accelerator = "cuda" if (wanted == "cuda" or (wanted == "auto" and has_cuda)) else "cpu"
    gpus = config.hardware.gpus
    if gpus != "auto" and gpus < 1:
        raise ConfigError([("hardware.gpus", f"must be at least 1 (you set {gpus}): the number of ranks to start, one per GPU, or auto")])
    if gpus == "auto":
        gpus = torch.cuda.device_count() if accelerator == "cuda" else 2
    elif accelerator == "cuda" and gpus > torch.cuda.device_count():
        raise ConfigError([("hardware.gpus", f"{gpus} ranks asked for but only {torch.cuda.device_count()} GPUs are visible: lower hardware.gpus")])
    return accelerator, int(gpus)


def run_dir_for(config: RunConfig) -> Path:
    return Path(config.run.output_dir) / (config.run.name or "run")


def prepare_run(config: RunConfig, resume: str | bool | None = None, world_size: int | None = None, new_schedule: bool = False) -> Prepared:
    """Lay out (or reopen, for a resume) the run directory and write what the ranks read.

    Args:
        resume: False/None for a new run; True to continue the run directory's latest
            checkpoint; a path to a run directory or checkpoint to continue from.

    Raises:
        ZeroPipeError: with the fix, for anything that would make the ranks fail.
    """
    accelerator, detected = detect_accelerator(config)
    world_size = world_size or detected
    notes: list[str] = []
    run = RunDir(run_dir_for(config))
    resume_tag = None
    if resume:
        run_path, info = resolve_checkpoint(run.path if resume is True else Path(resume))
        run = RunDir(run_path)
        run.claim()  # refuses a run directory a live launcher owns, before anything is read or moved
        resume_tag = info.tag
        saved = json.loads((info.path / "zeropipe_complete.json").read_text())
        if saved.get("world_size") not in (None, world_size):
            raise ZeroPipeError(
                f"checkpoint {info.tag} was saved by {saved['world_size']} ranks and this run has {world_size}: "
                f"resume with hardware.gpus={saved['world_size']} (changing the rank count needs a universal checkpoint)"
            )
        notes.append(f"resuming {run.path} from {info.tag} (step {info.step})")
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

    from zeropipe.models.family import model_family

    # Written into config.yaml, so every rank and every later command agrees on it.
    config.model.family = model_family(config.model)
    if config.model.family != "causal_lm":
        text_only = [key for key in ("packing", "group_by_length", "eval_path", "eval_fraction", "mixture") if getattr(config.data, key)]
        if text_only:
            raise ConfigError([(f"data.{key}", f"is implemented for causal language models only, and this is a {config.model.family} run: remove it") for key in text_only])
    if config.model.family == "diffusion":
        from zeropipe.diffusion.prepare import prepare_diffusion_data

        data = prepare_diffusion_data(config, run, reuse=bool(resume_tag))
    elif config.model.family == "vlm":
        from zeropipe.data.vlm import prepare_vlm_data

        data = prepare_vlm_data(config, run, reuse=bool(resume_tag))
    else:
        data = prepare_text_data(config, run, reuse=bool(resume_tag))
    notes += data.notes

    # Resolve the batch shape first: a user's DeepSpeed JSON may set it explicitly.
    probe = build_deepspeed_config(config, world_size, total_steps=1, hidden_size=data.hidden_size)
    micro, accumulation = effective_batch_shape(probe.config)
    micro_batches_per_epoch = data.micro_batches_per_epoch(micro, world_size)
    steps_per_epoch = micro_batches_per_epoch // accumulation
    if steps_per_epoch == 0:
        raise ConfigError(
            [
                (
                    "train.micro_batch_size",
                    f"{data.examples} examples over {world_size} ranks do not fill one step of micro-batch {micro} x accumulation {accumulation}"
                    f"{' (a micro-batch takes images of one bucket only)' if config.model.family == 'diffusion' else ''}: "
                    "lower train.micro_batch_size or train.gradient_accumulation_steps, or add data",
                )
            ]
        )
    if config.train.max_steps:
        total_steps = config.train.max_steps
    else:
        total_steps = max(1, math.ceil((config.train.epochs or 1) * steps_per_epoch))
    if resume_tag:
        # Before anything of the run is moved: a refused resume leaves the run as it was.
        notes += check_resume_schedule(saved.get("total_steps", previous_total_steps(run)), total_steps, resume_tag, new_schedule)
        notes += set_aside_future(run, info.step)
    if config.train.warmup_steps >= total_steps:
        notes.append(f"train.warmup_steps {config.train.warmup_steps} is not below the run's {total_steps} steps: warm-up shortened to {max(1, total_steps - 1)}")
    resolved = build_deepspeed_config(config, world_size, total_steps, data.hidden_size)
    notes += [f"DeepSpeed {line}" for line in resolved.filled + prefer_exact_adam(resolved.config, accelerator)]

    plan = RunPlan(
        world_size=world_size,
        accelerator=accelerator,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        micro_batches_per_epoch=micro_batches_per_epoch,
        examples=data.examples,
        micro_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        zero_stage=zero_stage_of(resolved.config),
        resume_from=resume_tag,
        generate_prompts=data.prompts,
        created_at=time.time(),
    )
    write_atomic(run.config, dump_config(config))
    write_atomic(run.ds_config, json.dumps(resolved.config, indent=2))
    run.write_plan(plan)
    return Prepared(run, plan, notes)


@dataclass
class FamilyData:
    """What a model family's data preparation tells the launcher."""

    examples: int
    hidden_size: int | None  # for DeepSpeed's bucket sizes
    micro_batches_per_epoch: Callable[[int, int], int]  # (micro_batch_size, world_size) -> per rank
    prompts: list[str] = field(default_factory=list)  # generated (or drawn) at the end of the run
    notes: list[str] = field(default_factory=list)


def prepare_text_data(config: RunConfig, run: RunDir, reuse: bool) -> FamilyData:
    """Causal LMs: the records read, validated and tokenized into the run's token cache."""
    records_path = prepare_data_file(config, run)
    tokenizer = prepare_tokenizer(config, run, records_path, reuse=reuse)
    cache = prepare_cache(config, run, records_path, tokenizer, reuse=reuse)
    notes = []
    if config.data.mixture:
        from zeropipe.data.mixture import mixture_note

        notes += [note for note in [mixture_note(run.data)] if note]
    from zeropipe.data.tokenize import describe_cache

    notes += describe_cache(cache, records_path, config.data.format)
    if cache.get("bad_records"):
        shown = ", ".join(f"line {b['line']}: {b['reason']}" for b in cache["bad_records"][:3])
        notes.append(f"skipped {cache.get('bad_record_count', len(cache['bad_records']))} malformed record(s) in {records_path} ({shown})")

    from zeropipe.models.causal_lm import hidden_size_of, model_config

    if config.model.config is not None and config.model.config.get("vocab_size") in (None, "auto"):
        config.model.config = {**config.model.config, "vocab_size": len(tokenizer)}
        notes.append(f"model.config.vocab_size = {len(tokenizer)} (from the tokenizer)")
    hf_config = model_config(config.model)
    if getattr(hf_config, "vocab_size", None) is not None and len(tokenizer) > hf_config.vocab_size:
        raise ConfigError([("model.config.vocab_size", f"{hf_config.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens: raise it or remove it")])
    examples = int(cache["examples"])
    notes += prepare_eval_cache(config, run, records_path, tokenizer, reuse=reuse)
    # What the sampler deals out: examples, or packed sequences of several examples.
    units = examples
    if config.data.packing:
        packs = prepare_packs(config, run, reuse=reuse)
        units = int(packs["packs"])
        notes.append(
            f"packing: {examples} examples in {units} sequences of up to {config.data.max_seq_len} tokens ({100 * packs['fill']:.0f}% real tokens); "
            "train.micro_batch_size counts packed sequences"
        )
    prompts = list(config.generate.prompts or [])
    if config.generate.prompts is None and config.data.synthetic is not None:
        from zeropipe.data.synthetic import sample_prompts

        prompts = sample_prompts(config.data.synthetic.task, 4, seed=config.data.synthetic.seed + 1)
    return FamilyData(
        examples=examples,
        hidden_size=hidden_size_of(hf_config),
        micro_batches_per_epoch=lambda micro, world_size: (units // world_size) // micro,
        prompts=prompts,
        notes=notes,
    )


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


def prepare_data_file(config: RunConfig, run: RunDir) -> Path:
    if config.data.mixture:
        from zeropipe.data.mixture import build_mixture

        return build_mixture(config.data, run.data, config.run.seed)
    if config.data.synthetic is None:
        return Path(config.data.path).expanduser()
    from zeropipe.data.synthetic import generate_dataset

    path = run.data / "train.jsonl"
    if not path.is_file():
        run.data.mkdir(exist_ok=True)
        synthetic = config.data.synthetic
        generate_dataset(synthetic.task, synthetic.examples, synthetic.seed, path)
    return path


def prepare_tokenizer(config: RunConfig, run: RunDir, records_path: Path, reuse: bool):
    from transformers import AutoTokenizer

    if reuse and run.tokenizer.is_dir():
        return AutoTokenizer.from_pretrained(str(run.tokenizer))
    source = config.model.tokenizer or config.model.path
    if source:
        tokenizer = AutoTokenizer.from_pretrained(source)
        if tokenizer.pad_token is None:
            # Padding is masked out of attention and loss, so the EOS token can stand in.
            tokenizer.pad_token = tokenizer.eos_token
    else:
        from zeropipe.data.formats import detect_format, read_records
        from zeropipe.data.tokenizer import texts_for_tokenizer, train_tokenizer

        records, bad = read_records(records_path)
        fmt = detect_format(records, config.data.format, source=records_path, bad=bad)
        tokenizer = train_tokenizer(texts_for_tokenizer(records, fmt), config.model.tokenizer_vocab_size, run.tokenizer)
    tokenizer.save_pretrained(str(run.tokenizer))
    return tokenizer


def prepare_cache(config: RunConfig, run: RunDir, records_path: Path, tokenizer, reuse: bool) -> dict:
    from zeropipe.data.tokenize import build_token_cache

    info_file = run.cache / "cache.json"
    if reuse and info_file.is_file():
        return json.loads(info_file.read_text())
    build_token_cache(
        records_path,
        tokenizer,
        run.cache,
        fmt=config.data.format,
        max_seq_len=config.data.max_seq_len,
        max_bad_fraction=config.data.max_bad_fraction,
        max_bad_records=config.data.max_bad_records,
        split=record_split(config, held_out=False),
    )
    return json.loads(info_file.read_text())


def record_split(config: RunConfig, held_out: bool):
    """The data.eval_fraction split of data.path (None without one); drawn with run.seed."""
    from zeropipe.data.split import RecordSplit

    if not config.data.eval_fraction:
        return None
    return RecordSplit(config.data.eval_fraction, config.run.seed, held_out=held_out)


def prepare_eval_cache(config: RunConfig, run: RunDir, records_path: Path, tokenizer, reuse: bool) -> list[str]:
    """Tokenize the held-out data (data.eval_path, or data.eval_fraction of data.path) into RUN/cache/eval."""
    from zeropipe.data.tokenize import build_token_cache

    data = config.data
    if not (data.eval_path or data.eval_fraction):
        return []
    info_file = run.eval_cache / "cache.json"
    if not (reuse and info_file.is_file()):
        build_token_cache(
            Path(data.eval_path).expanduser() if data.eval_path else records_path,
            tokenizer,
            run.eval_cache,
            fmt=data.format,
            max_seq_len=data.max_seq_len,
            max_bad_fraction=data.max_bad_fraction,
            max_bad_records=data.max_bad_records,
            split=record_split(config, held_out=True),
        )
    info = json.loads(info_file.read_text())
    source = data.eval_path or f"{100 * data.eval_fraction:.3g}% of the records of {records_path}, drawn with run.seed"
    when = f"every {config.train.eval_every} steps and " if config.train.eval_every else ""
    return [f"evaluation: {info['examples']} held-out examples ({source}), {when}at the end"]


def prepare_packs(config: RunConfig, run: RunDir, reuse: bool) -> dict:
    """Decide once which examples share a packed sequence, so every rank and every resume agrees."""
    from zeropipe.data.packing import build_pack_index, read_pack_info

    info = read_pack_info(run.cache)
    if reuse and info is not None and info.get("max_seq_len") == config.data.max_seq_len:
        return info
    return build_pack_index(run.cache, config.data.max_seq_len)
