"""Build DeepSpeed's CPU ops once, before tests run on several workers.

DeepSpeed compiles its shared-memory collective (every CPU run's communicator), CPU Adam
(offloaded optimizers) and the CPU FusedAdam (Muon's Adam for the parameters Muon does not take)
on first use into the torch extensions folder; two pytest workers starting ranks at the same
moment would build the same op side by side, one waiting on the other's lock.

torch's builder waits, without a time limit, while a ``lock`` file stands in the op's folder. A
build that was killed (a Ctrl-C, a timed-out test) leaves that file behind, and every later run
that needs the op then hangs. Such leftovers (every op's, not only these three: a lock older than a
minute that no compiler works beside, ``stale_build_locks``) are removed here, and said.
A failure here is not fatal: the op is then built (or reported) by the first test that needs it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from deepspeed.accelerator import get_accelerator  # noqa: E402

from zeropipe.doctor.facts import stale_build_locks  # noqa: E402
from zeropipe.engine.ds_ops import fast_op_loads  # noqa: E402

for lock in stale_build_locks():
    lock.unlink(missing_ok=True)
    print(f"DeepSpeed op build folder {lock.parent.name}: removed {lock}, left by a build that was stopped")

for name in ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder"):
    started = time.monotonic()
    try:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"DeepSpeed op {name}: not available on this accelerator")
            continue
        with fast_op_loads():  # up to date (also under another spelling of the same venv): imported, not rebuilt; as the ranks load it
            builder.load(verbose=False)
        print(f"DeepSpeed op {name}: ready ({time.monotonic() - started:.0f} s)")
    except Exception as err:  # noqa: BLE001 - reported, the tests build or report it themselves
        print(f"DeepSpeed op {name}: not built here ({type(err).__name__}: {err})")
