"""Entry point of one rank: ``python -m zeropipe.engine.worker RUN_DIR``.

The launcher sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. A failure is
written to ``errors/rank{N}.json`` so the launcher can name it in its diagnosis instead of
the secondary errors the other ranks print when this one disappears.
"""

from __future__ import annotations

import json
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
        from zeropipe.engine.trainer import trainer_for

        trainer_for(run_dir).run_all()
        return 0
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


if __name__ == "__main__":
    sys.exit(main())
