"""``zeropipe check RUN.yaml [key=value ...]``: the combinations that would fail, before anything starts."""

from __future__ import annotations

import argparse
import json


def register(commands) -> None:
    parser = commands.add_parser("check", help="find settings that would fail or waste hardware, without starting anything", description=__doc__)
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys as for train")
    parser.add_argument("--nproc", type=int, default=None, help="ranks the run would start (default: hardware.gpus)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zeropipe.check import check_config
    from zeropipe.config.load import load_config
    from zeropipe.launch.resolve import resolve_run

    config = load_config(args.config, args.overrides)
    if config.stages:
        auto_notes, findings = [], check_config(config, world_size=args.nproc)
    else:
        resolved = resolve_run(config, world_size=args.nproc)
        reports = None
        if resolved.nodes is not None:
            from zeropipe.launch.multinode import probe_nodes

            # Each node's agent says hello over the transport a launch would use: unreachable hosts and version drift show here.
            reports = probe_nodes(resolved.nodes)
        auto_notes, findings = resolved.notes, check_config(resolved, node_reports=reports)
    errors = [f for f in findings if f.severity == "error"]
    if args.json:
        print(json.dumps({"auto": auto_notes, "findings": [f.to_dict() for f in findings]}, indent=2))
        return 1 if errors else 0
    for note in auto_notes:
        print(note)
    for finding in findings:
        print(finding.render())
    print(f"{args.config}: no problems found" if not findings else f"{len(errors)} error(s), {len(findings) - len(errors)} warning(s)")
    return 1 if errors else 0
