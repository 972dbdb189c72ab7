"""``zeropipe runs ls|show|logs|stop``: the run store from the terminal (the same store as ``zeropipe ui``).

RUN is a run's id, its name, or its directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def register(commands) -> None:
    parser = commands.add_parser("runs", help="list, inspect, tail and stop runs (the UI's run store)", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--runs-dir", action="append", default=None, metavar="DIR", help="folder of run directories (default ./runs); repeatable")
    common.add_argument("--db", default=os.environ.get("ZEROPIPE_DB"), metavar="PATH", help="run database (default RUNS_DIR/.zeropipe/runs.sqlite3)")
    sub = parser.add_subparsers(dest="runs_command", metavar="ACTION", required=True)

    ls = sub.add_parser("ls", parents=[common], help="list runs: state, progress, ETA, last loss")
    ls.add_argument("--state", help="only these states (comma-separated: running, completed, failed, stopped, lost)")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(run=run_ls)

    show = sub.add_parser("show", parents=[common], help="one run: state, plan, losses, checkpoints, the failure diagnosis")
    show.add_argument("run_ref", metavar="RUN")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(run=run_show)

    logs = sub.add_parser("logs", parents=[common], help="the last lines of a rank's log (or the launcher's)")
    logs.add_argument("run_ref", metavar="RUN")
    logs.add_argument("--rank", default="0", help="rank number, 'launcher', or 'node_setup' (the caching process run before the ranks) (default 0)")
    logs.add_argument("-n", "--lines", type=int, default=50, help="lines to show (default 50)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the run ends (Ctrl-C to quit)")
    logs.set_defaults(run=run_logs)

    stop = sub.add_parser("stop", parents=[common], help="stop a running run: every rank stops cleanly and the run is marked stopped")
    stop.add_argument("run_ref", metavar="RUN")
    stop.add_argument("--wait", type=float, default=30, metavar="SECONDS", help="wait this long for the run to end (default 30; 0 to return at once)")
    stop.set_defaults(run=run_stop)


def open_store(args: argparse.Namespace):
    from zeropipe.store import Roots, RunStore

    store = RunStore(Roots(runs=args.runs_dir or ["runs"]), args.db)
    store.refresh()
    return store


def fmt_loss(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def fmt_duration(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def run_ls(args: argparse.Namespace) -> int:
    store = open_store(args)
    runs = store.runs(state=args.state)
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    if not runs:
        print(f"no runs in {', '.join(map(str, store.roots.runs))}", file=sys.stderr)
        return 0
    rows = [("ID", "NAME", "STATE", "STEP", "ETA", "LOSS", "STARTED")]
    for run in runs:
        step = f"{run['step']}/{run['total_steps']}" if run["total_steps"] else str(run["step"])
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(run["started_at"] or run["created_at"] or 0))
        rows.append((str(run["id"]), run["name"], run["state"], step, fmt_duration(run["eta_s"]), fmt_loss(run["last_loss"]), started))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def run_show(args: argparse.Namespace) -> int:
    store = open_store(args)
    run = store.run(args.run_ref)
    checkpoints = store.checkpoints(run)
    if args.json:
        print(json.dumps({"run": run, "checkpoints": checkpoints, "exports": store.exports(run)}, indent=2))
        return 0
    print(f"{run['name']} (id {run['id']}): {run['state']}")
    print(f"  directory: {run['path']}")
    if run["total_steps"]:
        print(f"  step {run['step']} of {run['total_steps']}, ETA {fmt_duration(run['eta_s'])}")
    print(f"  loss {fmt_loss(run['first_loss'])} -> {fmt_loss(run['last_loss'])}")
    if run["world_size"]:
        print(f"  {run['world_size']} {str(run['accelerator']).upper()} ranks, ZeRO stage {run['zero_stage']}")
    if checkpoints:
        print("  checkpoints: " + ", ".join(c["tag"] + ("" if c["complete"] else " (incomplete)") + (" (latest)" if c["latest"] else "") for c in checkpoints))
    if run["state"] in ("failed", "lost") and run["diagnosis"]:
        print("\n" + run["diagnosis"].get("text", ""))
    return 0


def run_logs(args: argparse.Namespace) -> int:
    store = open_store(args)
    run = store.run(args.run_ref)
    name = args.rank if args.rank in ("launcher", "node_setup") else f"rank{args.rank}"
    lines = store.read_log(run, name, args.lines)
    for line in lines:
        print(line)
    if not args.follow:
        return 0
    path = store.run_dir(run).logs / f"{name}.log"
    offset = path.stat().st_size if path.exists() else 0
    while True:
        time.sleep(1)
        if path.exists() and path.stat().st_size > offset:
            with open(path, errors="replace") as handle:
                handle.seek(offset)
                sys.stdout.write(handle.read())
                sys.stdout.flush()
                offset = handle.tell()
        store.refresh(scan=False)
        if store.run(run["id"])["state"] in ("completed", "failed", "stopped", "lost"):
            return 0


def run_stop(args: argparse.Namespace) -> int:
    store = open_store(args)
    run = store.stop(args.run_ref)
    print(f"stop sent to {run['name']} (id {run['id']}); every rank is being stopped", file=sys.stderr)
    deadline = time.time() + args.wait
    while time.time() < deadline:
        time.sleep(0.5)
        store.refresh(scan=False)
        state = store.run(run["id"])["state"]
        if state in ("completed", "failed", "stopped", "lost"):
            print(f"{run['name']}: {state}", file=sys.stderr)
            return 0
    if args.wait:
        print(f"{run['name']} has not ended after {args.wait:.0f} s; `zeropipe runs show {run['id']}` tells when it has", file=sys.stderr)
    return 0
