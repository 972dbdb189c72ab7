"""Fault injection on real 2-rank CPU runs: killed launchers, concurrent runs, full disks, exact resume.

Every test starts the real `zeropipe` command, real DeepSpeed ranks (gloo) and real files;
the faults are the ones users meet: a launcher killed by a scheduler, a second `train` with
the same run name, a disk that fills up, a resume from any checkpoint.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import assert_ok, metrics, tiny_run_config, write_config, zeropipe

pytestmark = pytest.mark.integration

# fp32: bit-exact comparisons are the point, and bf16 is 18-56x slower on these CPUs.
FAST = {"deepspeed": {"precision": "fp32"}, "generate": {"prompts": []}}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


# ---------------------------------------------------------------- exact resume
# Checkpoints at steps 10, 20 and 30. DeepSpeed's CPU Adam drifted after a resume from 20 and 30
# (from 10 it happened to match: see zeropipe.checkpoint.resume).
RESUME_STEPS, SAVE_EVERY = 32, 10


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted run per ZeRO stage, every checkpoint kept; made on first use."""
    made: dict[int, tuple[Path, Path]] = {}

    def get(stage: int) -> tuple[Path, Path]:
        if stage not in made:
            tmp_path = tmp_path_factory.mktemp(f"reference{stage}")
            config = tiny_run_config(
                tmp_path,
                name="reference",
                train={"max_steps": RESUME_STEPS, "save_every": SAVE_EVERY, "keep_last": 10},
                deepspeed={"zero_stage": stage, "precision": "fp32"},
                generate={"prompts": []},
            )
            path = write_config(tmp_path, config)
            assert_ok(zeropipe("train", path))
            made[stage] = path, tmp_path / "runs" / "reference"
        return made[stage]

    return get


@pytest.mark.parametrize("checkpoint", [1, 2, 3])
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_any_checkpoint_matches_the_uninterrupted_run(uninterrupted, tmp_path, stage, checkpoint):
    config, reference_dir = uninterrupted(stage)
    step = checkpoint * SAVE_EVERY
    # The run as it was when it was stopped right after its n-th checkpoint.
    run_dir = tmp_path / "cut"
    shutil.copytree(reference_dir, run_dir)
    tag = f"step_{step:08d}"

    result = zeropipe("train", config, "--resume", run_dir / "checkpoints" / tag)
    assert_ok(result)
    assert f"from {tag} (step {step})" in result.stderr
    expected = {row["step"]: row for row in metrics(reference_dir)}
    resumed = metrics(run_dir)
    assert [row["step"] for row in resumed] == list(range(1, RESUME_STEPS + 1))
    for row in resumed[step:]:
        # CPU ranks, fp32, no dropout: nothing but lost state can make these differ.
        assert (row["loss"], row["lr"], row["grad_norm"]) == (expected[row["step"]]["loss"], expected[row["step"]]["lr"], expected[row["step"]]["grad_norm"]), row["step"]


def test_resume_with_another_run_length_asks_before_bending_the_schedule(uninterrupted, tmp_path):
    config, reference_dir = uninterrupted(2)
    run_dir = tmp_path / "longer"
    shutil.copytree(reference_dir, run_dir)
    checkpoint = run_dir / "checkpoints" / "step_00000020"
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir()), (run_dir / "metrics.jsonl").read_text()

    refused = zeropipe("train", config, f"train.max_steps={RESUME_STEPS + 4}", "--resume", checkpoint)
    assert refused.returncode == 2, refused.stderr
    assert f"belongs to a run of {RESUME_STEPS} steps" in refused.stderr and "learning-rate schedule" in refused.stderr
    assert f"train.max_steps={RESUME_STEPS}" in refused.stderr and "--new-schedule" in refused.stderr
    assert "Traceback" not in refused.stderr
    # Refused means untouched: no checkpoint moved aside, no metrics row dropped.
    assert (sorted(p.name for p in (run_dir / "checkpoints").iterdir()), (run_dir / "metrics.jsonl").read_text()) == before

    accepted = zeropipe("train", config, f"train.max_steps={RESUME_STEPS + 4}", "--new-schedule", "--resume", run_dir / "checkpoints" / "step_00000030")
    assert_ok(accepted)
    assert "--new-schedule: recomputed" in accepted.stderr
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, RESUME_STEPS + 5))
