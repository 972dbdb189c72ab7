"""The run store's actions on runs (``store.store.RunStore`` is a ``RunActions``): launch, stop, resume, export, eval, delete, rename.

They share the store's locks, its database and its confinement of paths (``self``: the
``RunStore``); each one checks the run's state first and refuses with an ``ActionRefused``
that says why and what to do.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from pathlib import Path
from typing import Any

import yaml

from zeropipe.checkpoint.manager import COMPLETE_MARKER, TAG_PATTERN, latest_checkpoint, list_checkpoints, write_atomic
from zeropipe.config.yaml_text import too_deep
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.rundir import RunDir
from zeropipe.store.index import TERMINAL, RunNotFound, process_alive, read_json, tail_lines
from zeropipe.store.processes import spawn, terminate, zeropipe_argv
from zeropipe.store.sandbox import OutsideRoots, absolutize, check_name, config_path_problems, is_inside

log = logging.getLogger(__name__)


class ActionRefused(ZeroPipeError):
    """The action cannot be done in the run's current state; the message says why and what to do."""


class RunActions:
    """The actions half of ``RunStore``: every method here runs on a ``RunStore`` (its db, roots, children and locks)."""

    # =============================================================== actions
    def validate(self, raw: dict[str, Any]):
        """A submitted config validated as ``zeropipe train`` validates it, plus the UI's path rules.

        Returns (config, raw config with absolute paths).

        Raises:
            ConfigError: every problem, each with its key.
        """
        from zeropipe.config.load import validate_config

        problems = config_path_problems(raw, self.roots, self.allow_remote_code, self.trust_multinode)
        if too_deep(raw):  # refused before anything walks it recursively
            raise ConfigError(problems, source="the submitted config")
        absolute = absolutize(raw, self.roots)
        return validate_config(absolute, source="the submitted config", extra_problems=problems), absolute

    def launch(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Validate a config and start ``zeropipe train`` on it, detached.

        Raises:
            ConfigError, CheckFailed: the config would not run (nothing is started).
            ActionRefused: a run of that name already exists.
        """
        from zeropipe.check import CheckFailed

        if not isinstance(raw.get("run"), dict) or not raw["run"].get("name"):
            raise ConfigError([("run.name", "missing: name the run (it becomes the folder runs/NAME)")], source="the submitted config")
        from zeropipe.check import check_config

        config, absolute = self.validate(raw)
        findings = check_config(self.resolve_confined(config) or config)
        if any(f.severity == "error" for f in findings):
            raise CheckFailed(findings)
        run_path = (Path(config.run.output_dir) / config.run.name).resolve()
        with self.refresh_lock:
            row = self.db.run_by_path(run_path)
            written = RunDir(run_path)
            if any(p.exists() for p in (written.status_file, written.metrics, written.checkpoints)) or (row and self.open_launch(row["id"])):
                raise ActionRefused(f"{run_path} already holds a run: choose another run.name (e.g. {config.run.name}-2), or resume that run from its page")
            command = self.launch_command(config, absolute)
            config_path = Path(command["config_path"])
            config_path.parent.mkdir(parents=True, exist_ok=True)
            config_path.write_text(command["yaml"])
            argv = command["argv"]
            fields = dict(name=config.run.name, root=str(run_path.parent), origin="ui", state="starting", created_at=time.time(), missing=0,
                          started_at=None, ended_at=None, diagnosis=None, stop_requested_at=None, step=0, last_loss=None, first_loss=None)  # fmt: skip
            if row:
                run_id = row["id"]
                self.db.update_run(run_id, **fields)
            else:
                run_id = self.db.insert_run(path=str(run_path), **fields)
            self.start(run_id, "train", argv, run_path / "logs" / "launcher.log", config_path=str(config_path))
        return self.run(run_id)

    def resolve_confined(self, config):
        """The config resolved as the launcher will resolve it, confined to the roots (the DeepSpeed JSON's paths included).

        Returns None when it cannot be resolved for a reason ``check_config`` reports (ZP008: a
        batch that does not divide over the ranks; no choice of the auto knobs fits).

        Raises:
            ConfinementError: a path of the config or of its DeepSpeed JSON outside the roots.
            ConfigError: what the launcher would refuse when resolving it (a hostfile that is none,
                ssh options off the allow-list): refused here, before a launcher starts.
        """
        from zeropipe.launch.resolve import resolve_run

        try:
            return resolve_run(config, fill_auto_knobs=False, confinement=self.confinement)
        except ConfigError as err:
            if all(key == "deepspeed.train_batch_size" for key, _ in err.problems):
                return None
            raise
        except ZeroPipeError:
            return None

    def confine_arguments(self) -> list[str]:
        """``zeropipe train``'s arguments that confine a run launched here (its resolved run applies them; run.json keeps them)."""
        arguments = [part for root in self.confinement.roots for part in ("--confine-to", str(root))]
        return arguments + (["--confine-multinode"] if self.trust_multinode else [])

    def launch_command(self, config, absolute: dict[str, Any]) -> dict[str, Any]:
        """What a launch of ``config`` writes and runs: the config file's path and text, and the command.

        The New-run page's command preview shows this, so it is the launch itself, not a copy of it.
        """
        run_path = (Path(config.run.output_dir) / config.run.name).resolve()
        config_path = run_path.parent / "configs" / f"{config.run.name}.yaml"
        text = f"# Launched from zeropipe ui. Run it again: zeropipe train {config_path}\n" + yaml.safe_dump(absolute, sort_keys=False)
        confine = self.confine_arguments()
        argv = zeropipe_argv("train", config_path, *confine)
        command = " ".join(shlex.quote(part) for part in ["zeropipe", "train", str(config_path), *confine])
        return {"config_path": str(config_path), "yaml": text, "argv": argv, "command": command, "cwd": str(self.roots.base)}

    def start(self, run_id: int, action: str, argv: list[str], log_path: Path, stdout_path: Path | None = None, **fields: Any) -> int:
        if any(self.roots.runs_root_of(p) is None for p in (log_path, stdout_path) if p is not None):
            raise OutsideRoots(f"{log_path} leads out of the runs folders (a symlink?): nothing is started")
        proc = spawn(argv, log_path, self.roots.base, stdout_path)
        launch_id = self.db.insert_launch(run_id=run_id, action=action, pid=proc.pid, command=argv, log_path=str(log_path), started_at=time.time(), **fields)
        self.children[launch_id] = proc
        return launch_id

    def open_launch(self, run_id: int, actions: tuple[str, ...] = ("train", "resume")) -> dict[str, Any] | None:
        self.reap()
        return next((launch for launch in self.db.launches(run_id, open_only=True) if launch["action"] in actions), None)

    def busy_launch(self, run: dict[str, Any]) -> dict[str, Any] | None:
        """The launcher still working on this run, if any.

        A launcher writes the run's outcome to status.json and then takes a moment to exit:
        one that has already recorded its end is waited for (briefly), not counted as busy.
        """
        launch = self.open_launch(run["id"])
        if launch is None:
            return None
        status = self.run_dir(run).read_status_fields()
        if status.get("state") in TERMINAL and (status.get("started_at") or 0) >= launch["started_at"]:
            deadline = time.time() + 15
            while time.time() < deadline and process_alive(launch["pid"], launch["started_at"]):
                time.sleep(0.2)
                self.reap()
            return None
        return launch

    def request_samples(self, ref: int | str) -> dict[str, Any]:
        """Ask a running run for samples now: a request file its ranks answer together at the next step boundary.

        The UI never joins the run's collective itself; rank 0 sees the file, tells every rank, they
        sample together (as at ``generate.sample_every``) and rank 0 removes the file.

        Raises:
            ActionRefused: the run is not training now.
        """
        self.refresh(scan=False)
        run = self.run(ref)
        status = self.run_dir(run).read_status_fields()
        if run["state"] != "running" or status.get("state") != "running":
            raise ActionRefused(f"run {run['name']} is {run['state']}, not training: samples are drawn by its ranks while it trains")
        request = self.own(run, RunDir(run["path"]).sample_request.name)
        pending = request.is_file()
        if not pending:
            write_atomic(request, json.dumps({"requested_at": time.time(), "by": "zeropipe ui"}))
        return {"requested": True, "already_pending": pending, "step": run["step"]}

    def stop(self, ref: int | str) -> dict[str, Any]:
        """SIGTERM the run's launcher: it stops every rank and marks the run stopped.

        Raises:
            ActionRefused: the run is not running, or no live process of it is known.
        """
        self.refresh(scan=False)
        run = self.run(ref)
        if run["state"] not in ("running", "starting", "stopping"):
            raise ActionRefused(f"run {run['name']} is {run['state']}, not running: there is nothing to stop")
        status = self.run_dir(run).read_status_fields()
        launch = self.open_launch(run["id"])
        sent = False
        if status.get("state") == "running" and status.get("supervisor_pid"):
            sent = terminate(status["supervisor_pid"], status.get("started_at"))
        if not sent and launch is not None:
            sent = terminate(launch["pid"], launch["started_at"])
        if not sent:
            raise ActionRefused(f"no live launcher of run {run['name']} was found (it may have just ended); refresh the page")
        self.db.update_run(run["id"], stop_requested_at=time.time())
        self.refresh(scan=False)
        return self.run(run["id"])

    def checkpoint_for(self, run: dict[str, Any], tag: str | None):
        """A complete checkpoint of the run (default: the latest), for resume, export, eval and generate.

        Raises:
            ActionRefused: no such complete checkpoint.
            OutsideRoots: its folder is a symlink leading out of the run (hidden from the list, and never used).
        """
        info = self.find_checkpoint(run, tag)
        if self.own_or_none(run, f"checkpoints/{info.tag}") is None:
            raise OutsideRoots(f"checkpoint {info.tag} of run {run['name']} leads outside the run directory (a symlink to elsewhere): it is not used")
        return info

    def find_checkpoint(self, run: dict[str, Any], tag: str | None):
        complete = list_checkpoints(Path(run["path"]))
        if tag is None:
            info = latest_checkpoint(Path(run["path"]))
            if info is None:
                raise ActionRefused(f"run {run['name']} has no complete checkpoint: set train.save_every to save during training")
            return info
        if not isinstance(tag, str) or not TAG_PATTERN.match(tag):
            raise ActionRefused(f"{tag!r} is not a checkpoint name (they look like step_00000120)")
        for info in complete:
            if info.tag == tag:
                return info
        raise ActionRefused(f"run {run['name']} has no complete checkpoint {tag}: pick one from its checkpoint list")

    def resume(self, ref: int | str, checkpoint: str | None = None, gpus: int | None = None) -> dict[str, Any]:
        """Continue a run that ended from one of its complete checkpoints (default: the latest).

        Args:
            gpus: the number of ranks to resume on (default: the config's ``hardware.gpus``);
                another count than the checkpoint's is converted to a universal checkpoint
                with the global batch kept.

        Raises:
            ActionRefused: the run is still running, has no such checkpoint, nothing left to
                train, or cannot resume on ``gpus`` ranks (named with the counts that work).
            ConfigError: its config no longer validates (a data file moved).
        """
        self.refresh(scan=False)
        run = self.run(ref)
        if run["state"] not in ("completed", "failed", "stopped", "lost"):
            raise ActionRefused(f"run {run['name']} is {run['state']}: stop it before resuming")
        if run["state"] == "lost" and any(process_alive(pid) for pid in run.get("pids") or []):
            raise ActionRefused(f"run {run['name']} lost its launcher but rank processes {run['pids']} are still alive: end them first")
        info = self.checkpoint_for(run, checkpoint)
        if run.get("total_steps") and info.step >= run["total_steps"]:
            raise ActionRefused(f"{info.tag} is the end of the run ({run['total_steps']} steps): there is nothing left to train; pick an earlier checkpoint")
        run_dir = self.run_dir(run)
        config_file = run_dir.own(run_dir.config)  # what the resumed launcher reads: refused when it leads out of the run
        raw = run_dir.read_config_fields()
        problems = [p for p in config_path_problems(raw, self.roots, self.allow_remote_code, self.trust_multinode) if p[0] not in ("run.name", "run.output_dir")]
        if problems:
            raise ConfigError(problems, source=str(config_file))
        if gpus is not None:
            self.check_rank_count(run, info, raw, gpus)
        self.busy_launch(run)  # waits (outside the lock) for a launcher that is only exiting
        with self.refresh_lock:
            if self.busy_launch(run):
                raise ActionRefused(f"run {run['name']} is already being started")
            ranks = [f"hardware.gpus={gpus}"] if gpus is not None else []
            argv = zeropipe_argv("train", config_file, *ranks, "--resume", info.path, *self.confine_arguments())
            self.db.update_run(run["id"], state="starting", stop_requested_at=None, diagnosis=None)
            detail = {"checkpoint": info.tag, **({"gpus": gpus} if gpus is not None else {})}
            self.start(run["id"], "resume", argv, run_dir.logs / "launcher.log", config_path=str(config_file), detail=detail)
        self.refresh(scan=False)
        return self.run(run["id"])

    def check_rank_count(self, run: dict[str, Any], info, raw: dict[str, Any], gpus: int) -> None:
        """Refuse, before anything starts, a resume on ``gpus`` ranks that the launcher would refuse.

        Raises:
            ActionRefused: the family resumes only on the saving rank count, the checkpoint's
                global batch does not divide over ``gpus`` ranks, or fewer GPUs are visible.
        """
        from zeropipe.families import family_named
        from zeropipe.launch.resume import resume_batch_shape

        marker = read_json(info.path / COMPLETE_MARKER) or {}
        plan = self.run_dir(run).read_plan_fields()
        name = str((raw.get("model") or {}).get("family") or "auto")
        try:
            family = family_named(name) if name != "auto" else None
        except ConfigError:
            family = None  # a plug-in family this server has not loaded: the launcher decides
        micro = (raw.get("train") or {}).get("micro_batch_size")
        micro = micro if isinstance(micro, int) and micro > 0 else plan.get("micro_batch_size")
        if isinstance(micro, int) and micro > 0:
            # The launcher's own rule (zeropipe.launch.resume), said before anything starts.
            try:
                resume_batch_shape(family, marker, plan, micro, 1, gpus, info.tag)
            except ZeroPipeError as err:
                raise ActionRefused(str(err).replace("resume with hardware.gpus set to one of", "resume on one of these rank counts:")) from None
        if plan.get("accelerator") == "cuda":
            import torch

            visible = torch.cuda.device_count()
            if gpus > visible:
                raise ActionRefused(f"{gpus} ranks asked for but only {visible} GPUs are visible to this server's machine: choose at most {visible}")

    def export(self, ref: int | str, checkpoint: str | None = None, name: str | None = None, merge: bool = False, dtype: str | None = None) -> dict[str, Any]:
        """Start ``zeropipe export`` of a checkpoint into RUN/exports/NAME.

        Raises:
            ActionRefused: no such checkpoint, a bad name, or NAME exists already.
        """
        run = self.run(ref)
        info = self.checkpoint_for(run, checkpoint)
        name = name or (info.tag + ("-merged" if merge else ""))
        problems = check_name(name, "name")
        if problems:
            raise ActionRefused(problems[0][1])
        if dtype not in (None, "bf16", "fp16", "fp32"):
            raise ActionRefused(f"dtype must be bf16, fp16 or fp32 (you gave {dtype!r})")
        exports = Path(run["path"]) / "exports"
        out = exports / name
        if out.exists() or any(e["out_path"] == str(out) and e["state"] == "running" for e in self.exports(run)):
            raise ActionRefused(f"{out} already exists: choose another export name")
        argv = zeropipe_argv("export", info.path, "--out", out, *(["--merge"] if merge else []), *(["--dtype", dtype] if dtype else []))
        launch_id = self.start(run["id"], "export", argv, exports / f"{name}.log", out_path=str(out), detail={"checkpoint": info.tag, "merge": merge, "dtype": dtype, "name": name})
        return next(e for e in self.exports(run) if e["id"] == launch_id)

    def readable_file(self, name: str) -> Path:
        """A file the UI may read (inside the runs or data folders), resolved.

        Raises:
            OutsideRoots: it lies elsewhere (or names no file at all).
            ActionRefused: it does not exist.
        """
        resolved = self.roots.absolute(name)
        if not any(is_inside(resolved, root) for root in self.roots.readable()):
            raise OutsideRoots(f"{name} is outside the folders this UI may read ({', '.join(map(str, self.roots.readable()))})")
        if not resolved.is_file():
            raise ActionRefused(f"{name} is not a file: give a file inside {', '.join(map(str, self.roots.readable()))}")
        return resolved

    # ============================================================ evaluation
    def evaluate(self, ref: int | str, checkpoint: str | None = None, data: str | None = None) -> dict[str, Any]:
        """Start ``zeropipe eval`` on a checkpoint; its result is kept in RUN/evals/ID.json.

        Args:
            data: a file in the data folders to evaluate on; default: the run's held-out data.

        Raises:
            ActionRefused: no such checkpoint, or an evaluation of the run is still running.
            OutsideRoots: ``data`` lies outside the data and runs folders.
        """
        run = self.run(ref)
        info = self.checkpoint_for(run, checkpoint)
        argv = ["eval", info.path.parent.parent, "--checkpoint", info.tag, "--json"]
        if data:
            argv += ["--data", self.readable_file(data)]
        elif not self.has_held_out(run):
            raise ActionRefused(f"run {run['name']} has no held-out data (it trained without data.eval_fraction or data.eval_path): give a data file to evaluate on")
        if self.open_launch(run["id"], ("eval",)):
            raise ActionRefused(f"an evaluation of run {run['name']} is still running: wait for its result")
        evals = self.own(run, "evals")
        number = 1 + max([int(p.stem) for p in evals.glob("*.json") if p.stem.isdigit()] or [0]) if evals.is_dir() else 1
        launch_id = self.start(run["id"], "eval", zeropipe_argv(*argv), evals / f"{number}.log", stdout_path=evals / f"{number}.json",
                               out_path=str(evals / f"{number}.json"), detail={"checkpoint": info.tag, "data": str(argv[-1]) if data else None})  # fmt: skip
        return next(e for e in self.evaluations(run) if e["id"] == launch_id)

    def progress(self, run: dict[str, Any]) -> dict[str, Any]:
        """What a starting run is doing before its first step (RUN/progress.json), ``{}`` once it trains or has ended."""
        if run["state"] not in ("starting", "running"):
            return {}
        run_dir = self.run_dir(run)
        progress = run_dir.read_progress()
        if not progress.get("phase") or not isinstance(progress.get("at"), (int, float)):
            return {}
        try:
            if run_dir.own(run_dir.metrics).stat().st_mtime > progress["at"]:
                return {}  # a step was recorded since: the run trains, the page shows its steps
        except (OSError, ZeroPipeError):  # no metrics yet, or unreadable: the progress file stands
            pass
        return {key: progress.get(key) for key in ("phase", "done", "total", "at")}

    def actions(self, run: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """What the run's family can do beyond training, each with the reason when it cannot (the page offers only these)."""
        from zeropipe.families import family_named

        name = str(((self.run_dir(run).read_config_fields() or {}).get("model") or {}).get("family") or "auto")
        try:
            family = family_named(name) if name != "auto" else None
        except ConfigError:
            family = None  # a plug-in this server has not loaded: offer everything, the action says what is wrong
        answers = family is None or family.answers_prompts
        evaluates = family is None or getattr(family, "evaluates_loss", False)  # a plug-in that does not say: no
        drawn = "draw pictures with it on the Draw page; its samples are in the sample gallery below"
        reason = None if evaluates else f"Evaluation computes a language model's loss on held-out text; a {name} run has none ({drawn})."
        if evaluates and family is not None and getattr(family, "evaluate_held_out", None) is not None and not self.has_held_out(run):
            # A family that evaluates only the held-out data it kept (a diffusion run's validation loss) takes no file instead.
            evaluates, reason = False, f"This {name} run kept no held-out data: train with data.eval_fraction (e.g. 0.05) or data.eval_path to get its validation loss."
        return {
            "generate": {"available": answers, "reason": None if answers else f"A {name} model does not answer prompts: {drawn}."},
            "evaluate": {"available": evaluates, "reason": reason},
            "draw": {"available": bool(getattr(family, "draws_images", False)), "reason": None if getattr(family, "draws_images", False) else f"A {name} model writes text: talk to it on the Chat page."},
        }

    def has_held_out(self, run: dict[str, Any]) -> bool:
        """Whether the run kept held-out data (data.eval_fraction or data.eval_path) to evaluate on: tokenized, or a diffusion run's held-out items."""
        info = self.own_or_none(run, "cache/eval/cache.json")
        if info is not None and info.is_file():
            return True
        plan = self.own_or_none(run, "data/diffusion.json")
        return plan is not None and plan.is_file() and bool((read_json(plan) or {}).get("eval_items"))

    def evaluations(self, run: dict[str, Any]) -> list[dict[str, Any]]:
        """The run's evaluations started here, newest first, with their result once written."""
        out = []
        for launch in self.db.launches(run["id"], "eval"):
            result_file = self.own_or_none(run, f"evals/{Path(launch['out_path']).name}")
            result = read_json(result_file) if launch["ended_at"] is not None and result_file else None
            if launch["ended_at"] is None:
                state = "running"
            elif launch["exit_code"] == 0 and isinstance(result, dict):
                state = "done"
            else:
                state = "failed"
            out.append({
                "id": launch["id"], "state": state, "started_at": launch["started_at"], "ended_at": launch["ended_at"], **(launch["detail"] or {}),
                "result": result if state == "done" else None,
                "log_tail": tail_lines(Path(launch["log_path"]), 15, within=Path(run["path"])) if state == "failed" else [],
            })  # fmt: skip
        return out

    # ========================================================== management
    def idle_or_refuse(self, run: dict[str, Any], doing: str) -> None:
        """Refuse while a process writes into the run (training, resuming, exporting)."""
        if run["state"] in ("running", "starting", "stopping"):
            raise ActionRefused(f"run {run['name']} is {run['state']}: stop it before you {doing}")
        if self.open_launch(run["id"], ("train", "resume", "export")):
            raise ActionRefused(f"a process of run {run['name']} (training or an export) is still running: wait for it to end before you {doing}")
        if self.open_launch(run["id"], ("eval",)):
            raise ActionRefused(f"an evaluation of run {run['name']} is still running: wait for it to end before you {doing}")

    def own_run_dir(self, run: dict[str, Any]) -> Path:
        """The run's directory, checked to be a folder of a runs root and not the root itself."""
        path = Path(run["path"])
        root = self.roots.runs_root_of(path)
        if root is None or path.resolve().parent != root or path.is_symlink():
            raise OutsideRoots(f"{path} is not a run folder directly under a runs folder: it is left alone")
        return path

    def delete(self, ref: int | str, confirm: str) -> dict[str, Any]:
        """Delete a run that has ended: its directory (checkpoints, exports, logs) and its records.

        Args:
            confirm: the run's name, as the person confirming typed or saw it.

        Raises:
            ActionRefused: the run is still running, or ``confirm`` is not its name.
        """
        import shutil

        self.refresh(scan=False)
        run = self.run(ref)
        if confirm != run["name"]:
            raise ActionRefused(f"to delete run {run['name']}, confirm with its name (you sent {confirm!r})")
        with self.refresh_lock:
            self.idle_or_refuse(run, "delete it")
            path = self.own_run_dir(run)
            checkpoints = self.checkpoints(run) if path.exists() else []
            if path.exists():
                # Out of the runs folder first (one rename), so the index never sees a half-deleted run.
                doomed = path.with_name(f".deleting-{path.name}-{int(time.time())}")
                path.rename(doomed)
                shutil.rmtree(doomed)
            launched = self.launched_config(run, path)
            if launched is not None:
                launched.unlink()  # RUNS/configs/NAME.yaml went with the run it launched
            self.series.forget(RunDir(path).metrics)
            self.signatures.pop(str(path), None)
            self.db.delete_run(run["id"])
        return {"deleted": run["name"], "path": str(path), "checkpoints": len(checkpoints), "bytes": sum(c["size_bytes"] for c in checkpoints)}

    def rename(self, ref: int | str, new_name: str) -> dict[str, Any]:
        """Give a run that has ended another name: its folder moves, and its config.yaml says so (resume uses it).

        Raises:
            ActionRefused: the run is still running, the name is not a folder name, or it is taken.
        """
        self.refresh(scan=False)
        run = self.run(ref)
        problems = check_name(new_name, "name")
        if problems:
            raise ActionRefused(problems[0][1])
        if new_name == run["name"]:
            return run
        with self.refresh_lock:
            self.idle_or_refuse(run, "rename it")
            old = self.own_run_dir(run)
            new = old.parent / new_name
            if new.exists() or self.db.run_by_path(new):
                raise ActionRefused(f"{new} exists: choose another name")
            run_dir = self.run_dir(run)
            # Read (and refused when it is not a config) before anything moves: a config.yaml that
            # leads out of the run is left as it is.
            raw = run_dir.read_config_fields() if run_dir.own_or_none(run_dir.config) and run_dir.config.is_file() else None
            launched = self.launched_config(run, old)
            old.rename(new)
            if launched is not None:
                self.rename_launched_config(run["id"], launched, new_name)
            if raw is not None:
                if not isinstance(raw.get("run"), dict):
                    raw["run"] = {}
                raw["run"]["name"] = new_name
                RunDir(new).write_config_fields(raw)
            self.db.update_run(run["id"], path=str(new), name=new_name)
            for launch in self.db.launches(run["id"]):
                moved = {k: str(new) + launch[k][len(str(old)) :] for k in ("log_path", "out_path") if launch[k] and launch[k].startswith(str(old) + "/")}
                if moved:
                    self.db.update_launch(launch["id"], **moved)
            self.series.forget(RunDir(old).metrics)
            self.signatures.pop(str(old), None)
        self.refresh(scan=False)
        return self.run(run["id"])

    def launched_config(self, run: dict[str, Any], path: Path) -> Path | None:
        """RUNS/configs/NAME.yaml when the UI launched this run from it and it is still there (a plain file, in the run's own runs folder)."""
        configs = path.parent / "configs"
        for launch in self.db.launches(run["id"]):
            if launch["action"] != "train" or not launch.get("config_path"):
                continue
            candidate = Path(launch["config_path"])
            if candidate.parent != configs or candidate.name != f"{run['name']}.yaml" or candidate.is_symlink() or not candidate.is_file():
                continue
            if self.roots.runs_root_of(candidate.resolve()) is not None:
                return candidate
        return None

    def rename_launched_config(self, run_id: int, launched: Path, new_name: str) -> None:
        """Move RUNS/configs/OLD.yaml to NEW.yaml with the new run.name, so rerunning it writes into the renamed run."""
        target = launched.with_name(f"{new_name}.yaml")
        if target.exists():
            return  # another run's launch config has that name: leave both as they are
        try:
            fields = yaml.safe_load(launched.read_text()) or {}
        except (OSError, yaml.YAMLError, ValueError):
            return
        if not isinstance(fields, dict):
            return
        if not isinstance(fields.get("run"), dict):
            fields["run"] = {}
        fields["run"]["name"] = new_name
        target.write_text(f"# Launched from zeropipe ui. Run it again: zeropipe train {target}\n" + yaml.safe_dump(fields, sort_keys=False))
        launched.unlink()
        for launch in self.db.launches(run_id):
            if launch.get("config_path") == str(launched):
                self.db.update_launch(launch["id"], config_path=str(target))

    def model_source(self, run: dict[str, Any], export: str | None, checkpoint: str | None) -> tuple[Path, str | None]:
        """What Generate, Chat and Draw load: a finished export of the run, or one of its complete checkpoints.

        Returns:
            (the folder, the checkpoint tag or None for an export).

        Raises:
            ActionRefused / OutsideRoots: no such export, or no complete checkpoint (with the reason).
        """
        if export is not None:
            return self.export_folder(run["id"], export), None
        return self.own_run_dir(run), self.checkpoint_for(run, checkpoint).tag  # a complete one: refused with a reason otherwise

    def export_folder(self, ref: int | str, name: str) -> Path:
        """A finished export's folder, for download.

        Raises:
            RunNotFound: no finished export of that name in this run.
        """
        run = self.run(ref)
        if check_name(name, "name"):
            raise RunNotFound(f"no export {name!r} in run {run['name']}")
        folder = self.own_or_none(run, f"exports/{name}")
        done = [e for e in self.exports(run) if e["state"] == "done" and Path(e["out_path"]).name == name]
        if folder is None or not folder.is_dir() or not done:
            finished = ", ".join(Path(e["out_path"]).name for e in self.exports(run) if e["state"] == "done") or "none yet"
            raise RunNotFound(f"no finished export {name!r} in run {run['name']} (finished: {finished})")
        return folder
