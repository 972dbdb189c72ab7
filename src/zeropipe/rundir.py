"""The layout of a run directory: one place that names every file a run writes, and the typed hand-overs.

The launcher writes ``config.yaml`` (the validated config with its resolved values),
``ds_config.json`` and ``run.json`` (:class:`RunPlan`); each family's preparation writes its
data under ``data/`` and, for diffusion, ``pipeline/``; the ranks write ``logs/``,
``errors/``, ``metrics.jsonl``, ``checkpoints/``, ``samples/``, ``generations.jsonl`` and
``summary.json``. Every command that reads a run (ranks, export, eval, generate, the UI)
goes through :class:`RunDir`, and reads the saved config without re-checking that the
original data paths still exist (:meth:`RunDir.read_config`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from zeropipe.checkpoint.manager import write_atomic
from zeropipe.config.load import load_saved_config

if TYPE_CHECKING:
    from zeropipe.config.schema import RunConfig


@dataclass
class RunPlan:
    """What the launcher decided before starting the ranks; read by every rank."""

    world_size: int
    accelerator: str  # "cuda" or "cpu"
    total_steps: int
    steps_per_epoch: int
    micro_batches_per_epoch: int
    examples: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    zero_stage: int
    resume_from: str | None = None  # checkpoint tag
    generate_prompts: list[str] = field(default_factory=list)
    created_at: float = 0.0


@dataclass
class PreparedData:
    """What a family's data preparation hands to the launcher (the ranks read the files it wrote)."""

    examples: int
    hidden_size: int | None  # for DeepSpeed's bucket sizes
    micro_batches_per_epoch: Callable[[int, int], int]  # (micro_batch_size, world_size) -> per rank
    prompts: list[str] = field(default_factory=list)  # generated (or drawn) at the end of the run
    notes: list[str] = field(default_factory=list)
    batching_note: str = ""  # why examples may not fill a step, said when they do not (e.g. one bucket per micro-batch)


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    config = property(lambda self: self.path / "config.yaml")
    ds_config = property(lambda self: self.path / "ds_config.json")
    plan_file = property(lambda self: self.path / "run.json")
    status_file = property(lambda self: self.path / "status.json")
    tokenizer = property(lambda self: self.path / "tokenizer")
    data = property(lambda self: self.path / "data")
    cache = property(lambda self: self.path / "cache")
    eval_cache = property(lambda self: self.path / "cache" / "eval")  # held-out data, tokenized like the training cache
    logs = property(lambda self: self.path / "logs")
    errors = property(lambda self: self.path / "errors")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    summary = property(lambda self: self.path / "summary.json")
    generations = property(lambda self: self.path / "generations.jsonl")
    checkpoints = property(lambda self: self.path / "checkpoints")
    processor = property(lambda self: self.path / "processor")  # vision-language runs: the processor the ranks use
    pipeline = property(lambda self: self.path / "pipeline")  # diffusion runs from an inline preset: the built pipeline
    samples = property(lambda self: self.path / "samples")  # diffusion sample images, with index.jsonl
    samples_index = property(lambda self: self.path / "samples" / "index.jsonl")
    lock = property(lambda self: self.path / ".lock")

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def rank_error(self, rank: int) -> Path:
        return self.errors / f"rank{rank}.json"

    def read_config(self) -> "RunConfig":
        """The config the run was prepared with (config.yaml), without checking that its data paths still exist."""

        return load_saved_config(self.config)

    def read_plan(self) -> RunPlan:
        return RunPlan(**json.loads(self.plan_file.read_text()))

    def write_plan(self, plan: RunPlan) -> None:
        write_atomic(self.plan_file, json.dumps(asdict(plan), indent=2))

    def read_json(self, path: Path, default: Any = None) -> Any:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return default

    def write_status(self, **fields: Any) -> None:
        status = self.read_json(self.status_file, {}) or {}
        status.update(fields)
        write_atomic(self.status_file, json.dumps(status, indent=2))

    def read_metrics(self) -> list[dict[str, Any]]:
        rows = []
        if self.metrics.is_file():
            for line in self.metrics.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line being written right now
        return rows
