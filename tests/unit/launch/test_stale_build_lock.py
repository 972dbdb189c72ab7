"""A lock file left by a stopped DeepSpeed op build: found, removed before ranks start, and said; a live build's lock is left alone."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from zeropipe.doctor.facts import stale_build_locks
from zeropipe.launch.supervisor import Supervisor
from zeropipe.rundir import RunDir, RunPlan

ROOT = Path(__file__).resolve().parents[3]


def lock_in(root: Path, op: str, age_seconds: float) -> Path:
    folder = root / op  # torch's layout with TORCH_EXTENSIONS_DIR set: the op's folder straight in it
    folder.mkdir(parents=True)
    lock = folder / "lock"
    lock.touch()
    then = time.time() - age_seconds
    os.utime(lock, (then, then))
    return lock


def test_only_an_old_lock_that_no_build_works_beside_is_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    left = lock_in(tmp_path, "cpu_adam", 3600)
    fresh = lock_in(tmp_path, "fused_adam", 1)  # a build that has just begun
    building = lock_in(tmp_path, "deepspeed_shm_comm", 3600)
    # A compiler at work in the op's folder (ninja and the compiler run with it as their working directory).
    compiler = subprocess.Popen(["sleep", "30"], cwd=building.parent)
    try:
        assert stale_build_locks() == [left]
    finally:
        compiler.kill()
        compiler.wait()
    assert set(stale_build_locks()) == {left, building}
    assert fresh.exists()


def test_a_left_lock_is_found_in_the_user_cache_layout_too(tmp_path, monkeypatch):
    # Without TORCH_EXTENSIONS_DIR torch builds in <cache>/torch_extensions/py311_cpu/<op> (one folder per Python and CUDA).
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    left = lock_in(tmp_path / "torch_extensions" / "py311_cpu", "cpu_adam", 3600)
    assert stale_build_locks() == [left]


def test_the_launcher_removes_a_left_lock_before_the_ranks_start_and_their_logs_say_so(tmp_path, monkeypatch):
    extensions = tmp_path / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    monkeypatch.chdir(ROOT)
    lock = lock_in(extensions, "deepspeed_shm_comm", 3600)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.logs.mkdir()
    run.errors.mkdir()
    run.claim()
    # No config in the run: the ranks start, say what is missing and exit; the lock is gone before they start.
    run.write_plan(RunPlan(world_size=2, accelerator="cpu", total_steps=1, steps_per_epoch=1, micro_batches_per_epoch=1, examples=2,
                           micro_batch_size=1, gradient_accumulation_steps=1, zero_stage=3))
    supervisor = Supervisor(run, 2, "cpu")
    supervisor.start()
    assert supervisor.wait().state == "failed"
    assert not lock.exists()
    for rank in (0, 1):
        text = run.rank_log(rank).read_text()
        assert f"removed {lock}: a DeepSpeed op build that was stopped left it" in text, text
        assert "deepspeed_shm_comm op would have waited for that build forever" in text
