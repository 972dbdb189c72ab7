"""``zeropipe doctor [--json] [--no-build] [--runs-dir DIR]``: what on this machine will break a run, and the fix.

Checks torch's CUDA against nvcc, the GPUs and peer-to-peer access, whether DeepSpeed's
CPU Adam builds, package versions, /dev/shm, host RAM and swap, and free disk for runs.
Exit status 1 when any finding is an error.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

AREAS = {
    "gpu": "GPUs",
    "cuda": "CUDA toolkit",
    "cpu_adam": "DeepSpeed CPU Adam",
    "versions": "Versions",
    "memory": "Host memory",
    "disk": "Disk",
    "environment": "Environment",
}

MARKS = {"ok": "[ok]     ", "warning": "[warning]", "error": "[error]  ", "info": "[info]   "}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the findings and the gathered facts as JSON")
    parser.add_argument("--no-build", action="store_true", help="skip the trial build of DeepSpeed's CPU Adam (about a minute the first time, cached after)")
    parser.add_argument("--runs-dir", default="runs", metavar="DIR", help="where run directories go, for the free-disk check (default: ./runs or its nearest existing parent)")
    parser.add_argument("--build-timeout", type=float, default=900, metavar="SECONDS", help="give up on the trial build after this long (default: 900)")


def register(commands) -> None:
    parser = commands.add_parser("doctor", help="check this machine (CUDA, GPUs, DeepSpeed build, memory, disk) and say what to fix", description=__doc__)
    add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zeropipe.doctor import run_doctor

    if not args.json and not args.no_build:
        # The trial build can take a minute; say so before the silence.
        print("checking this machine (the CPU Adam trial build can take a minute the first time)...", file=sys.stderr, flush=True)
    report = run_doctor(args.runs_dir, trial_build=not args.no_build, build_timeout_seconds=args.build_timeout)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render(report.findings))
    return 1 if report.has_errors else 0


def render(findings) -> str:
    """Findings grouped by area, each with its mark, its detail and its fix under it, then a count."""
    lines: list[str] = []
    areas = list(AREAS) + sorted({f.area for f in findings} - set(AREAS))
    for area in areas:
        in_area = [f for f in findings if f.area == area]
        if not in_area:
            continue
        lines.append(AREAS.get(area, area))
        for finding in in_area:
            lines.append(f"  {MARKS.get(finding.status, finding.status)} {finding.title}")
            indent = " " * 14
            for paragraph in finding.detail.splitlines():
                lines.extend(textwrap.wrap(paragraph, width=110, initial_indent=indent, subsequent_indent=indent) or [indent])
            if finding.fix and finding.status != "ok":
                lines.extend(textwrap.wrap(f"fix: {finding.fix}", width=110, initial_indent=indent, subsequent_indent=indent + "     "))
        lines.append("")
    counts = {status: sum(1 for f in findings if f.status == status) for status in ("error", "warning", "ok", "info")}
    lines.append(", ".join(f"{n} {status}{'s' if n != 1 and status in ('error', 'warning') else ''}" for status, n in counts.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m zeropipe.cli.doctor``: the same command before (or without) the ``zeropipe`` entry point."""
    parser = argparse.ArgumentParser(prog="zeropipe doctor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
