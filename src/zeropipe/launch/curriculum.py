"""A curriculum (``stages:``): its stages run as sub-runs, one after the other, weights carried by export.

Each stage is an ordinary run directory inside the curriculum's own, prepared by the same
launcher code as a single run, so everything a run has (a fresh DeepSpeed engine with its
own optimizer, schedule and ZeRO stage, checkpoints, exact resume, diagnosis) a stage has
too. At a stage's end its final checkpoint is consolidated into a Hugging Face directory
(``export/``, with a LoRA stage's adapter merged into the weights), and the next stage
builds its model from that directory: a full stage trains all of it, a LoRA stage puts
fresh adapters on it.

Layout of the curriculum's run directory RUN/::

    config.yaml     the curriculum as given, every stage
    stages.json     each stage's state, length and global step offset
    run.json        totals over the stages (what the runs list shows)
    status.json     the launcher's state: running, completed, failed or stopped
    metrics.jsonl   every stage's rows with `stage`, `stage_index`, `stage_step` and a global `step`
    summary.json    first and final loss, per stage and overall
    tokenizer/      a model without a tokenizer gets one, trained once on every stage's data
    stages/NN-name/ one complete run directory per stage, and its export/

Every stage is checked (``zeropipe.check``) and prepared (data read and tokenized, batch
shape, DeepSpeed JSON) before the first one starts, so a problem in stage 3 stops the run
before stage 1 spends an hour. A killed curriculum resumes in the stage that was running,
at its last complete checkpoint; finished stages are not run again.
"""

from __future__ import annotations

import dataclasses

import itertools
import json
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from zeropipe.checkpoint.manager import latest_checkpoint, list_checkpoints, write_atomic
from zeropipe.config.load import dump_config
from zeropipe.config.schema import RunConfig
from zeropipe.config.stages import stage_configs, stage_directory_name, stage_key
from zeropipe.data.tokenizer import train_tokenizer
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.families import export_run, family_of
from zeropipe.families.causal_lm.prepare import prepare_data_file, training_texts
from zeropipe.launch.prepare import Prepared, prepare_run, run_dir_for
from zeropipe.launch.resolve import ResolvedRun, resolve_stages
from zeropipe.launch.supervisor import Supervisor, raise_keyboard_interrupt
from zeropipe.rundir import RunDir, RunPlan

STAGES_FILE = "stages.json"
EXPORT_DIR = "export"


@dataclass
class Stage:
    """One stage: its config and sub-run, and what stages.json records about it."""

    index: int
    name: str
    config: RunConfig
    run: RunDir
    state: str = "pending"  # pending, running, completed, failed, stopped
    total_steps: int = 0
    zero_stage: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    prepared: Prepared | None = None  # set when prepared by this launcher process
    resolved: ResolvedRun | None = None  # the stage as this command resolved it, once; prepare_run takes it

    @property
    def export(self) -> Path:
        return self.run.path / EXPORT_DIR

    def resolved_for(self, config: RunConfig) -> ResolvedRun:
        """The stage's resolved run carrying its config as it is now: the same decisions, with what the
        curriculum set since (the shared tokenizer, the previous stage's weights as model.path), as a new record."""
        assert self.resolved is not None, "a stage is resolved when the curriculum opens"
        return dataclasses.replace(self.resolved, config=config)

    @property
    def label(self) -> str:
        return f"stage {self.index + 1} ({self.name})"

    def trains(self) -> str:
        """What trains, in the user's words."""
        model = self.config.model
        parts = []
        if model.lora is not None:
            targets = model.lora.target_modules if isinstance(model.lora.target_modules, str) else ", ".join(model.lora.target_modules)
            parts.append(f"LoRA r={model.lora.r} on {targets}")
        else:
            parts.append("all weights")
        trainable = getattr(model, "trainable", None)
        if trainable:
            parts.append(f"of {', '.join(trainable)}")
        return " ".join(parts)

    def describe(self) -> str:
        train = self.config.train
        length = f"{self.total_steps} steps" if self.total_steps else (f"{train.max_steps} steps" if train.max_steps else f"{train.epochs or 1} epoch(s)")
        zero = self.zero_stage if self.zero_stage is not None else self.config.deepspeed.zero_stage
        return f"{self.label}: {self.trains()}, ZeRO-{zero}, {length}, lr {train.lr:g} {train.schedule} (warm-up {train.warmup_steps})"

    def to_json(self, step_offset: int, top: Path) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "dir": str(self.run.path.relative_to(top)),
            "state": self.state,
            "total_steps": self.total_steps,
            "step_offset": step_offset,
            "zero_stage": self.zero_stage,
            "trains": self.trains(),
            "lr": self.config.train.lr,
            "schedule": self.config.train.schedule,
            "export": str(self.export.relative_to(top)) if self.export.is_dir() else None,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
        }


class Curriculum:
    """The stages of one curriculum run and the files of its top-level run directory."""

    def __init__(self, config: RunConfig, top: RunDir, stages: list[Stage]):
        self.config = config
        self.top = top
        self.stages = stages
        self.notes: list[str] = []  # about the whole curriculum, from preparing it
        self.stage_notes: list[str] = []  # about the stage being started
        self.metrics_offsets: dict[int, int] = {}
        self.created_at = time.time()

    # ------------------------------------------------------------ opening
    @classmethod
    def open(cls, config: RunConfig, resume: str | bool | None = None, resolved_stages: list | None = None) -> "Curriculum":
        """Prepare a new curriculum (every stage), or reopen one to resume it.

        Args:
            resolved_stages: the stages as the command resolved (and checked) them, once
                (:func:`zeropipe.launch.resolve.resolve_stages`); resolved here when not given.

        Raises:
            ZeroPipeError: with every stage's problems, each prefixed stages[N]; nothing of
                a new run is started when one is raised.
        """
        if not config.stages:
            raise ZeroPipeError("not a curriculum: the config has no stages")
        family = family_of(config.model)
        problems = family.curriculum_problems(config)
        if problems:
            raise ConfigError(problems)
        if resume:
            top = RunDir(find_curriculum(Path(resume)) if resume is not True else run_dir_for(config))
            if not top.stages_file.is_file():
                raise ZeroPipeError(f"{top.path} holds no curriculum run (no {STAGES_FILE}) to resume: start it without --resume")
        else:
            top = RunDir(run_dir_for(config))
            if top.stages_file.is_file() or top.metrics.exists() or list_checkpoints(top.path, complete_only=False):
                raise ZeroPipeError(
                    f"{top.path} already holds a run: continue it with --resume, or choose another run.name "
                    f"(e.g. run.name={top.path.name}-2); nothing was overwritten"
                )

        curriculum = cls(config, top, make_stages(config, top))
        # Each stage plans its own "auto" knobs: a full stage may need ZeRO-3 where a LoRA stage fits with ZeRO-2.
        if resolved_stages is None:
            resolved_stages = resolve_stages(config)
        for stage, resolved in zip(curriculum.stages, resolved_stages):
            if isinstance(resolved, ZeroPipeError):
                raise resolved
            # Resolving does not depend on where a run is written: the stage keeps its sub-run directory.
            resolved.config.run.output_dir, resolved.config.run.name = stage.config.run.output_dir, stage.config.run.name
            stage.resolved = resolved
            stage.config = resolved.config
            curriculum.notes += [f"{stage.label}: {note}" for note in resolved.notes]
        if resume:
            curriculum.reopen()
        else:
            curriculum.prepare_all()
        return curriculum

    def prepare_all(self) -> None:
        """A new curriculum: lay out RUN/, train the shared tokenizer if needed, prepare every stage."""
        self.top.path.mkdir(parents=True, exist_ok=True)
        self.top.logs.mkdir(exist_ok=True)
        write_atomic(self.top.config, dump_config(self.config))
        if family_of(self.config.model).trains_tokenizer and not (self.config.model.tokenizer or self.config.model.path):
            self.notes.append(self.train_shared_tokenizer())
        problems: list[tuple[str, str]] = []
        for stage in self.stages:
            try:
                stage.prepared = prepare_run(stage.resolved_for(stage.config))
                stage.config = stage.prepared.config  # what preparation resolved (family, vocabulary) is what start() writes again
            except ConfigError as err:
                problems += [(stage_key(stage.index, key), message) for key, message in err.problems]
                continue
            except ZeroPipeError as err:
                problems.append((f"stages[{stage.index}]", f"{stage.name}: {err}"))
                continue
            stage.total_steps = stage.prepared.plan.total_steps
            stage.zero_stage = stage.prepared.plan.zero_stage
            self.notes += [f"{stage.label}: {note}" for note in stage.prepared.notes]
        if problems:
            raise ConfigError(problems, source="the curriculum's stages (nothing was started)")
        self.save()

    def train_shared_tokenizer(self) -> str:
        """One tokenizer for every stage (their model is the same), trained on every stage's data."""

        texts = []
        for stage in self.stages:
            stage.run.path.mkdir(parents=True, exist_ok=True)
            texts.append(training_texts(stage.config, prepare_data_file(stage.config, stage.run)))
        # Streamed stage after stage into the trainer: no stage's records are all held.
        train_tokenizer(itertools.chain.from_iterable(texts), self.config.model.tokenizer_vocab_size, self.top.tokenizer)
        for stage in self.stages:
            stage.config.model.tokenizer = str(self.top.tokenizer.resolve())
        return f"tokenizer: trained once on the data of all {len(self.stages)} stages ({self.top.tokenizer})"

    def reopen(self) -> None:
        """A resume: the stages as stages.json recorded them; the config must have the same stages."""
        saved = self.top.read_stages()
        names = [row["name"] for row in saved["stages"]]
        if names != [stage.name for stage in self.stages]:
            raise ZeroPipeError(
                f"the config's stages ({', '.join(s.name for s in self.stages)}) are not the run's ({', '.join(names)}): "
                f"resume with the config the run started with: zeropipe train {self.top.config} --resume"
            )
        self.created_at = saved.get("created_at", self.created_at)
        if self.top.tokenizer.is_dir() and not (self.config.model.tokenizer or self.config.model.path):
            for stage in self.stages:
                stage.config.model.tokenizer = str(self.top.tokenizer.resolve())
        for stage, row in zip(self.stages, saved["stages"]):
            stage.state = row["state"]
            stage.total_steps = row.get("total_steps") or 0
            stage.zero_stage = row.get("zero_stage")
            stage.started_at, stage.ended_at = row.get("started_at"), row.get("ended_at")
        if all(stage.state == "completed" and stage.export.is_dir() for stage in self.stages):
            raise ZeroPipeError(f"every stage of {self.top.path} is complete: there is nothing left to train (the weights are in {self.stages[-1].export})")

    # ------------------------------------------------------------ running
    def remaining(self) -> list[Stage]:
        """The stages still to run, in order: finished ones (exported) are skipped."""
        return [stage for stage in self.stages if not (stage.state == "completed" and stage.export.is_dir())]

    def step_offset(self, stage: Stage) -> int:
        return sum(s.total_steps for s in self.stages[: stage.index])

    def start(self, stage: Stage) -> Prepared:
        """Point the stage at the weights of the stage before it and lay it out for its ranks.

        A stage prepared by this process only gets its model updated; a stage of a resumed
        curriculum is prepared again, to resume from its latest checkpoint when it has one
        or to start over when it was killed before saving any.
        """
        if stage.index > 0:
            previous = self.stages[stage.index - 1]
            if not (previous.export / "config.json").is_file():
                raise ZeroPipeError(f"{previous.label} has no exported weights in {previous.export} for {stage.label} to start from: resume the run")
            # Absolute: later commands (export, generate) read this config.yaml from anywhere.
            stage.config.model.path = str(previous.export.resolve())
            stage.config.model.config = None
        if stage.prepared is not None and stage.prepared.plan.resume_from is None and latest_checkpoint(stage.run.path) is None:
            write_atomic(stage.run.config, dump_config(stage.config))
            prepared = stage.prepared
            self.stage_notes = []  # said when every stage was prepared
        else:
            checkpoint = latest_checkpoint(stage.run.path)
            if checkpoint is None:
                # Killed before its first checkpoint: the stage starts over.
                for leftover in (stage.run.metrics, stage.run.summary):
                    leftover.unlink(missing_ok=True)
                shutil.rmtree(stage.run.checkpoints, ignore_errors=True)
            prepared = prepare_run(stage.resolved_for(stage.config), resume=True if checkpoint else None)
            self.stage_notes = list(prepared.notes)
        stage.prepared = prepared
        stage.total_steps = prepared.plan.total_steps
        stage.zero_stage = prepared.plan.zero_stage
        stage.state = "running"
        stage.started_at = stage.started_at or time.time()
        self.rebuild_metrics(upto=stage)
        self.save()
        self.top.write_status(state="running", stage=stage.name, supervisor_pid=os.getpid(), started_at=time.time(), ended_at=None, diagnosis=None)
        return prepared

    def running(self, pids: list[int]) -> None:
        self.top.write_status(pids=pids)

    def ended(self, stage: Stage, state: str, diagnosis: dict | None = None) -> None:
        """Record how a stage ended; a completed stage's weights are exported for the next one.

        Raises:
            ZeroPipeError: the export failed (the stage stays completed-but-unexported, and a
                resume exports it again without training it again).
        """
        self.mirror(stage)
        stage.ended_at = time.time()
        if state != "completed":
            stage.state = state
            self.save()
            self.top.write_status(state=state, stage=stage.name, ended_at=time.time(), diagnosis=diagnosis)
            return
        stage.state = "completed"
        self.save()
        try:
            self.export(stage)
        except ZeroPipeError as err:
            diagnosis = {
                "text": f"{stage.label} trained, but exporting its weights for the next stage failed: {err}",
                "cause": "the export between stages failed",
                "fix": "fix the cause and resume: the export is retried without training the stage again",
            }
            self.top.write_status(state="failed", stage=stage.name, ended_at=time.time(), diagnosis=diagnosis)
            raise
        self.save()

    def run(self, master_port: int, say: Callable[[str], None], progress_for: Callable[[RunDir, int], Any], resume_hint: str) -> tuple[str, dict | None]:
        """Train the remaining stages one after the other, each watched by a supervisor.

        Args:
            say: where the stages' progress lines go (the CLI prints them).
            progress_for: ``(stage run, total steps)`` -> an object with update() and close().
            resume_hint: the command that continues this curriculum, said after a failure or stop.

        Returns:
            ("completed", summary), or ("failed" | "stopped", None); the stage that failed is
            recorded in the curriculum's status with its diagnosis.
        """

        # Between stages no supervisor is watching: a SIGTERM (the UI's stop button) must still end the run cleanly.
        previous = signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
        current = None
        try:
            for stage in self.remaining():
                current = stage
                if stage.state == "completed":
                    say(f"{stage.label} finished training before; exporting its weights again")
                    self.export_again(stage)
                    continue
                prepared = self.start(stage)
                plan = prepared.plan
                resumed = f", resuming from {plan.resume_from}" if plan.resume_from else ""
                say(f"{stage.label}: {plan.world_size} {plan.accelerator.upper()} ranks, ZeRO stage {plan.zero_stage}, {plan.total_steps} steps{resumed}")
                for note in self.stage_notes:
                    say(f"  {note}")
                progress = progress_for(stage.run, plan.total_steps)

                def tick(stage=stage, progress=progress) -> None:
                    progress.update()
                    self.mirror(stage)

                supervisor = Supervisor(stage.run, plan.world_size, plan.accelerator, master_port, on_tick=tick)
                supervisor.start()
                self.running([proc.pid for proc in supervisor.procs])
                say(f"logs: {stage.run.logs}/rank*.log")
                outcome = supervisor.wait()
                tick()
                progress.close()
                if outcome.state == "failed":
                    assert outcome.diagnosis is not None
                    self.ended(stage, "failed", outcome.diagnosis.to_dict())
                    say("")
                    say(f"{stage.label} failed: " + outcome.diagnosis.render())
                    say(f"resume after fixing it: {resume_hint}  (finished stages are not run again)")
                    return "failed", None
                if outcome.state == "stopped":
                    self.ended(stage, "stopped")
                    say(f"stopped in {stage.label}; all ranks ended. continue with: {resume_hint}")
                    return "stopped", None
                say(f"{stage.label} done; exporting its weights{' for the next stage' if stage is not self.stages[-1] else ''}")
                self.ended(stage, "completed")
            summary = self.finish()
        except KeyboardInterrupt:
            self.stopped(current)
            say(f"stopped{f' in {current.label}' if current else ''}. continue with: {resume_hint}")
            return "stopped", None
        finally:
            signal.signal(signal.SIGTERM, previous)
        return "completed", summary

    def export(self, stage: Stage) -> Path:
        """The stage's final weights as a Hugging Face directory (LoRA merged), in the next stage's precision."""
        import contextlib

        following = self.stages[stage.index + 1] if stage.index + 1 < len(self.stages) else stage
        self.top.logs.mkdir(exist_ok=True)
        # zero_to_fp32 and transformers report progress on stdout and stderr: into a log, not over the stage's summary.
        with open(self.top.logs / f"export-{stage.run.path.name}.log", "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            return export_run(stage.run.path, stage.export, merge=True, dtype=following.config.deepspeed.precision, force=True)

    def export_again(self, stage: Stage) -> Path:
        """A stage that finished training but whose export was interrupted: export it, without training it again."""
        out = self.export(stage)
        self.save()
        return out

    def stopped(self, stage: Stage | None) -> None:
        """Ctrl-C or SIGTERM outside a stage's ranks (while exporting or preparing)."""
        if stage is not None and stage.state == "running":
            stage.state = "stopped"
            stage.ended_at = time.time()
            self.save()
        self.top.write_status(state="stopped", ended_at=time.time())

    def finish(self) -> dict[str, Any]:
        """Every stage done: the summary, the last stage's generations, status completed."""
        rows = [row for row in self.top.read_metrics() if row.get("kind") is None]  # training steps; eval rows apart
        per_stage = []
        for stage in self.stages:
            own = [row for row in rows if row.get("stage_index") == stage.index]
            per_stage.append(
                {
                    "name": stage.name,
                    "steps": stage.total_steps,
                    "first_loss": own[0]["loss"] if own else None,
                    "final_loss": own[-1]["loss"] if own else None,
                    "trains": stage.trains(),
                    "zero_stage": stage.zero_stage,
                }
            )
        last = self.stages[-1]
        summary = {
            "steps": sum(stage.total_steps for stage in self.stages),
            "first_loss": rows[0]["loss"] if rows else None,
            "final_loss": rows[-1]["loss"] if rows else None,
            "stages": per_stage,
            "final_weights": str(last.export),
            "zero_stage": last.zero_stage,
        }
        write_atomic(self.top.summary, json.dumps(summary, indent=2))
        if last.run.generations.is_file():
            shutil.copyfile(last.run.generations, self.top.generations)
        self.top.write_status(state="completed", ended_at=time.time())
        return summary

    # ------------------------------------------------------------ records
    def save(self) -> None:
        """stages.json and run.json: written after every change of state, atomically."""
        offsets, stages = 0, []
        for stage in self.stages:
            stages.append(stage.to_json(offsets, self.top.path))
            offsets += stage.total_steps
        current = next((s.name for s in self.stages if s.state in ("running", "failed", "stopped")), None)
        write_atomic(self.top.stages_file, json.dumps({"created_at": self.created_at, "current": current, "stages": stages}, indent=2))
        self.write_plan()

    def write_plan(self) -> None:
        """run.json in a single run's shape, with totals over the stages, for the runs list."""
        first = self.stages[0]
        plan = first.prepared.plan if first.prepared else None
        current = next((s for s in self.stages if s.state == "running"), self.stages[-1])
        total = RunPlan(
            world_size=plan.world_size if plan else 0,
            accelerator=plan.accelerator if plan else "cpu",
            total_steps=sum(stage.total_steps for stage in self.stages),
            steps_per_epoch=plan.steps_per_epoch if plan else 0,
            micro_batches_per_epoch=plan.micro_batches_per_epoch if plan else 0,
            examples=sum(stage.prepared.plan.examples for stage in self.stages if stage.prepared),
            micro_batch_size=plan.micro_batch_size if plan else 0,
            gradient_accumulation_steps=plan.gradient_accumulation_steps if plan else 0,
            zero_stage=current.zero_stage if current.zero_stage is not None else 0,
            created_at=self.created_at,
        )
        if plan is None and self.top.plan_file.is_file():
            # A resumed curriculum keeps what the first launch knew about stages it does not prepare again.
            saved = self.top.read_plan_fields()
            for key in ("world_size", "accelerator", "steps_per_epoch", "micro_batches_per_epoch", "examples", "micro_batch_size", "gradient_accumulation_steps"):
                setattr(total, key, saved.get(key, getattr(total, key)))
        write_atomic(self.top.plan_file, json.dumps(asdict(total), indent=2))

    def labelled(self, stage: Stage, row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "step": self.step_offset(stage) + row["step"], "stage": stage.name, "stage_index": stage.index, "stage_step": row["step"]}

    def rebuild_metrics(self, upto: Stage) -> None:
        """RUN/metrics.jsonl from the stages' own files: after a resume dropped a stage's later rows, the whole stays consistent."""
        lines = []
        for stage in self.stages[: upto.index + 1]:
            rows, self.metrics_offsets[stage.index] = stage.run.read_metrics_from(0)  # a line being written is mirrored once it is whole
            lines += [json.dumps(self.labelled(stage, row)) for row in rows]
        write_atomic(self.top.metrics, "".join(line + "\n" for line in lines))

    def mirror(self, stage: Stage) -> None:
        """Append the stage's new rows (whole lines only: rank 0 may be writing one) to RUN/metrics.jsonl."""
        offset = self.metrics_offsets.get(stage.index, 0)
        rows, self.metrics_offsets[stage.index] = stage.run.read_metrics_from(offset)
        if not rows:
            return
        with open(self.top.metrics, "a") as handle:
            handle.writelines(json.dumps(self.labelled(stage, row)) + "\n" for row in rows)


def make_stages(config: RunConfig, top: RunDir) -> list[Stage]:
    """Each stage's config, pointed at its sub-run directory RUN/stages/NN-name."""
    stages = []
    assert config.stages is not None
    for index, (section, stage_config) in enumerate(zip(config.stages, stage_configs(config))):
        stage_config.run.output_dir = str(top.path / "stages")
        stage_config.run.name = stage_directory_name(index, section.name)
        stages.append(Stage(index, section.name, stage_config, RunDir(run_dir_for(stage_config))))
    return stages


def find_curriculum(path: Path) -> Path:
    """The curriculum run directory ``path`` is or lies in (a stage, a checkpoint of one)."""
    path = path.expanduser().resolve()
    for candidate in (path, *path.parents):
        if RunDir(candidate).stages_file.is_file():
            return candidate
    raise ZeroPipeError(f"{path} is not inside a curriculum run directory (none of its folders holds {STAGES_FILE}): give the run directory RUN")
