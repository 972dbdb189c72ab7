"""The layout of a run directory: one place that names every file a run writes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zeropipe.checkpoint.manager import write_atomic


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

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def rank_error(self, rank: int) -> Path:
        return self.errors / f"rank{rank}.json"

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
