"""Start and stop the processes behind the UI's buttons: train, resume, export, stop.

Every action is an ordinary ``zeropipe`` command started as a detached process (its own
session, so it outlives the UI and a Ctrl-C in the UI's terminal does not reach it), with
its output in a log file. Stopping sends SIGTERM to the run's launcher, which stops every
rank cleanly and marks the run stopped; a pid is signalled only when this run's own files or
the store's launch records name it, and only while it is still the same process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from zeropipe.store.index import process_alive


def spawn(argv: list[str], log_path: Path, cwd: Path, stdout_path: Path | None = None) -> subprocess.Popen:
    """Start ``argv`` detached, its output appended to ``log_path`` (its stdout alone to ``stdout_path`` when given)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "a") as log:
        log.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} zeropipe ui started: {' '.join(argv[2:])} ====\n")
        log.flush()
        with open(stdout_path, "w") if stdout_path else contextlib.nullcontext(log) as out:
            return subprocess.Popen(
                argv, stdout=out, stderr=log if stdout_path else subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(cwd), env=env, start_new_session=True
            )  # fmt: skip


def zeropipe_argv(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "zeropipe", *map(str, args)]


def is_zeropipe_command(pid: int, command: str) -> bool:
    """Whether ``pid`` runs ``zeropipe COMMAND`` (``python -m zeropipe train`` or the ``zeropipe`` script)."""
    try:
        argv = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    for index, arg in enumerate(argv):
        if arg == "zeropipe" or Path(arg).name == "zeropipe" or arg.endswith("zeropipe/__main__.py"):
            return command in argv[index + 1 :]
    return False


def terminate(pid: int, created_before: float | None, command: str = "train") -> bool:
    """SIGTERM ``pid`` if it is still the ``zeropipe COMMAND`` process that existed by ``created_before``."""
    if not process_alive(pid, created_before) or not is_zeropipe_command(pid, command):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
        return True
    except (ProcessLookupError, PermissionError):
        return False
