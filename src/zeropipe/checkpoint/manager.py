"""Checkpoint layout, completeness and retention.

A checkpoint is a DeepSpeed tag directory ``checkpoints/step_00000120``. It counts only once
it holds ``zeropipe_complete.json``, which rank 0 writes after every rank has finished its part
of the save; only then does the ``latest`` pointer move to it (written to a temporary file and
renamed, so it is never half-written) and only then are older checkpoints pruned. A crash or
kill during a save therefore leaves the previous checkpoint untouched and ``latest`` on it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from zeropipe.errors import CheckpointError

COMPLETE_MARKER = "zeropipe_complete.json"
TAG_PATTERN = re.compile(r"^step_(\d+)$")
SUPERSEDED = "superseded-"  # checkpoints/superseded-DATE: newer checkpoints a resume set aside
UNIVERSAL = "universal"  # checkpoints/universal/TAG: a checkpoint converted for another rank count (checkpoint/universal.py)
UNIVERSAL_MARKER = "zeropipe_universal.json"  # a universal copy counts only once it holds this
EMA_FILE = "ema_rank{rank}.pt"  # checkpoints/TAG/ema_rank0.pt: one rank's partition of the EMA weights (engine/ema.py)


@dataclass(frozen=True)
class CheckpointInfo:
    tag: str
    step: int
    path: Path


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def universal_dir(run_dir: Path) -> Path:
    """Where universal copies of a run's checkpoints live, one tag directory each (DeepSpeed's ``load_dir``)."""
    return checkpoints_dir(run_dir) / UNIVERSAL


def is_complete(tag_dir: Path) -> bool:
    return (tag_dir / COMPLETE_MARKER).is_file()


def list_checkpoints(run_dir: Path, complete_only: bool = True) -> list[CheckpointInfo]:
    """Checkpoints of a run, oldest first."""
    root = checkpoints_dir(run_dir)
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = TAG_PATTERN.match(child.name)
            if match and child.is_dir() and (is_complete(child) or not complete_only):
                found.append(CheckpointInfo(child.name, int(match.group(1)), child))
    return sorted(found, key=lambda info: info.step)


def latest_checkpoint(run_dir: Path) -> CheckpointInfo | None:
    """The checkpoint to resume from: the one ``latest`` names if complete, else the newest complete one."""
    root = checkpoints_dir(run_dir)
    complete = list_checkpoints(run_dir)
    pointer = root / "latest"
    if pointer.is_file():
        tag = pointer.read_text().strip()
        for info in complete:
            if info.tag == tag:
                return info
    return complete[-1] if complete else None


def resolve_checkpoint(path: Path) -> tuple[Path, CheckpointInfo]:
    """Accept a run directory, its checkpoints folder or one tag directory; return (run_dir, checkpoint).

    Raises:
        CheckpointError: when no complete checkpoint is there.
    """
    path = Path(path)
    if TAG_PATTERN.match(path.name) and path.parent.name == "checkpoints":
        run_dir = path.parent.parent
        if not is_complete(path):
            raise CheckpointError(
                f"{path} is not a complete checkpoint (no {COMPLETE_MARKER}: the save was interrupted); "
                f"resume from the run directory {run_dir} to use the newest complete one"
            )
        return run_dir, CheckpointInfo(path.name, int(TAG_PATTERN.match(path.name).group(1)), path)
    run_dir = path.parent if path.name == "checkpoints" else path
    if (run_dir / "stages.json").is_file() and not checkpoints_dir(run_dir).is_dir():
        run_dir = latest_stage_with_checkpoint(run_dir)
    info = latest_checkpoint(run_dir)
    if info is None:
        raise CheckpointError(f"{run_dir} has no complete checkpoint: train with train.save_every set, or start a new run without --resume")
    return run_dir, info


def latest_stage_with_checkpoint(run_dir: Path) -> Path:
    """A curriculum's weights are in its stages' sub-runs: the directory of the latest stage that saved a checkpoint.

    Raises:
        CheckpointError: no stage has saved one yet.
    """
    stages = json.loads((Path(run_dir) / "stages.json").read_text()).get("stages", [])
    for stage in reversed(stages):
        if list_checkpoints(Path(run_dir) / stage["dir"]):
            return Path(run_dir) / stage["dir"]
    raise CheckpointError(f"{run_dir} is a curriculum none of whose stages has saved a checkpoint yet: wait for its first stage to save one")


def mark_complete(run_dir: Path, step: int, meta: dict) -> None:
    """Rank 0, after every rank finished saving: seal the checkpoint and move ``latest`` to it."""
    root = checkpoints_dir(run_dir)
    tag_dir = root / tag_for(step)
    write_atomic(tag_dir / COMPLETE_MARKER, json.dumps({"step": step, "saved_at": time.time(), **meta}, indent=2))
    # DeepSpeed's own tools (zero_to_fp32) read the same `latest` file.
    write_atomic(root / "latest", tag_for(step))


def prune(run_dir: Path, keep_last: int) -> list[str]:
    """Delete complete checkpoints beyond the newest ``keep_last``, leftovers of interrupted saves,
    and set-aside checkpoints the run has overtaken."""
    complete = list_checkpoints(run_dir)
    newest = complete[-1].step if complete else -1
    removed = []
    for info in complete[:-keep_last]:
        shutil.rmtree(info.path, ignore_errors=True)
        removed.append(info.tag)
    for info in list_checkpoints(run_dir, complete_only=False):
        # An incomplete tag older than the newest complete one can only be an interrupted save.
        if not is_complete(info.path) and info.step < newest:
            shutil.rmtree(info.path, ignore_errors=True)
            removed.append(info.tag)
    for aside in checkpoints_dir(run_dir).glob(f"{SUPERSEDED}*"):
        # Checkpoints a resume from an older one set aside: kept until the resumed run has got
        # at least as far, then they are only an abandoned past taking disk space.
        if not aside.is_dir():
            continue
        steps = [int(m.group(1)) for m in (TAG_PATTERN.match(child.name) for child in aside.iterdir()) if m]
        if max(steps, default=-1) <= newest:
            shutil.rmtree(aside, ignore_errors=True)
            removed.append(aside.name)
    universal = universal_dir(run_dir)
    if universal.is_dir():
        # A universal copy served one resume on another rank count; once the run has saved a
        # newer checkpoint of its own it is not needed (its original is kept or pruned as any
        # checkpoint). Leftovers of an interrupted conversion (".converting-...") go too: no
        # conversion runs while the ranks train.
        for child in universal.iterdir():
            match = TAG_PATTERN.match(child.name)
            if (match and int(match.group(1)) < newest) or child.name.startswith("."):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(f"{UNIVERSAL}/{child.name}")
    return removed


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` all at once; on any failure the old file stays and no temporary is left."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
