"""Entry point of one rank: ``python -m zeropipe.launch.rank RUN_DIR``.

The other side of the launcher's process boundary: the supervisor starts one of these per
GPU. It builds the :class:`~zeropipe.engine.trainer.Trainer` with the task of the run's
family (from the registry) and runs it.

The launcher sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. A failure is
written to ``errors/rank{N}.json`` so the launcher can name it in its diagnosis instead of
the secondary errors the other ranks print when this one disappears.

A rank never outlives its launcher: killed with SIGKILL, the launcher cannot stop its ranks,
and they would train on, unwatched, into a run directory nobody owns. Each rank asks the
kernel for SIGKILL when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), and a watchdog
thread also checks every half second that its parent is still ``ZEROPIPE_LAUNCHER_PID``, for
systems without prctl and for the moment before prctl took effect.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from zeropipe.engine.ds_ops import defer_compiles_at_import
from zeropipe.engine.noise import quiet_known_noise

PR_SET_PDEATHSIG = 1
WATCHDOG_SECONDS = 0.5

def die_with_launcher() -> None:
    """Exit when the launcher does (see the module docstring)."""
    expected = os.environ.get("ZEROPIPE_LAUNCHER_PID")
    if not expected or not expected.isdigit():
        return  # started by hand or by another launcher: nothing to watch
    launcher = int(expected)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still covers it
    if os.getppid() != launcher:
        os._exit(1)  # the launcher died before we could watch it

    def watch() -> None:
        while True:
            time.sleep(WATCHDOG_SECONDS)
            if os.getppid() != launcher:
                # Our process group holds this rank's own children (data-loader workers).
                os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="zeropipe-launcher-watchdog", daemon=True).start()


def check_owner(run_dir: Path) -> None:
    """Refuse to write into a run directory this rank's launcher does not own.

    Raises:
        RunDirBusy: another process (or none) owns it.
    """
    # On several nodes a rank's parent is its node's agent; the run directory's owner is the
    # launcher on the first node, whose pid the agent passes on.
    launcher = os.environ.get("ZEROPIPE_RUN_OWNER_PID") or os.environ.get("ZEROPIPE_LAUNCHER_PID")
    if not launcher:
        return
    from zeropipe.rundir import RunDir, RunDirBusy

    owner = RunDir(run_dir).owner_pid()
    if owner != int(launcher):
        raise RunDirBusy(f"{run_dir} is not owned by this rank's launcher (pid {launcher}; owner: {owner or 'none'}): the rank writes nothing")


def record_failure(run_dir: Path, rank: int, err: BaseException, stem: str | None = None) -> None:
    """errors/rank{N}.json (or errors/{stem}.json) for the launcher's diagnosis; on a full disk, nothing rather than an empty file."""
    from zeropipe.errors import ZeroPipeError

    record = {
        "rank": rank,
        "type": type(err).__name__,
        "message": str(err),
        "user_error": isinstance(err, ZeroPipeError),
        "traceback": traceback.format_exc(),
        "time": time.time(),
    }
    path = run_dir / "errors" / f"{stem or f'rank{rank}'}.json"
    try:
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(record, indent=2))
    except OSError:
        # An empty or half-written record would hide the cause; the launcher checks the disk itself.
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir = Path(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    die_with_launcher()
    quiet_known_noise()
    defer_compiles_at_import()  # Muon's and bitsandbytes' kernels: torch.compile on first use, not at import (engine.ds_ops)
    try:
        check_owner(run_dir)
        from zeropipe.confine import confine_process
        from zeropipe.engine.trainer import Trainer
        from zeropipe.families import family_of
        from zeropipe.rundir import RunDir

        run = RunDir(run_dir)
        given = os.environ.get("ZEROPIPE_TORCH_CUDA_ARCH_LIST_GIVEN")
        if given:
            print(f"rank {rank}: TORCH_CUDA_ARCH_LIST is {given!r}; DeepSpeed's op builder cannot read arch suffixes, so its ops are built for "
                  f"{os.environ.get('TORCH_CUDA_ARCH_LIST')!r}", flush=True)
        confine_process(run.data_confinement)  # a UI run's: no data file read through a symlink out of its folders
        family = family_of(run.read_config().model)
        Trainer(run_dir, family.rank_task).run_all()
    except BaseException as err:  # noqa: BLE001 - every failure is recorded for the diagnosis
        record_failure(run_dir, rank, err)
        traceback.print_exc()
        return 130 if isinstance(err, KeyboardInterrupt) else 1
    print(f"rank {rank}: finished", flush=True)
    return 0


def leave(code: int) -> None:
    """Exit; after a finished run, without the interpreter's teardown.

    gloo's worker threads can still hold finished collectives whose tensors refer to Python
    objects; freeing them while the interpreter shuts down aborts the process now and then
    ("terminate called without an active exception", SIGABRT), which turned finished runs
    into failed ones. By now the trainer has written its files, closed its metric sinks and
    destroyed the process group. A failed rank exits normally, so that whatever it still
    holds open is flushed.
    """
    if code != 0:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    leave(main())
