"""``zeropipe calibrate [--ranks N] [--quick] [--profile PATH] [--json]``: measure this machine for the planner.

Short measurements of the devices the ranks run on: matmul throughput per dtype, the host
link in each direction (GPUs, pinned memory), all-gather and reduce-scatter between the ranks,
and the optimizer's step on the host. They are saved as the profile ``zeropipe plan``,
``check`` and the auto knobs use in place of assumed speeds (the plan names which it used).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict


def register(commands) -> None:
    parser = commands.add_parser("calibrate", help="measure this machine's compute, links and optimizer speed for the planner's cost model", description=__doc__)
    parser.add_argument("--ranks", type=int, default=None, help="ranks to measure the collectives between (default: every GPU, or 2 CPU ranks)")
    parser.add_argument("--quick", action="store_true", help="a few seconds of measurement instead of about a minute (rougher figures)")
    parser.add_argument("--profile", default=None, metavar="PATH", help="where to save the profile (default: $ZEROPIPE_CALIBRATION or ~/.cache/zeropipe/calibration.json)")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from zeropipe.doctor.calibrate import calibrate, write_calibration
    from zeropipe.doctor.facts import cpu_runs_bf16_natively
    from zeropipe.errors import ZeroPipeError

    accelerator = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    available = torch.cuda.device_count() if accelerator == "cuda" else None
    ranks = args.ranks if args.ranks is not None else (available if accelerator == "cuda" else 2)
    if ranks < 1 or (available is not None and ranks > available):
        raise ZeroPipeError(f"--ranks {ranks}: between 1 and {available or 'the number of ranks you train with'}")
    print(f"measuring {'GPU' if accelerator == 'cuda' else 'CPU'} ranks ({ranks}){' quickly' if args.quick else ''}...", file=sys.stderr, flush=True)
    calibration = calibrate(ranks, accelerator, quick=args.quick, native_bf16=cpu_runs_bf16_natively())
    path = write_calibration(calibration, Path(args.profile).expanduser() if args.profile else None)
    if args.json:
        print(json.dumps(asdict(calibration), indent=2))
    else:
        print(f"{calibration.device_name}: {calibration.summary()}")
        for note in calibration.notes:
            print(f"  note: {note}")
        print(f"saved to {path}; zeropipe plan and check use it on this machine")
    return 0
