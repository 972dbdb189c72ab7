"""Fault injection on real 2-rank CPU runs: killed launchers, concurrent runs, full disks, exact resume.

Every test starts the real `zeropipe` command, real DeepSpeed ranks (gloo) and real files;
the faults are the ones users meet: a launcher killed by a scheduler, a second `train` with
the same run name, a disk that fills up, a resume from any checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import RESUME_STEPS, SAVE_EVERY, assert_ok, metrics, start_zeropipe, tiny_run_config, write_config, zeropipe, zeropipe_here

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
# The uninterrupted reference runs (RESUME_STEPS steps, a checkpoint every SAVE_EVERY) are made once
# per session in conftest.py: test_resume_and_failures.py's Ctrl-C test continues them too.


# The first checkpoint (step 10) is where test_resume_and_failures.py's Ctrl-C test resumes from, held to
# the same bit-equality there (its own stopped run, per stage): a copy resumed from it here too was a
# third resume per stage for no new assertion.
@pytest.mark.parametrize("checkpoint", [2, 3])
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


# ------------------------------------------------------------ launcher and owner
def start_long_run(tmp_path: Path, name: str, save_every: int | None = None) -> tuple[Path, Path, subprocess.Popen]:
    train = {"max_steps": 100000, "save_every": save_every}
    config = write_config(tmp_path, tiny_run_config(tmp_path, name=name, train=train, **FAST), f"{name}.yaml")
    run_dir = tmp_path / "runs" / name
    proc = start_zeropipe("train", config)
    wait_for(lambda: len(metrics(run_dir)) >= 2 + (save_every or 0), 300, "the first training steps")
    return config, run_dir, proc


def test_killed_launcher_takes_its_ranks_with_it_and_the_run_reads_lost(tmp_path):
    _, run_dir, launcher = start_long_run(tmp_path, "orphans")
    ranks = json.loads((run_dir / "status.json").read_text())["pids"]
    children = [c.pid for pid in ranks for c in psutil.Process(pid).children(recursive=True)]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=10)
    # Left alone they would train on for 100,000 steps: dying at all is the behaviour. The kernel's
    # parent-death signal does it at once; the bound is generous for a loaded machine.
    wait_for(lambda: not alive(ranks + children), 30, "the ranks to die with their launcher")

    # Nobody recorded the end: the first reader finds the owner gone and says so, for everyone.
    listed = zeropipe_here("runs", "ls", "--runs-dir", tmp_path / "runs", "--json")  # the CLI's code, without a new interpreter's start-up
    assert_ok(listed)
    assert [run["state"] for run in json.loads(listed.stdout) if run["name"] == "orphans"] == ["lost"]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "lost" and "launcher" in status["diagnosis"]["text"] and "--resume" in status["diagnosis"]["text"]
    steps = len(metrics(run_dir))
    time.sleep(1.5)
    assert len(metrics(run_dir)) == steps, "something still trains into the run directory"


def test_a_failing_supervisor_stops_its_ranks_and_marks_the_run_failed(tmp_path):
    """The supervisor loop raising (a bug, an unreadable file) must not orphan the ranks."""
    from zeropipe.config.load import load_config
    from zeropipe.launch.prepare import prepare_run
    from zeropipe.launch.resolve import resolve_run
    from zeropipe.launch.supervisor import Supervisor

    path = write_config(tmp_path, tiny_run_config(tmp_path, name="broken", train={"max_steps": 100000, "save_every": None}, **FAST))
    prepared = prepare_run(resolve_run(load_config(path)))
    run_dir = prepared.run.path

    def tick():
        if len(metrics(run_dir)) >= 2:
            raise RuntimeError("a bug in the progress display")

    supervisor = Supervisor(prepared.run, prepared.plan.world_size, prepared.plan.accelerator, on_tick=tick)
    supervisor.start()
    ranks = [proc.pid for proc in supervisor.procs]
    with pytest.raises(RuntimeError, match="progress display"):
        supervisor.wait()
    assert alive(ranks) == []
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed"
    assert "the launcher failed while watching the ranks (RuntimeError: a bug in the progress display)" in status["diagnosis"]["text"]
    prepared.run.release()


def test_a_run_directory_has_one_owner_and_a_double_ctrl_c_stops_it_cleanly(tmp_path):
    """One live run, two faults in turn: a second launcher on its directory, then a double Ctrl-C.

    (Two tests before, each starting its own long run: the refusals need a live owner, the
    double Ctrl-C a live run past its first checkpoint; this run is both.)
    """
    config = write_config(tmp_path, tiny_run_config(tmp_path, name="base", train={"max_steps": 100000, "save_every": 2}, **FAST))
    # The run's name comes from the command line: a hint without it would resume another run.
    first = start_zeropipe("train", config, "run.name=renamed")
    run_dir = tmp_path / "runs" / "renamed"
    wait_for(lambda: (run_dir / "checkpoints" / "step_00000002" / "zeropipe_complete.json").exists() and len(metrics(run_dir)) >= 4, 300, "the first checkpoint")
    # Same name while the first runs, and --resume of the live run (which used to truncate its
    # metrics.jsonl): both refused before anything is written, naming the live launcher.
    # Launched by this interpreter (conftest.zeropipe): the live owner is the other process either way.
    for refused in (zeropipe("train", config, "run.name=renamed"), zeropipe("train", config, "run.name=renamed", "--resume")):
        output = refused.stdout + refused.stderr
        assert refused.returncode == 2, output
        assert f"is in use by a live run (launcher pid {first.pid})" in output
        assert "Traceback" not in output
    ranks = json.loads((run_dir / "status.json").read_text())["pids"]
    first.send_signal(signal.SIGINT)
    time.sleep(0.01)
    first.send_signal(signal.SIGINT)
    output, _ = first.communicate(timeout=60)
    assert first.returncode == 130, output
    steps = [row["step"] for row in metrics(run_dir)]
    assert steps == list(range(1, len(steps) + 1)), "metrics.jsonl holds one run's steps, in order"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "stopped"
    assert alive(ranks) == []
    assert f"continue with: zeropipe train {config} run.name=renamed --resume" in output


# ------------------------------------------------------------------ full disks
def mount_tmpfs(path: Path, options: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs: room for a tiny run and a few checkpoints, easy to fill."""
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "size=16m")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def read_only_disk(tmp_path):
    disk = tmp_path / "readonly"
    mount_tmpfs(disk, "ro,size=1m")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def outside_rank_logs(output: str) -> str:
    """The launcher's own words: without the rank-log lines the diagnosis quotes ('  | ...')."""
    return "\n".join(line for line in output.splitlines() if not line.startswith("  |"))


def test_an_unwritable_output_dir_is_one_message(tmp_path, read_only_disk):
    for output_dir, words in [("/proc/zeropipe-x", "set run.output_dir to a"), (str(read_only_disk), "read-only file system")]:
        config = write_config(tmp_path, tiny_run_config(tmp_path, name="nowhere", **FAST) | {"run": {"name": "nowhere", "output_dir": output_dir}})
        result = zeropipe("train", config)
        assert result.returncode == 2, result.stderr
        assert words in result.stderr and "run.output_dir" in result.stderr
        assert "Traceback" not in result.stderr


def test_a_disk_filling_up_mid_run_is_diagnosed_and_keeps_the_last_checkpoint(tmp_path, small_disk):
    config = tiny_run_config(tmp_path, name="full", train={"max_steps": 100000, "save_every": 2, "keep_last": 1}, **FAST)
    config["run"]["output_dir"] = str(small_disk)
    run_dir = small_disk / "full"
    launcher = start_zeropipe("train", write_config(tmp_path, config))
    wait_for(lambda: (run_dir / "checkpoints" / "step_00000002" / "zeropipe_complete.json").exists(), 300, "the first checkpoint")
    filler = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(filler, b"\0" * 65536)
    except OSError:
        pass  # ENOSPC: the disk is full now
    finally:
        os.close(filler)
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 1, output
    assert "the disk holding the run directory is full" in output or "the disk is full" in output, output
    assert "free space where the run directory lives" in output
    assert "Traceback" not in outside_rank_logs(output), output
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed"
    assert not list(small_disk.rglob(".*.tmp*")), "a temporary file was left behind"
    assert all(path.stat().st_size > 0 for path in (run_dir / "errors").glob("*.json")), "an empty error record hides the cause"
    # The newest complete checkpoint is intact and named by `latest`.
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest / "zeropipe_complete.json").is_file()


# ------------------------------------------------------------------ diagnosis
def test_a_kill_9_on_a_roomy_zero3_run_is_diagnosed_not_called_an_oom_kill_and_leaves_nothing(tmp_path):
    """A rank other than rank 0 killed: it is named (not rank 0, which only stops), the run is failed, no process is left."""
    config = tiny_run_config(tmp_path, name="killed3", train={"max_steps": 100000, "save_every": None}, deepspeed={"zero_stage": 3, "precision": "fp32"}, generate={"prompts": []})
    run_dir = tmp_path / "runs" / "killed3"
    launcher = start_zeropipe("train", write_config(tmp_path, config))
    wait_for(lambda: len(metrics(run_dir)) >= 3, 300, "three training steps")
    pids = json.loads((run_dir / "status.json").read_text())["pids"]
    children = [c.pid for pid in pids for c in psutil.Process(pid).children(recursive=True)]
    psutil.Process(pids[1]).send_signal(signal.SIGKILL)
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 1, output
    assert "rank 1 was killed by SIGKILL" in output
    assert "rank 0" in output  # named as stopped, an effect
    # A kill -9 with RAM to spare: not blamed on the OOM killer (issue 14, defect 11).
    assert "likely cause: not the OOM killer" in output or "likely cause: probably not the OOM killer" in output, output
    assert "host RAM peaked at" in output
    fix = next(line for line in output.splitlines() if line.startswith("fix:"))
    assert "zero_stage" not in fix  # already 3
    # No orphans: every rank and its children are gone.
    wait_for(lambda: not alive(pids + children), 30, "the other rank and the ranks' children to end")
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["diagnosis"]["rank"] == 1
    # Torch's per-collective deprecation notices neither fill the rank logs nor the tail shown.
    assert "is deprecated" not in output
    assert not [line for rank in (0, 1) for line in (run_dir / "logs" / f"rank{rank}.log").read_text().splitlines() if "is deprecated" in line]
