"""Ranks forked from the launcher instead of started as new interpreters (``ZEROPIPE_RANK_START=fork``).

A new rank interpreter spends about 5 s of CPU importing torch, DeepSpeed, transformers and peft,
which the launcher of a ``train`` has imported already. On CPU ranks (a test suite, a debugging
run) the launcher can instead fork each rank from itself: the rank then starts in a fraction of a
second, and its code from ``main()`` on is the same. The default stays a new interpreter
(``python -m zeropipe.launch.rank``, what runs on GPUs): a CUDA context cannot cross a fork.

A forked child inherits the launcher's whole state, so before it runs the rank's ``main()`` it
is made to look like a new interpreter where that matters (:func:`become_new_process`): the
rank's environment, standard streams on its log, Python's default signal handlers, warning
filters and logging handlers, one OpenMP thread, glibc's mmap threshold, and no exit handlers
of the launcher's. What cannot be made new refuses the fork, and the rank is started as a new
interpreter (:func:`why_not_fork`):
- anything but CPU ranks (a CUDA context cannot cross a fork);
- more than one OpenMP thread per rank: GNU libgomp's thread pool does not survive a fork
  (a child that runs a parallel region with the parent's pool hangs; measured here with torch's
  libgomp), so only one-thread ranks (``OMP_NUM_THREADS=1``) are forked;
- a launcher process with torch.distributed initialized (a child would think its process group
  was set up already).

The supervisor's per-rank host-RAM figure (resident set) of a forked rank includes the pages it
shares with its launcher until either writes them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib.util
import io
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from typing import Callable

RANK_START = "ZEROPIPE_RANK_START"
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def why_not_fork(env: dict[str, str]) -> str | None:
    """Why a process with ``env`` is started as a new interpreter, or None when it is forked from this one."""
    if os.environ.get(RANK_START, "exec") != "fork":
        return "not asked (ZEROPIPE_RANK_START is not 'fork')"
    if env.get("DS_ACCELERATOR") != "cpu":
        return "only CPU ranks are forked: a CUDA context cannot cross a fork"
    if env.get("OMP_NUM_THREADS") != "1":
        return f"OMP_NUM_THREADS is {env.get('OMP_NUM_THREADS')!r}: GNU libgomp's thread pool does not survive a fork, so only one-thread ranks are forked"
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return "this process has a torch.distributed process group: a forked rank would take it for its own"
    return None


class ForkedProcess:
    """The part of :class:`subprocess.Popen` the supervisor uses, for a forked child."""

    def __init__(self, pid: int, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its status is lost
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(module: str, main: Callable[[list[str]], int], argv: list[str], env: dict[str, str], log) -> ForkedProcess:
    """Fork ``main(argv)`` as a new session with ``env``, stdin on /dev/null and stdout/stderr on ``log``.

    ``module`` (``zeropipe.launch.rank``) is what the new interpreter would have run: its file is
    the child's ``sys.argv[0]``. The child never returns here: it leaves with ``os._exit``.
    """
    for stream in (sys.stdout, sys.stderr):
        # Unflushed output would be written twice, by the launcher and by the child; a closed or broken stream has none.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    spec = importlib.util.find_spec(module)
    program = (spec.origin if spec is not None else None) or module  # sys.argv[0] of `python -m MODULE`
    pid = os.fork()
    if pid:
        return ForkedProcess(pid, [module, *argv])
    code = 1
    try:
        os.setsid()
        become_new_process(program, argv, env, log.fileno())
        code = main(argv)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed to the rank's log; the child must not return into the launcher
        traceback.print_exc()
        code = 1
    finally:
        try:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def show_warning(message: warnings.WarningMessage) -> None:
    """Python's own ``warnings._showwarnmsg_impl``: the warning, formatted, on the message's file or stderr."""
    file = message.file if message.file is not None else sys.stderr
    with contextlib.suppress(OSError):  # as Python's: a warning never fails the program (a full disk under the log)
        file.write(warnings._formatwarnmsg(message))  # type: ignore[attr-defined]


def become_new_process(program: str, argv: list[str], env: dict[str, str], log_fd: int) -> None:
    """What a new interpreter would have that a forked launcher does not (see the module docstring)."""
    gc.freeze()  # the launcher's objects: the child's collections never walk (and copy) their pages
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    old_out, old_err = (sys.stdout, sys.__stdout__), (sys.stderr, sys.__stderr__)
    # PYTHONUNBUFFERED as the rank environment sets it: every write reaches the log at once.
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115 - the process's stdin for its life
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True, errors="backslashreplace")
    replaced = {id(s): sys.stdout for s in old_out if s is not None} | {id(s): sys.stderr for s in old_err if s is not None}
    sys.argv = [program, *argv]
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.cancel_dump_traceback_later()
    if faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr)
    # A new interpreter's warning filters (CPython's defaults and -W options), shown on stderr.
    warnings.resetwarnings()
    warnings.showwarning = warnings._showwarning_orig  # type: ignore[attr-defined]
    warnings.formatwarning = warnings._formatwarning_orig  # type: ignore[attr-defined]
    warnings._showwarnmsg_impl = show_warning  # type: ignore[attr-defined]  # catch_warnings(record=True) swaps it for a list's append
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    for option in sys.warnoptions:
        warnings._setoption(option)  # type: ignore[attr-defined]
    # Logging as a new interpreter has it: no root handlers (a test runner's capture), library
    # handlers writing to the new stdout/stderr.
    logging.disable(logging.NOTSET)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    loggers = [logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    for logger in loggers:
        for handler in list(logger.handlers):
            if type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
            elif isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                # Assigned, not setStream(): that flushes the old stream, which is the launcher's. Its
                # unwritten lines would be written twice (once by each process), and a stream the launcher
                # closed raises ValueError (a handler left on an earlier test's closed capture: measured in the unit lane).
                stream = handler.stream
                if id(stream) in replaced:
                    handler.stream = replaced[id(stream)]
                elif type(stream).__module__.startswith("_pytest"):  # a test runner's capture of stdout
                    handler.stream = sys.stdout
    threads = env.get("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    if torch is not None and threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    threshold = env.get("MALLOC_MMAP_THRESHOLD_")
    if threshold and threshold.isdigit() and sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, int(threshold))
