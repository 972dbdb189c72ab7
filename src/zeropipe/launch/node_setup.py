"""Entry point of a node's setup process: ``python -m zeropipe.launch.node_setup RUN_DIR``.

Some work is done once per node rather than once per rank: a diffusion run fills its latent
and text-embedding caches there, so that a node holds one copy of each encoder (UMT5-XXL is
11 GB in bf16) whatever its number of GPUs, and no rank's own baseline (Python, torch,
DeepSpeed, a CUDA context: 0.4-2 GB each) is resident while the encoders are. The
supervisor runs this process to the end before it starts the node's ranks; the ranks then
only read what it wrote. What it runs is the run plan's ``node_setup`` (``module:function``,
set by the family's data preparation), called with the run directory, the device (the
node's first GPU, or the CPU) and the dtype to load frozen encoders in
(:func:`encoder_precision_for`, from what the launcher decided the device runs natively).

Like a rank, it dies with its launcher and writes a failure to ``errors/node_setup.json`` for the
launcher's diagnosis; its log is ``logs/node_setup.log``.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

from zeropipe.engine.ds_ops import defer_compiles_at_import
from zeropipe.engine.noise import quiet_known_noise
from zeropipe.launch.rank import check_owner, die_with_launcher, leave, record_failure
from zeropipe.models.common import encoder_precision_for  # the ranks load encoders by it too (caching off)


def setup_device(accelerator: str):
    import torch

    return torch.device("cuda", 0) if accelerator == "cuda" else torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir = Path(argv[0])
    die_with_launcher()
    quiet_known_noise()
    defer_compiles_at_import()  # as in a rank (zeropipe.launch.rank)
    try:
        check_owner(run_dir)
        import logging

        import torch

        from zeropipe.confine import Confinement, confine_process
        from zeropipe.models.common import TORCH_DTYPES
        from zeropipe.rundir import RunDir

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
        run = RunDir(run_dir)
        plan = run.read_plan()
        confine_process(Confinement.from_json(plan.confined_to))  # a UI run's: no image read through a symlink out of its folders
        if not plan.node_setup:
            return 0
        module, _, function = plan.node_setup.partition(":")
        # Plug-ins register on import (a diffusion entry's own parts encode its cache entries here), as in the launcher and the ranks.
        from zeropipe.families import load_plugins

        load_plugins()
        setup = getattr(importlib.import_module(module), function)
        device = setup_device(plan.accelerator)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        precision, why = encoder_precision_for(plan.accelerator, plan.native_precision, plan.native_precision_why)
        logging.getLogger("zeropipe").info("node setup (%s) on %s, text encoders in %s: %s", plan.node_setup, device, precision, why)
        setup(run, device, TORCH_DTYPES[precision])
    except BaseException as err:  # noqa: BLE001 - every failure is recorded for the diagnosis
        record_failure(run_dir, 0, err, stem="node_setup")
        traceback.print_exc()
        return 130 if isinstance(err, KeyboardInterrupt) else 1
    return 0


if __name__ == "__main__":
    leave(main())
