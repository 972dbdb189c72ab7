"""Build DeepSpeed's CPU ops once, before tests run on several workers.

DeepSpeed compiles its shared-memory collective (every CPU run's communicator) and CPU Adam
(offloaded optimizers) on first use into the torch extensions folder; two pytest workers starting
ranks at the same moment would build the same op side by side, one waiting on the other's lock.
A failure here is not fatal: the op is then built (or reported) by the first test that needs it.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed.accelerator import get_accelerator  # noqa: E402

for name in ("ShareMemCommBuilder", "CPUAdamBuilder"):
    started = time.monotonic()
    try:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible(verbose=False):
            builder.load(verbose=False)
        print(f"DeepSpeed op {name}: ready ({time.monotonic() - started:.0f} s)")
    except Exception as err:  # noqa: BLE001 - reported, the tests build or report it themselves
        print(f"DeepSpeed op {name}: not built here ({type(err).__name__}: {err})")
