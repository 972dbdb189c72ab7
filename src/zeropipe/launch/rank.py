"""Entry point of one rank: ``python -m zeropipe.launch.rank RUN_DIR``.

The other side of the launcher's process boundary: the supervisor starts one of these per
GPU. It builds the :class:`~zeropipe.engine.trainer.Trainer` with the task of the run's
family (from the registry) and runs it.

The launcher sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. A failure is
written to ``errors/rank{N}.json`` so the launcher can name it in its diagnosis instead of
the secondary errors the other ranks print when this one disappears.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir = Path(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    try:
        from zeropipe.engine.trainer import Trainer
        from zeropipe.families import family_named
        from zeropipe.rundir import RunDir

        family = family_named(RunDir(run_dir).read_config().model.family)
        Trainer(run_dir, family.rank_task).run_all()
    except BaseException as err:  # noqa: BLE001 - every failure is recorded for the diagnosis
        from zeropipe.errors import ZeroPipeError

        errors = run_dir / "errors"
        errors.mkdir(exist_ok=True)
        record = {
            "rank": rank,
            "type": type(err).__name__,
            "message": str(err),
            "user_error": isinstance(err, ZeroPipeError),
            "traceback": traceback.format_exc(),
            "time": time.time(),
        }
        (errors / f"rank{rank}.json").write_text(json.dumps(record, indent=2))
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
