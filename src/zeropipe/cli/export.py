"""``zeropipe export RUN_DIR --out DIR``: a Hugging Face directory from a run's checkpoint."""

from __future__ import annotations

import argparse
import sys


def register(commands) -> None:
    parser = commands.add_parser("export", help="write a Hugging Face directory (or LoRA adapter) from a run", description=__doc__)
    parser.add_argument("source", help="run directory, or one of its checkpoints/step_* directories")
    parser.add_argument("--out", required=True, help="directory to write (refused if it exists and is not empty, unless --force)")
    parser.add_argument("--merge", action="store_true", help="LoRA runs: merge the adapter into the base weights")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="weights dtype (default: the run's precision)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (runs with train.ema) instead of the trained ones")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zeropipe.families import export_run

    out = export_run(args.source, args.out, merge=args.merge, dtype=args.dtype, force=args.force, ema=args.ema)
    print(f"exported to {out}", file=sys.stderr)
    return 0
