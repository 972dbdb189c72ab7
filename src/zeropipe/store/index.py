"""Read what a run directory says about its run, cheaply, for the runs list.

The launcher and rank 0 own these files; the store only reads them. ``status.json`` gives
the state, ``run.json`` the plan, the last lines of ``metrics.jsonl`` the progress. A run
whose status says "running" but whose launcher is gone (a reboot, ``kill -9``) is reported
as "lost", not as running forever.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import psutil

from zeropipe.errors import ZeroPipeError
from zeropipe.rundir import RunDir, confined

TERMINAL = {"completed", "failed", "stopped", "lost"}
PREVIEW_POINTS = 60
SMALL_FILE = 256 * 1024


def is_run_dir(path: Path) -> bool:
    return RunDir(path).holds_run()


def find_run_dirs(root: Path) -> list[Path]:
    """Run directories directly under a runs root (the layout ``zeropipe train`` writes).

    A symlink to a folder elsewhere is no run of this root: what it leads to is not served.
    """
    try:
        children = [child for child in Path(root).iterdir() if child.is_dir() and not child.name.startswith(".")]
    except OSError:
        return []
    inside = (confined(child, root) for child in children if is_run_dir(child))
    return sorted(path for path in inside if path is not None and path.parent == Path(root).resolve())


def process_alive(pid: Any, created_before: float | None = None) -> bool:
    """Whether ``pid`` is a live process that existed by ``created_before`` (a reused pid is not ours)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        # Two seconds of slack: the timestamp is written just after the process started.
        return created_before is None or process.create_time() <= created_before + 2
    except psutil.Error:
        return False


def read_json(path: Path | None) -> Any:
    """A JSON file that is no run file (a checkpoint's marker, an evaluation's result), or None."""
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def parse(line: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("step"), (int, float)) else None


def metrics_glance(path: Path | None, points: int = PREVIEW_POINTS) -> dict[str, Any]:
    """First and last rows, a few rows spread over the file and the last ~20, without reading it all."""
    try:
        if path is None:
            raise FileNotFoundError
        size = path.stat().st_size
    except OSError:
        return {"rows": [], "tail": [], "first": None, "last": None}
    with open(path, "rb") as handle:
        if size <= SMALL_FILE:
            rows = [r for r in map(parse, handle.read().split(b"\n")) if r]
            return {"rows": spread(rows, points), "tail": rows[-20:], "first": rows[0] if rows else None, "last": rows[-1] if rows else None}
        first = parse(handle.readline())
        rows = [first] if first else []
        for k in range(1, points):
            handle.seek(size * k // points)
            handle.readline()  # the rest of a line we landed inside
            row = parse(handle.readline())
            if row:
                rows.append(row)
        handle.seek(max(0, size - 16384))
        tail = [r for r in map(parse, handle.read().split(b"\n")[1:]) if r][-20:]
    rows += tail[-1:]
    return {"rows": rows, "tail": tail, "first": first, "last": tail[-1] if tail else (rows[-1] if rows else None)}


def spread(rows: list[dict[str, Any]], points: int) -> list[dict[str, Any]]:
    if len(rows) <= points:
        return rows
    return [rows[len(rows) * k // points] for k in range(points)] + [rows[-1]]


def read_run(path: Path, root: Path | None = None) -> dict[str, Any]:
    """The runs-table fields a run directory gives (everything but id, origin and the UI's own state).

    Args:
        root: the runs folder the run must lie in (default: only its files are confined to it).
    """
    run = RunDir(path, confined_to=root if root is not None else path)
    # A "running" run whose launcher's lock is free is lost (read_status); no file read through a symlink out of the run.
    status = run.read_status() or {}
    plan = run.read_plan_fields()
    summary = run.read_summary()
    glance = metrics_glance(run.own_or_none(run.metrics))
    last, first = glance["last"] or {}, glance["first"] or {}
    if last.get("kind") == "eval":  # an evaluation of the last step: the step's own row has its loss
        last = next((row for row in reversed(glance["tail"]) if row.get("kind") is None), last)
    state = status.get("state") or "starting"
    diagnosis = status.get("diagnosis") if isinstance(status.get("diagnosis"), dict) else None
    if state in ("running", "starting") and status.get("supervisor_pid"):
        if not process_alive(status.get("supervisor_pid"), status.get("started_at")):
            state = "lost"
            diagnosis = {
                "text": (
                    f"the launcher (pid {status.get('supervisor_pid')}) is gone but never recorded how the run ended: "
                    "the machine restarted or the launcher was killed with SIGKILL. Ranks it started may still be running "
                    "(check `ps`); resume from the last complete checkpoint."
                ),
                "cause": "the launcher process disappeared",
                "fix": "resume from the last checkpoint",
            }
    step_times = [r.get("step_time_s") for r in glance["tail"] if isinstance(r.get("step_time_s"), (int, float))]
    preview = [[r["step"] for r in glance["rows"] if is_number(r.get("loss"))], [r["loss"] for r in glance["rows"] if is_number(r.get("loss"))]]
    try:
        created = min(p.stat().st_mtime for p in (run.config, run.plan_file) if p.exists())
    except ValueError:
        created = path.stat().st_mtime if path.exists() else time.time()
    # The first recorded step was at the run's first start (a resume keeps the rows before its
    # checkpoint): started_at alone is the last resume's.
    first_step_at = first["time"] - (first["step_time_s"] if is_number(first.get("step_time_s")) else 0) if is_number(first.get("time")) else None
    starts = [t for t in (first_step_at, status.get("started_at")) if is_number(t)]
    return {
        "name": path.name,
        "state": state,
        "created_at": plan.get("created_at") or created,
        "started_at": status.get("started_at"),
        "first_started_at": min(starts) if starts else None,
        "ended_at": status.get("ended_at"),
        "step": int(last["step"]) if "step" in last else (summary.get("steps") or 0),
        "total_steps": plan.get("total_steps"),
        "first_loss": first.get("loss") if is_number(first.get("loss")) else summary.get("first_loss"),
        "last_loss": last.get("loss") if is_number(last.get("loss")) else summary.get("final_loss"),
        "step_time_s": sum(step_times) / len(step_times) if step_times else None,
        "world_size": plan.get("world_size"),
        "zero_stage": plan.get("zero_stage"),
        "accelerator": plan.get("accelerator"),
        "supervisor_pid": status.get("supervisor_pid"),
        "pids": status.get("pids"),
        "diagnosis": diagnosis,
        "loss_preview": preview,
        "has_samples": int(run.samples.is_dir()),
        "missing": 0,
    }


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


def signature(path: Path) -> tuple:
    """Changes whenever a file the runs list shows changes; unchanged finished runs are not re-read."""
    out = []
    run = RunDir(path)
    for file in (run.status_file, run.plan_file, run.metrics, run.summary, run.samples):
        try:
            stat = os.stat(file)
            out.append((stat.st_mtime_ns, stat.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


def eta_seconds(run: dict[str, Any]) -> float | None:
    if run.get("state") not in ("running", "starting") or not run.get("total_steps") or not run.get("step_time_s"):
        return None
    return max(0, run["total_steps"] - (run.get("step") or 0)) * run["step_time_s"]


class RunNotFound(ZeroPipeError):
    """No run with that id, name or path in the store."""


def tail_lines(path: Path, lines: int, max_bytes: int = 512 * 1024, within: Path | None = None) -> list[str]:
    """The last ``lines`` lines of a file; none when it resolves outside ``within``."""
    if within is not None and confined(path, within) is None:
        return []
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return []
    text = data.decode("utf-8", errors="replace")
    return list(deque(text.splitlines(), maxlen=lines))
