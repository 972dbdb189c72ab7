"""Converting a checkpoint for a resume on another number of ranks: DeepSpeed's universal checkpoint.

ZeRO (stages 1-3, and the bf16 optimizer of stage 0) saves the optimizer state and fp32
weights cut into one shard per rank; DeepSpeed refuses to load them on another data-parallel
size. Its own converter, ``deepspeed.checkpoint.ds_to_universal``, merges the shards into one
file per parameter and state (``zero/NAME/fp32.pt``, ``exp_avg.pt``...), which any number of
ranks loads with ``checkpoint: {load_universal: true}``.

The conversion runs once per checkpoint, in a child process (the converter prints, and holds a
rank's optimizer shard at a time in memory; the launcher should do neither), into
``checkpoints/universal/.converting-TAG-PID``; only a finished conversion gets its marker
and is renamed to ``checkpoints/universal/TAG`` in one step. The original checkpoint is
only read. A conversion that was interrupted leaves a ``.converting-`` folder that nothing
trusts and the next conversion (or pruning) removes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from zeropipe.checkpoint.manager import UNIVERSAL_MARKER, CheckpointInfo, universal_dir, write_atomic
from zeropipe.errors import CheckpointError

CONVERTER = "deepspeed.checkpoint.ds_to_universal"
LOG_NAME = "universal-conversion.log"
SAFE_CONVERTER = (
    "import sys; from zeropipe.checkpoint import safeload; safeload.install(); "
    f"from {CONVERTER} import main, parse_arguments; main(parse_arguments())"
)


def has_partitioned_state(tag_dir: Path) -> bool:
    """True when the checkpoint holds per-rank optimizer shards (``*optim_states.pt``) that only a universal copy can re-partition.

    Stage 0 in fp32 saves the whole optimizer state in the model-state file, which loads on
    any number of ranks as it is.
    """
    return any(Path(tag_dir).glob("*optim_states.pt"))


def universal_copy(run_dir: Path, tag: str) -> Path | None:
    """The finished universal copy of checkpoint ``tag``, if one exists."""
    path = universal_dir(run_dir) / tag
    return path if (path / UNIVERSAL_MARKER).is_file() else None


def convert_to_universal(run_dir: Path, info: CheckpointInfo, log_dir: Path, accelerator: str = "cpu") -> tuple[Path, bool]:
    """Make (or reuse) the universal copy of a complete checkpoint.

    Args:
        run_dir: the run directory the checkpoint belongs to.
        info: the checkpoint (a complete tag directory under ``run_dir/checkpoints``).
        log_dir: where the converter's output goes (``LOG_NAME``).
        accelerator: the run's; on CPU the converter runs with ``DS_ACCELERATOR=cpu`` as the ranks do.

    Returns:
        (the universal copy's tag directory, whether it was converted now).

    Raises:
        CheckpointError: the converter failed; the original checkpoint is untouched.
    """
    existing = universal_copy(run_dir, info.tag)
    if existing is not None:
        return existing, False
    root = universal_dir(run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob(f".converting-{info.tag}-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    stale = root / info.tag
    if stale.exists():  # a copy without its marker was never finished: not to be trusted
        shutil.rmtree(stale)
    work = root / f".converting-{info.tag}-{os.getpid()}"
    output = work / info.tag
    log_dir.mkdir(parents=True, exist_ok=True)
    log_file = log_dir / LOG_NAME
    env = dict(os.environ)
    if accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    # One worker each: the converter's process pools would multiply the memory it holds.
    argv = [
        # DeepSpeed's converter, with its checkpoint readers loading tensors only (checkpoint.safeload).
        sys.executable, "-c", SAFE_CONVERTER,
        "--input_folder", str(Path(info.path).resolve()),
        "--output_folder", str(output),
        "--num_extract_workers", "1",
        "--num_merge_workers", "1",
        # ZeRO-Pipe's models carry no tensor-parallel layout; the converter needs the (empty) record of one.
        "--inject_missing_state",
    ]  # fmt: skip
    started = time.time()
    try:
        with open(log_file, "w") as log:
            result = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(run_dir), check=False)
        if result.returncode != 0:
            tail = "\n".join(log_file.read_text(errors="replace").strip().splitlines()[-8:])
            raise CheckpointError(
                f"converting checkpoint {info.tag} to a universal checkpoint (to resume on another number of ranks) failed "
                f"(exit {result.returncode}); checkpoint {info.tag} itself is unchanged. The converter said:\n{tail}\n"
                f"Full output: {log_file}. Resume on the rank count that saved it, or fix the cause and try again"
            )
        write_atomic(output / UNIVERSAL_MARKER, json.dumps({"source": str(info.path), "step": info.step, "converted_at": time.time(), "seconds": time.time() - started}, indent=2))
        # The finished copy appears under its name in one rename: never half-written.
        os.replace(output, root / info.tag)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root / info.tag, True
