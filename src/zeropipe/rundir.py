"""The layout of a run directory: one place that names every file a run writes, and the typed hand-overs.

The launcher writes ``config.yaml`` (the validated config with its resolved values),
``ds_config.json`` and ``run.json`` (:class:`RunPlan`); each family's preparation writes its
data under ``data/`` and, for diffusion, ``pipeline/``; the ranks write ``logs/``,
``errors/``, ``metrics.jsonl``, ``checkpoints/``, ``samples/``, ``generations.jsonl`` and
``summary.json``. Every command that reads a run (ranks, export, eval, generate, the UI)
goes through :class:`RunDir`, and reads the saved config without re-checking that the
original data paths still exist (:meth:`RunDir.read_config`).

A run directory has one owner at a time: the launcher that holds an exclusive ``flock`` on
``RUN/.owner.lock`` for its whole life. The kernel drops the lock when that process ends,
however it ends (``kill -9`` included), so a ``running`` status whose lock is free belongs
to a launcher that is gone. A second ``zeropipe train`` or ``--resume`` of the same run
directory is refused while the lock is held.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from zeropipe.checkpoint.manager import write_atomic
from zeropipe.config.load import load_saved_config
from zeropipe.errors import ZeroPipeError

if TYPE_CHECKING:
    from zeropipe.config.schema import RunConfig

OWNER_LOCK = ".owner.lock"
# A reader marking a lost run holds the lock for a few milliseconds: a launcher waits that out.
CLAIM_WAIT_SECONDS = 1.0

# Lock files held by this process, by resolved run directory: open for the life of the process.
_held: dict[str, int] = {}


class RunDirBusy(ZeroPipeError):
    """Another live launcher owns the run directory."""


def disk_problem(err: OSError, run_dir: Path) -> ZeroPipeError:
    """What a refused write into a run directory means for the user, with the fix."""
    where = Path(err.filename) if err.filename else Path(run_dir)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return ZeroPipeError(f"the disk holding {run_dir} is full (writing {where}): free space there, or set run.output_dir to a folder on another disk")
    if err.errno == errno.EROFS:
        return ZeroPipeError(f"{run_dir} is on a read-only file system: set run.output_dir to a writable folder")
    if err.errno in (errno.EACCES, errno.EPERM):
        return ZeroPipeError(f"no permission to write {where}: set run.output_dir to a folder you can write to")
    return ZeroPipeError(f"cannot write the run directory {run_dir} ({err.strerror or err} at {where}): set run.output_dir to a writable folder")


def lock_within(fd: int, seconds: float) -> bool:
    """Take an exclusive flock on ``fd``, trying for up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


@dataclass
class RunPlan:
    """What the launcher decided before starting the ranks; read by every rank."""

    world_size: int
    accelerator: str  # "cuda" or "cpu"
    total_steps: int
    steps_per_epoch: int
    micro_batches_per_epoch: int
    examples: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    zero_stage: int
    resume_from: str | None = None  # checkpoint tag
    resume_universal: bool = False  # read resume_from from its universal copy (checkpoints/universal): saved by another rank count
    resume_data_position: dict | None = None  # DataPosition where the resumed run continues in its data, for all ranks together
    generate_prompts: list[str] = field(default_factory=list)
    created_at: float = 0.0
    # "module:function" that one process per node runs, to the end, before the node's ranks start
    # (a diffusion run fills its caches there); called with (RunDir, torch device, encoder dtype).
    node_setup: str | None = None
    # What the device computes in natively (precision "auto" on it) and why, as the launcher's
    # resolved run decided it: the node's setup process loads frozen encoders in it, without
    # asking the hardware again.
    native_precision: str = "fp32"
    native_precision_why: str = ""


@dataclass
class PreparedData:
    """What a family's data preparation hands to the launcher (the ranks read the files it wrote)."""

    examples: int
    hidden_size: int | None  # for DeepSpeed's bucket sizes
    micro_batches_per_epoch: Callable[[int, int], int]  # (micro_batch_size, world_size) -> per rank
    prompts: list[str] = field(default_factory=list)  # generated (or drawn) at the end of the run
    notes: list[str] = field(default_factory=list)
    batching_note: str = ""  # why examples may not fill a step, said when they do not (e.g. one bucket per micro-batch)
    # Work done once per node, in its own process, before the ranks start ("module:function", see RunPlan.node_setup).
    node_setup: str | None = None


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    config = property(lambda self: self.path / "config.yaml")
    ds_config = property(lambda self: self.path / "ds_config.json")
    plan_file = property(lambda self: self.path / "run.json")
    status_file = property(lambda self: self.path / "status.json")
    tokenizer = property(lambda self: self.path / "tokenizer")
    data = property(lambda self: self.path / "data")
    cache = property(lambda self: self.path / "cache")
    eval_cache = property(lambda self: self.path / "cache" / "eval")  # held-out data, tokenized like the training cache
    logs = property(lambda self: self.path / "logs")
    errors = property(lambda self: self.path / "errors")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    summary = property(lambda self: self.path / "summary.json")
    generations = property(lambda self: self.path / "generations.jsonl")
    checkpoints = property(lambda self: self.path / "checkpoints")
    processor = property(lambda self: self.path / "processor")  # vision-language runs: the processor the ranks use
    pipeline = property(lambda self: self.path / "pipeline")  # diffusion runs from an inline preset: the built pipeline
    samples = property(lambda self: self.path / "samples")  # diffusion sample images, with index.jsonl
    samples_index = property(lambda self: self.path / "samples" / "index.jsonl")
    owner_lock = property(lambda self: self.path / OWNER_LOCK)

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def rank_error(self, rank: int) -> Path:
        return self.errors / f"rank{rank}.json"

    # The node's setup process (RunPlan.node_setup): one per node, before its ranks start.
    node_setup_log = property(lambda self: self.logs / "node_setup.log")
    node_setup_error = property(lambda self: self.errors / "node_setup.json")

    def read_config(self) -> "RunConfig":
        """The config the run was prepared with (config.yaml), without checking that its data paths still exist."""

        return load_saved_config(self.config)

    def read_plan(self) -> RunPlan:
        return RunPlan(**json.loads(self.plan_file.read_text()))

    def write_plan(self, plan: RunPlan) -> None:
        write_atomic(self.plan_file, json.dumps(asdict(plan), indent=2))

    def read_json(self, path: Path, default: Any = None) -> Any:
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return default

    # ------------------------------------------------------------- ownership
    def claim(self) -> None:
        """Own this run directory until the process exits (creating it if needed).

        Raises:
            RunDirBusy: another live process owns it; the message names its pid.
        """
        key = str(self.path.resolve())
        if key in _held:
            return
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.owner_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise disk_problem(err, self.path) from None
        if not lock_within(fd, CLAIM_WAIT_SECONDS):
            os.close(fd)
            pid = self.owner_pid()
            who = f"launcher pid {pid}" if pid else "another launcher"
            raise RunDirBusy(
                f"{self.path} is in use by a live run ({who}): wait for it to end or stop it "
                f"(zeropipe runs stop {self.path.name}, or kill -TERM {pid or 'PID'}), or choose another run.name; nothing was changed"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _held[key] = fd

    def release(self) -> None:
        """Give up ownership before the process ends (the kernel does it at exit anyway)."""
        fd = _held.pop(str(self.path.resolve()), None)
        if fd is not None:
            os.close(fd)

    def owned_here(self) -> bool:
        return str(self.path.resolve()) in _held

    def owner_pid(self) -> int | None:
        """The pid of the live process that owns the run directory, or None when nobody does."""
        if self.owned_here():
            return os.getpid()
        try:
            fd = os.open(self.owner_lock, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            try:
                # A shared lock is granted only when no exclusive owner holds the file.
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 32, 0).decode(errors="replace").strip()
                return int(text) if text.isdigit() else -1
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def require_owner(self) -> None:
        """Raise unless this process owns the run directory: writers call it before writing.

        Raises:
            RunDirBusy: another process owns it, or nobody does.
        """
        if not self.owned_here():
            pid = self.owner_pid()
            holder = f"it is owned by pid {pid}" if pid else "no launcher owns it"
            raise RunDirBusy(f"{self.path}: this process may not write into the run directory ({holder})")

    def read_status(self) -> dict[str, Any]:
        """status.json, with a ``running`` run whose launcher is gone (its lock free) reported as lost.

        The lost state is also written back, so every later reader agrees; nothing is written
        while a launcher owns the directory.
        """
        status = self.read_json(self.status_file, {}) or {}
        if status.get("state") not in ("running", "starting") or self.owner_pid() is not None or not self.owner_lock.exists():
            return status
        pid = status.get("supervisor_pid")
        lost = {
            "state": "lost",
            "ended_at": status.get("ended_at") or time.time(),
            "diagnosis": {
                "text": (
                    f"the launcher{f' (pid {pid})' if pid else ''} ended without recording how the run ended "
                    "(killed with SIGKILL, or the machine restarted); its ranks stopped with it. "
                    "Resume from the last complete checkpoint with --resume"
                ),
                "cause": "the launcher process disappeared",
                "fix": "resume from the last complete checkpoint with --resume",
            },
        }
        status.update(lost)
        try:
            self.claim()
        except RunDirBusy:
            return self.read_json(self.status_file, {}) or {}  # a launcher took it meanwhile
        except ZeroPipeError:
            return status  # a read-only disk: the reader still gets the right state
        try:
            current = self.read_json(self.status_file, {}) or {}
            if current.get("state") in ("running", "starting"):
                self.write_status(**lost)
        except OSError:
            pass  # a read-only or full disk: the reader still gets the right state
        finally:
            self.release()
        return status

    def write_status(self, **fields: Any) -> None:
        """Merge ``fields`` into status.json.

        Raises:
            OSError: the disk refused even the in-place fallback (the caller says so).
        """
        status = self.read_json(self.status_file, {}) or {}
        status.update(fields)
        text = json.dumps(status, indent=2)
        try:
            write_atomic(self.status_file, text)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT) or not self.status_file.is_file():
                raise
            self.rewrite_status_in_place(status)

    def rewrite_status_in_place(self, status: dict[str, Any]) -> None:
        """A full disk: no new file can be written, but status.json's own first block can be.

        The status is slimmed (no log tail) to fit the block the file already has, so the run
        never stays "running" for want of a few bytes.
        """
        room = max(4096, -(-self.status_file.stat().st_size // 4096) * 4096)
        slim = dict(status)
        diagnosis = status.get("diagnosis")
        if isinstance(diagnosis, dict):
            text = str(diagnosis.get("text", "")).split("\nlast lines of", 1)[0]
            slim["diagnosis"] = {key: diagnosis[key] for key in ("rank", "how", "cause", "fix") if key in diagnosis} | {"text": text}
        for key in ("rank_rss_peak_bytes", "pids"):
            encoded = json.dumps(slim, separators=(",", ":")).encode()
            if len(encoded) <= room:
                break
            slim.pop(key, None)
        encoded = json.dumps(slim, separators=(",", ":")).encode()
        if len(encoded) > room and isinstance(slim.get("diagnosis"), dict):
            slim["diagnosis"] = {"text": slim["diagnosis"]["text"][: room // 2]}
            encoded = json.dumps(slim, separators=(",", ":")).encode()
        with open(self.status_file, "r+b") as handle:
            handle.write(encoded)
            handle.truncate()

    def read_metrics(self) -> list[dict[str, Any]]:
        rows = []
        if self.metrics.is_file():
            for line in self.metrics.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line being written right now
        return rows
