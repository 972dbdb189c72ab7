"""Trace again the activations stored in src/zeropipe/plan/catalog/traces.json (after a diffusers upgrade, or a new catalog entry or example).

    PYTHONPATH=src python scripts/rebuild_traces.py [--model NAME ...] [--lora-r R ...] [--examples-only | --no-examples]

Every catalog diffusion entry (or those named) is traced with LoRA at each rank given (default 32, on the
entry's default targets, at the entry's shape), and every config under examples/ is planned on 5x24GB with
64GB as it ships; each trace made is recorded (ZEROPIPE_RECORD_TRACES=1, zeropipe.plan.trace_store).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=[])
    parser.add_argument("--lora-r", action="append", type=int, default=[])
    parser.add_argument("--examples-only", action="store_true")
    parser.add_argument("--no-examples", action="store_true")
    args = parser.parse_args()
    os.environ["ZEROPIPE_RECORD_TRACES"] = "1"
    from zeropipe.config.schema import LoraSection
    from zeropipe.plan.model_spec import CATALOG_DIR, catalog_names, spec_from_catalog
    from zeropipe.families import families

    families()  # the diffusion family registers its spec builders with the planner

    names = [] if args.examples_only else (args.model or catalog_names())
    for name in names:
        if "trained" not in json.loads((CATALOG_DIR / f"{name}.json").read_text()):
            continue  # causal LMs are counted by formula, never traced
        for r in args.lora_r or [32]:
            print(f"tracing {name} r={r}", flush=True)
            spec_from_catalog(name, LoraSection(r=r))
    if args.no_examples:
        return
    for path in sorted((ROOT / "examples").rglob("*.yaml")):
        if "data" in path.relative_to(ROOT / "examples").parts:
            continue
        print(f"planning {path.relative_to(ROOT)}", flush=True)
        subprocess.run([sys.executable, "-m", "zeropipe", "plan", str(path), "--gpus", "5x24GB", "--ram", "64GB"], cwd=ROOT, stdout=subprocess.DEVNULL, check=False)


if __name__ == "__main__":
    main()
