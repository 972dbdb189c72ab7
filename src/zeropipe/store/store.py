"""The run store: the database, the run directories it indexes, and the actions on runs.

This module holds the store itself, its indexing and its queries; the actions on runs (launch,
stop, resume, export, eval, delete, rename) are ``store.actions.RunActions``, presets and
archives live in their own modules.

Run directories are the truth; the database is an index of them plus what only the UI
knows (which processes it started, when a stop was asked for). Runs started from the
command line appear on the next ``refresh``; runs started here keep going when the UI
stops, and a restarted UI finds them again, because everything it needs to reattach (the
launcher's pid, the metrics) is on disk.
"""

from __future__ import annotations

import logging
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any


from zeropipe.checkpoint.manager import COMPLETE_MARKER, latest_checkpoint, list_checkpoints
from zeropipe.rundir import RunDir
from zeropipe.store.actions import RunActions
from zeropipe.store.db import Database
from zeropipe.store.index import TERMINAL, RunNotFound, eta_seconds, find_run_dirs, is_run_dir, process_alive, read_json, read_run, signature, tail_lines
from zeropipe.store.sandbox import OutsideRoots, Roots, resolve_inside
from zeropipe.store.series import SeriesCache

LOG_NAME = re.compile(r"^(rank\d{1,4}|launcher|node_setup)$")  # node_setup: the caching process run before the ranks
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".gif"}
log = logging.getLogger(__name__)
STOPPING_SECONDS = 120  # how long "stopping" is shown before the launcher's own word is awaited no more


class RunStore(RunActions):
    RunNotFound = RunNotFound  # for the store's parts (presets) that cannot import this module

    def __init__(self, roots: Roots, db_path: str | Path | None = None, allow_remote_code: bool = False, trust_multinode: bool = False):
        """Args:
            allow_remote_code: accept ``trust_remote_code`` in submitted configs (``zeropipe ui --allow-remote-code``).
            trust_multinode: accept the fields that start commands on other machines (hardware.nodes, hostfile,
                ssh_options from the allow-list, ...: ``zeropipe ui --trust-multinode``).
        """
        self.roots = roots
        self.allow_remote_code = allow_remote_code
        self.trust_multinode = trust_multinode
        # What every run launched here is confined to, by the launcher and every later reader of the run.
        self.confinement = roots.confinement(multinode=trust_multinode)
        for root in roots.runs:
            root.mkdir(parents=True, exist_ok=True)
        self.db_path = Path(db_path).expanduser().resolve() if db_path else roots.primary_runs / ".zeropipe" / "runs.sqlite3"
        self.db = Database(self.db_path)
        self.series = SeriesCache(self.db_path.parent / "series")
        self.signatures: dict[str, tuple] = {}
        self.children: dict[int, subprocess.Popen] = {}
        self.refresh_lock = threading.RLock()
        from zeropipe.store.presets import Presets

        self.presets = Presets(self)

    def close(self) -> None:
        self.series.save_all(force=True)
        self.db.close()

    # ============================================================== indexing
    def refresh(self, scan: bool = True) -> None:
        """Bring the database in step with the run directories and the processes we started."""
        with self.refresh_lock:
            self.reap()
            known = {row["path"]: row for row in self.db.runs(include_missing=True)}
            if scan:
                for root in self.roots.runs:
                    for path in find_run_dirs(root):
                        if str(path) not in known:
                            run_id = self.db.insert_run(path=str(path), name=path.name, root=str(root), origin="cli", state="starting", created_at=time.time())
                            known[str(path)] = self.db.run(run_id)
            for row in known.values():
                # One run directory no reader expected (anyone's files: a copied or hand-edited run)
                # never stops the refresh of the others; it is logged, and its row keeps what it had.
                try:
                    self.refresh_run(row)
                except Exception:  # noqa: BLE001 - any defect of one run's files, reported once per change
                    log.warning("run %s (%s) could not be read; the others are refreshed", row.get("id"), row.get("path"), exc_info=True)

    def refresh_run(self, row: dict[str, Any]) -> None:
        path = Path(row["path"])
        if self.roots.runs_root_of(path) is None:
            # Indexed by an older version through a symlink, or replaced by one since: what
            # lies outside the runs folders is not served.
            if not row["missing"]:
                self.db.update_run(row["id"], missing=1)
            return
        launch = self.last_launch(row["id"], ("train", "resume"))
        mark = (signature(path), launch and (launch["id"], launch["ended_at"]), row["stop_requested_at"])
        if row["state"] in TERMINAL and self.signatures.get(row["path"]) == mark:
            return
        self.signatures[row["path"]] = mark
        fields: dict[str, Any] = read_run(path, self.roots.runs_root_of(path)) if is_run_dir(path) else {"state": "starting"}
        if not path.exists() and not launch:
            self.db.update_run(row["id"], missing=1)
            return
        status_started = fields.get("started_at") or 0
        if launch and launch["started_at"] > status_started:
            # The run directory's status predates this launch (or is not written yet): the
            # launcher is still preparing, or it ended before it could start any rank.
            if launch["ended_at"] is None:
                fields["state"] = "starting"
            else:
                fields["state"] = "stopped" if row["stop_requested_at"] and row["stop_requested_at"] >= launch["started_at"] else "failed"
                fields["diagnosis"] = launcher_diagnosis(launch) if fields["state"] == "failed" else None
                fields["ended_at"] = launch["ended_at"]
        if fields["state"] == "running" and row["stop_requested_at"] and time.time() - row["stop_requested_at"] < STOPPING_SECONDS:
            fields["state"] = "stopping"
        fields.pop("name", None)
        self.db.update_run(row["id"], updated_at=time.time(), **fields)

    def reap(self) -> None:
        """Record how the processes we started ended (and collect them, so they leave no zombies)."""
        for launch_id, proc in list(self.children.items()):
            code = proc.poll()
            if code is not None:
                self.db.update_launch(launch_id, ended_at=time.time(), exit_code=code)
                del self.children[launch_id]
        for launch in self.db.launches(open_only=True):
            # Started by an earlier UI: we cannot wait for it, only see that it is gone.
            if launch["id"] not in self.children and not process_alive(launch["pid"], launch["started_at"]):
                self.db.update_launch(launch["id"], ended_at=time.time())

    def last_launch(self, run_id: int, actions: tuple[str, ...]) -> dict[str, Any] | None:
        return next((launch for launch in self.db.launches(run_id) if launch["action"] in actions), None)

    # =============================================================== queries
    def runs(self, state: str | None = None, search: str | None = None) -> list[dict[str, Any]]:
        out = [public(row) for row in self.db.runs()]
        if state:
            wanted = set(state.split(","))
            out = [run for run in out if run["state"] in wanted]
        if search:
            needle = search.lower()
            out = [run for run in out if needle in run["name"].lower()]
        return out

    def run(self, ref: int | str) -> dict[str, Any]:
        """A run by id, name or path.

        Raises:
            RunNotFound: nothing matches (or a name matches several runs).
        """
        row = None
        if (isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit())) and 0 < int(ref) < 2**63:  # SQLite's integer range
            row = self.db.run(int(ref))
        if row is None and isinstance(ref, str):
            named = self.db.runs_named(ref)
            if len(named) > 1:
                raise RunNotFound(f"{len(named)} runs are named {ref!r}: use the id ({', '.join(str(r['id']) for r in named)})")
            row = named[0] if named else self.db.run_by_path(Path(ref).expanduser().resolve())
        if row is None or row["missing"]:
            raise RunNotFound(f"no run {ref!r}: `zeropipe runs ls` lists the runs")
        return public(row)

    def run_dir(self, run: dict[str, Any]) -> RunDir:
        """The run's directory, read confined: inside its runs folder, and no file read through a symlink out of the run."""
        path = Path(run["path"])
        # A run outside every runs folder (replaced by a symlink since it was indexed) is confined
        # to a folder it is not in: every read of it is refused.
        return RunDir(path, confined_to=self.roots.runs_root_of(path) or self.roots.primary_runs)

    def own(self, run: dict[str, Any], relative: str | Path) -> Path:
        """A path inside the run's directory, resolved.

        Raises:
            OutsideRoots: it leads out of the run (``..``, or a symlink to elsewhere).
        """
        return self.run_dir(run).own(relative)

    def own_or_none(self, run: dict[str, Any], relative: str | Path) -> Path | None:
        return self.run_dir(run).own_or_none(relative)

    def metrics_file(self, run: dict[str, Any]) -> Path:
        # A metrics.jsonl that leads out of the run is read as no metrics (a name that never exists).
        run_dir = self.run_dir(run)
        return run_dir.own_or_none(run_dir.metrics) or run_dir.path / ".metrics-outside-the-run"

    def log_names(self, run: dict[str, Any]) -> list[str]:
        logs = self.own_or_none(run, "logs")
        if logs is None:
            return []
        names = sorted((p.stem for p in logs.glob("rank*.log") if LOG_NAME.match(p.stem) and self.own_or_none(run, f"logs/{p.name}")), key=lambda n: int(n[4:]))
        named = [name for name in ("launcher", "node_setup") if self.own_or_none(run, f"logs/{name}.log") and (logs / f"{name}.log").is_file()]
        return named + names

    def read_log(self, run: dict[str, Any], name: str, lines: int = 200) -> list[str]:
        if not LOG_NAME.match(name):
            raise RunNotFound(f"no log {name!r}: logs are named rank0, rank1, ..., launcher and node_setup")
        path = self.own(run, f"logs/{name}.log")
        if not path.is_file():
            raise RunNotFound(f"run {run['name']} has no log {name!r}: its logs are {', '.join(self.log_names(run)) or 'not written yet'}")
        return tail_lines(path, max(1, min(lines, 5000)))

    def config_text(self, run: dict[str, Any]) -> str | None:
        """The run's config.yaml, or None before it is written.

        Raises:
            OutsideRoots: it leads out of the run.
        """
        return self.run_dir(run).read_config_text()

    def checkpoints(self, run: dict[str, Any]) -> list[dict[str, Any]]:
        path = Path(run["path"])
        latest = latest_checkpoint(path)
        out = []
        for info in reversed(list_checkpoints(path, complete_only=False)):
            if self.own_or_none(run, f"checkpoints/{info.tag}") is None:
                continue  # a symlink to a folder elsewhere
            marker = read_json(info.path / COMPLETE_MARKER) or {}
            size = sum(f.stat().st_size for f in info.path.rglob("*") if f.is_file() and not f.is_symlink())
            out.append(
                {
                    "tag": info.tag,
                    "step": info.step,
                    "complete": bool(marker),
                    "latest": latest is not None and latest.tag == info.tag,
                    "saved_at": marker.get("saved_at"),
                    "world_size": marker.get("world_size"),
                    "size_bytes": size,
                }
            )
        return out

    def generations(self, run: dict[str, Any]) -> list[dict[str, Any]]:
        return self.run_dir(run).read_generations()

    def samples(self, run: dict[str, Any]) -> list[dict[str, Any]]:
        """The sample images a diffusion run wrote, from samples/index.jsonl (step, prompt, file)."""
        run_dir = self.run_dir(run)
        root = run_dir.own_or_none(run_dir.samples)
        if root is None:
            return []
        out = []
        for row in run_dir.read_jsonl(run_dir.samples_index):
            try:
                file = self.sample_relative(root, row)
            except (OutsideRoots, TypeError, ValueError):
                continue  # an index line we cannot place is skipped, not served
            out.append({"step": row.get("step"), "prompt": row.get("prompt"), "file": file})
        return out

    @staticmethod
    def sample_relative(root: Path, row: dict[str, Any]) -> str:
        """The image's path relative to samples/; ``file`` may be relative to samples/ or to its step folder."""
        file = str(row["file"])
        candidates = [file]
        if isinstance(row.get("step"), int):
            candidates.insert(0, f"step_{row['step']:08d}/{file}")
        for candidate in candidates:
            resolved = resolve_inside(root, candidate)
            if resolved.is_file():
                return resolved.relative_to(root.resolve()).as_posix()
        return resolve_inside(root, candidates[-1]).relative_to(root.resolve()).as_posix()

    def sample_file(self, run: dict[str, Any], relative: str) -> Path:
        root = self.own(run, "samples")
        path = resolve_inside(root, relative)
        if path.suffix.lower() not in IMAGE_SUFFIXES or not path.is_file():
            raise RunNotFound(f"no sample image {relative!r} in this run")
        return path

    def metrics(self, run: dict[str, Any], keys: list[str] | None = None, width: int | None = None, after_step: float | None = None) -> dict[str, Any]:
        series = self.series.get(self.metrics_file(run))
        available = series.keys()
        chosen = [key for key in (keys or available) if key in available]
        out = series.window(chosen, width, after_step)
        out["keys"] = available
        return out

    def exports(self, run: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for launch in self.db.launches(run["id"], "export"):
            if launch["ended_at"] is None:
                state = "running"
            elif launch["exit_code"] == 0 and Path(launch["out_path"]).is_dir():
                state = "done"
            else:
                state = "failed"
            out.append(
                {
                    "id": launch["id"],
                    "state": state,
                    "out_path": launch["out_path"],
                    "started_at": launch["started_at"],
                    "ended_at": launch["ended_at"],
                    **(launch["detail"] or {}),
                    "log_tail": tail_lines(Path(launch["log_path"]), 15, within=Path(run["path"])) if state == "failed" else [],
                }
            )
        return out


def public(row: dict[str, Any]) -> dict[str, Any]:
    """A run as the API and the CLI show it."""
    total, step = row.get("total_steps"), row.get("step") or 0
    return {
        "id": row["id"],
        "name": row["name"],
        "path": row["path"],
        "state": row["state"],
        "origin": row["origin"],
        "step": step,
        "total_steps": total,
        "progress": min(1.0, step / total) if total else None,
        "eta_s": eta_seconds(row),
        "first_loss": row.get("first_loss"),
        "last_loss": row.get("last_loss"),
        "step_time_s": row.get("step_time_s"),
        "created_at": row.get("created_at"),
        "started_at": row.get("started_at"),
        "first_started_at": row.get("first_started_at") or row.get("started_at"),
        "ended_at": row.get("ended_at"),
        # Wall time from the first start to the end (or now), pauses between a stop and a resume included.
        "duration_s": duration_seconds(row),
        "world_size": row.get("world_size"),
        "zero_stage": row.get("zero_stage"),
        "accelerator": row.get("accelerator"),
        "pids": row.get("pids"),
        "diagnosis": row.get("diagnosis"),
        "loss_preview": row.get("loss_preview"),
        "has_samples": bool(row.get("has_samples")),
    }


def duration_seconds(row: dict[str, Any]) -> float | None:
    start = row.get("first_started_at") or row.get("started_at")
    if not start:
        return None
    end = row.get("ended_at") if row.get("state") in TERMINAL else None
    return max(0.0, (end or time.time()) - start)


def launcher_diagnosis(launch: dict[str, Any]) -> dict[str, Any]:
    log_path = Path(launch["log_path"])
    lines = tail_lines(log_path, 30, within=log_path.parent.parent)  # RUN/logs/launcher.log
    # `zeropipe train: error: ...` and the problem lines under it say why, with the fix.
    starts = [i for i, line in enumerate(lines) if ": error: " in line]
    code = launch["exit_code"]
    how = f"exited with code {code}" if code is not None else "ended"
    if starts:
        cause = "\n".join([lines[starts[-1]].split(": error: ", 1)[1], *lines[starts[-1] + 1 : starts[-1] + 12]])
    else:
        cause = "see the launcher's log below"
    text = f"zeropipe train {how} before any rank started\n{cause}\nlast lines of the launcher's log:\n" + "\n".join(f"  | {line}" for line in lines[-15:])
    return {"text": text, "how": how, "cause": cause, "fix": "", "rank": None}


