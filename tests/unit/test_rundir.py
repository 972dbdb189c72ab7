"""Ownership of a run directory: one live launcher at a time, and a lost run read as lost."""

import json
import os
import subprocess
import sys
import time

import pytest

from zeropipe.rundir import RunDir, RunDirBusy

HOLD = """
import sys, time
from zeropipe.rundir import RunDir
RunDir(sys.argv[1]).claim()
print("claimed", flush=True)
time.sleep(60)
"""


@pytest.fixture
def other_owner(tmp_path):
    """Another process that owns tmp_path/run until the test kills it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_owner_is_named_and_keeps_the_directory(tmp_path, other_owner):
    run = RunDir(tmp_path / "run")
    with pytest.raises(RunDirBusy) as caught:
        run.claim()
    assert f"launcher pid {other_owner.pid}" in str(caught.value) and "run.name" in str(caught.value)
    assert run.owner_pid() == other_owner.pid
    with pytest.raises(RunDirBusy):
        run.require_owner()


def test_the_lock_dies_with_its_owner_however_it_dies(tmp_path, other_owner):
    run = RunDir(tmp_path / "run")
    other_owner.kill()  # SIGKILL: no cleanup code runs, the kernel drops the lock
    other_owner.wait()
    assert run.owner_pid() is None
    run.claim()
    try:
        assert run.owner_pid() == RunDir(tmp_path / "run").owner_pid()
        run.require_owner()
    finally:
        run.release()


def test_running_status_with_a_free_lock_reads_and_is_written_lost(tmp_path, other_owner):
    run = RunDir(tmp_path / "run")
    (run.path / "status.json").write_text(json.dumps({"state": "running", "supervisor_pid": other_owner.pid}))
    assert run.read_status()["state"] == "running"  # the owner is alive
    other_owner.kill()
    other_owner.wait()
    status = run.read_status()
    assert status["state"] == "lost" and f"pid {other_owner.pid}" in status["diagnosis"]["text"]
    assert json.loads(run.status_file.read_text())["state"] == "lost"
    assert run.owner_pid() is None  # the reader let go again


def test_claim_waits_out_a_readers_brief_hold(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-c", HOLD.replace("time.sleep(60)", "time.sleep(0.3)"), str(run.path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    started = time.monotonic()
    run.claim()
    run.release()
    proc.wait()
    assert time.monotonic() - started < 1.0


def test_status_on_a_full_disk_is_rewritten_in_place_and_stays_json(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        run = RunDir(disk / "run")
        run.path.mkdir()
        run.write_status(state="running", pids=[1, 2], supervisor_pid=3)
        filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError):
            while True:
                os.write(filler, b"\0" * 4096)
        os.close(filler)
        log_tail = "\n".join(f"  | line {i} of a long traceback" for i in range(200))
        run.write_status(state="failed", diagnosis={"rank": 0, "cause": "the disk is full", "fix": "free space", "text": f"rank 0 exited\nlast lines of rank 0's log:\n{log_tail}"})
        status = json.loads(run.status_file.read_text())
        assert status["state"] == "failed" and status["diagnosis"]["cause"] == "the disk is full"
        assert [p.name for p in run.path.iterdir() if ".tmp" in p.name] == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_lost_run_on_a_read_only_disk_still_reads_lost(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        run = RunDir(disk / "run")
        run.claim()
        run.write_status(state="running", supervisor_pid=12345)
        run.release()  # as if its launcher had been killed
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        assert run.read_status()["state"] == "lost"
        assert json.loads(run.status_file.read_text())["state"] == "running"  # nothing could be written
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
