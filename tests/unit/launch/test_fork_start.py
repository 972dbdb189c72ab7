"""A rank forked from its launcher (ZEROPIPE_RANK_START=fork) starts as a new interpreter would, and is refused where it cannot."""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import pytest

from zeropipe.launch import fork_start
from zeropipe.launch.supervisor import rank_environment, start_process

ONE_THREAD_CPU = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def child_facts(out: Path):
    """A rank's main(): what the forked child sees, written to ``out``."""

    def main(argv: list[str]) -> int:
        import torch

        import zeropipe.rundir as rundir

        warnings.warn("a library's deprecation", DeprecationWarning, stacklevel=1)  # a new interpreter hides it
        warnings.warn("a user warning", UserWarning, stacklevel=1)  # and shows this one on stderr
        print("to stdout")
        print("to stderr", file=sys.stderr)
        logging.getLogger("zeropipe.test").warning("a logged warning")  # no handler: Python's last resort, on stderr
        facts = {
            "argv": argv,
            "sys_argv0": sys.argv[0],
            "env": dict(os.environ),
            "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "sigterm": str(signal.getsignal(signal.SIGTERM)),
            "root_handlers": len(logging.getLogger().handlers),
            "held_run_dirs": list(rundir._held),
            "torch_threads": torch.get_num_threads(),
            "session_leader": os.getsid(0) == os.getpid(),
            "stdin": sys.stdin.read(),
        }
        out.write_text(json.dumps(facts))
        return 3

    return main


def test_a_forked_rank_has_its_environment_streams_signals_warnings_and_exit_code(tmp_path, monkeypatch):
    monkeypatch.setenv(fork_start.RANK_START, "fork")
    import torch

    import zeropipe.rundir as rundir

    owned = rundir.RunDir(tmp_path / "owned")
    owned.claim()  # the launcher owns a run directory; the child does not
    out, log_path, atexit_mark = tmp_path / "facts.json", tmp_path / "rank0.log", tmp_path / "atexit"
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # the launcher's handler: not the rank's
    atexit.register(atexit_mark.touch)  # the launcher's exit handler: never run by the child
    threads = torch.get_num_threads()
    try:
        env = dict(os.environ) | ONE_THREAD_CPU | {"RANK": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}
        with open(log_path, "a") as log:
            proc = fork_start.start("zeropipe.launch.rank", child_facts(out), ["RUN"], env, log)
        assert proc.wait(timeout=60) == 3
    finally:
        signal.signal(signal.SIGTERM, previous)
        atexit.unregister(atexit_mark.touch)
        owned.release()
    assert torch.get_num_threads() == threads  # the launcher's own setting is untouched
    facts = json.loads(out.read_text())
    assert facts["argv"] == ["RUN"] and facts["sys_argv0"].endswith("zeropipe/launch/rank.py")
    assert facts["env"]["RANK"] == "1" and facts["env"]["OMP_NUM_THREADS"] == "1"
    assert facts["sigint_default"] and facts["sigterm"] == str(signal.SIG_DFL)
    assert facts["root_handlers"] == 0 and facts["held_run_dirs"] == []
    assert facts["torch_threads"] == 1 and facts["session_leader"] and facts["stdin"] == ""
    assert not atexit_mark.exists()
    log = log_path.read_text()
    for line in ("to stdout", "to stderr", "UserWarning: a user warning", "a logged warning"):
        assert line in log
    assert "a library's deprecation" not in log


def test_a_forked_rank_that_raises_exits_1_with_its_traceback_in_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv(fork_start.RANK_START, "fork")

    def main(argv):
        raise ValueError("the rank's own failure")

    with open(tmp_path / "rank0.log", "a") as log:
        proc = fork_start.start("zeropipe.launch.rank", main, ["RUN"], dict(os.environ) | ONE_THREAD_CPU, log)
    assert proc.wait(timeout=60) == 1
    assert "ValueError: the rank's own failure" in (tmp_path / "rank0.log").read_text()


def test_a_library_handler_on_a_closed_stream_does_not_stop_the_rank(tmp_path, monkeypatch):
    """A handler an earlier test left on its (now closed) capture of stderr: the child moves it to its own
    stderr without flushing the launcher's stream, and the rank runs."""
    from _pytest.capture import CaptureIO

    monkeypatch.setenv(fork_start.RANK_START, "fork")
    capture = CaptureIO()
    capture.close()
    logger = logging.getLogger("zeropipe.test.closed")
    handler = logging.StreamHandler(capture)
    logger.addHandler(handler)

    def main(argv):
        logging.getLogger("zeropipe.test.closed").error("said on the rank's stderr")
        return 0

    try:
        with open(tmp_path / "rank0.log", "a") as log:
            proc = fork_start.start("zeropipe.launch.rank", main, ["RUN"], dict(os.environ) | ONE_THREAD_CPU, log)
        assert proc.wait(timeout=60) == 0, (tmp_path / "rank0.log").read_text()
    finally:
        logger.removeHandler(handler)
    assert "said on the rank's stderr" in (tmp_path / "rank0.log").read_text()
    assert handler.stream is capture  # the launcher's handler is its own


def test_a_forked_rank_is_signalled_and_reaped_as_a_popen_is(tmp_path):
    def main(argv):
        signal.pause()
        return 0

    with open(tmp_path / "rank0.log", "a") as log:
        proc = fork_start.start("zeropipe.launch.rank", main, ["RUN"], dict(os.environ) | ONE_THREAD_CPU, log)
    assert proc.poll() is None
    with pytest.raises(Exception, match="timed out"):
        proc.wait(timeout=0.2)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.kill()  # reaped: a no-op, as for a Popen


def test_a_forked_child_does_not_keep_its_launchers_run_directory_owned(tmp_path):
    """A rank's child can outlive a launcher killed with SIGKILL: the run must then read as lost, not as owned."""
    import zeropipe.rundir as rundir

    run = rundir.RunDir(tmp_path / "run")
    run.claim()

    started = tmp_path / "started"

    def main(argv):
        started.touch()
        time.sleep(30)
        return 0

    with open(tmp_path / "rank0.log", "a") as log:
        proc = fork_start.start("zeropipe.launch.rank", main, ["RUN"], dict(os.environ) | ONE_THREAD_CPU, log)
    try:
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        run.release()  # as the kernel does for a launcher that died
        assert run.owner_pid() is None
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("env", "asked", "process_group", "why"),
    [
        ({}, "exec", False, "not asked"),
        ({"DS_ACCELERATOR": "cuda", "OMP_NUM_THREADS": "1"}, "fork", False, "CUDA context"),
        ({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2"}, "fork", False, "libgomp"),
        (ONE_THREAD_CPU, "fork", True, "process group"),
        (ONE_THREAD_CPU, "fork", False, None),
    ],
)
def test_only_one_thread_cpu_ranks_are_forked_and_only_when_asked(env, asked, process_group, why, monkeypatch):
    import torch

    monkeypatch.setenv(fork_start.RANK_START, asked)
    # This worker's own state (an earlier test may have started a process group here) is not the question.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: process_group)
    reason = fork_start.why_not_fork(env)
    assert (reason is None) if why is None else (why in reason)


def test_the_supervisor_forks_two_cpu_ranks_on_two_cores_and_starts_new_interpreters_otherwise(tmp_path, monkeypatch):
    """rank_environment gives two CPU ranks on two cores one thread each: forked; a one-rank run keeps its two threads: a new interpreter."""
    import subprocess

    import zeropipe.launch.supervisor as supervisor

    import torch

    monkeypatch.setenv(fork_start.RANK_START, "fork")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(supervisor, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # as in a launcher (see above)
    run = tmp_path / "run"
    run.mkdir()
    with open(tmp_path / "two.log", "a") as log:
        proc = start_process("zeropipe.launch.rank", str(run), rank_environment(0, 2, 29500, "cpu"), log)
    assert isinstance(proc, fork_start.ForkedProcess)
    proc.wait(timeout=120)  # no ZEROPIPE_LAUNCHER_PID owner check passes for a folder with no run: it fails, as a rank would
    with open(tmp_path / "one.log", "a") as log:
        proc = start_process("zeropipe.launch.rank", str(run), rank_environment(0, 1, 29500, "cpu"), log)
    assert isinstance(proc, subprocess.Popen)
    proc.wait(timeout=120)
    assert "forked from the launcher" in (tmp_path / "two.log").read_text()
    assert "forked from the launcher" not in (tmp_path / "one.log").read_text()
