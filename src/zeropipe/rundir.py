"""The layout of a run directory: one place that names every file a run writes, and the typed hand-overs.

The launcher writes ``config.yaml`` (the validated config with its resolved values),
``ds_config.json`` and ``run.json`` (:class:`RunPlan`); each family's preparation writes its
data under ``data/`` and, for diffusion, ``pipeline/``; the ranks write ``logs/``,
``errors/``, ``metrics.jsonl``, ``checkpoints/``, ``samples/``, ``generations.jsonl`` and
``summary.json``. Every reader of a run (ranks, the supervisor, node agents, curricula,
export, eval, generate, the metric sinks, the run store and the UI) goes through
:class:`RunDir`: no other module parses ``run.json`` or ``config.yaml`` (a unit test holds
that). It reads the saved config without re-checking that the original data paths still
exist (:meth:`RunDir.read_config`).

The UI reads run directories on behalf of whoever can reach it, so it reads them *confined*
(``RunDir(path, confined_to=runs_root)``): the run directory must lie inside the runs root
and every file read must resolve inside the run directory, so a symlink (or ``..``) leading
elsewhere is refused with :class:`OutsideRoots`, naming the file and never its contents.

A run directory has one owner at a time: the launcher that holds an exclusive ``flock`` on
``RUN/.owner.lock`` for its whole life. The kernel drops the lock when that process ends,
however it ends (``kill -9`` included), so a ``running`` status whose lock is free belongs
to a launcher that is gone. A second ``zeropipe train`` or ``--resume`` of the same run
directory is refused while the lock is held.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml

from zeropipe.checkpoint.manager import write_atomic
from zeropipe.config.load import load_saved_config
from zeropipe.config.yaml_text import parse_yaml_text

# The test of a path against a folder lives in confine.py (below this layer), with the UI runs' Confinement.
from zeropipe.confine import Confinement, OutsideRoots, confine_process, confined, is_inside, resolve_inside
from zeropipe.errors import ZeroPipeError

if TYPE_CHECKING:
    from zeropipe.config.schema import RunConfig

OWNER_LOCK = ".owner.lock"
# A reader marking a lost run holds the lock for a few milliseconds: a launcher waits that out.
CLAIM_WAIT_SECONDS = 1.0

# Lock files held by this process, by resolved run directory: open for the life of the process.
_held: dict[str, int] = {}


def _forget_held_in_child() -> None:
    """A forked child (a rank forked from its launcher, a data-loader worker) owns no run directory.

    Its copies of the lock files' descriptors are closed: the flock belongs to the open file, so
    the launcher keeps it, and a child outliving a launcher killed with SIGKILL (a rank's own
    data-loader worker) must not keep the run looking owned. Never unlocked here: that would
    release the launcher's lock too.
    """
    for fd in _held.values():
        with contextlib.suppress(OSError):  # already closed: nothing of the launcher's is left here
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_held_in_child)


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
    # A run submitted through the UI: the folders it may read and write (Confinement.to_json()), so
    # that the ranks, the node's setup process, export, eval and generate skip or refuse a data
    # file that resolves outside them. None: a command-line run, on the user's own files.
    confined_to: dict | None = None
    # The plug-in modules the run was prepared with ({"module": name, "path": the folder it was imported
    # from}): a later command on the run (a rank, export, a resume) imports them itself, without ZEROPIPE_PLUGINS.
    plugins: list[dict] = field(default_factory=list)
    # model.lora.init_from: the adapter the run's LoRA starts from ({"path", "sha256", "layout", "modules", "rank"}); None: peft's initialisation.
    adapter_init: dict | None = None


# The plug-in modules this process imported (ZEROPIPE_PLUGINS, or a run's run.json), by name: the folder on
# sys.path each came from. prepare_run records them in the run it prepares.
_PLUGINS: dict[str, str | None] = {}


def note_plugin(name: str) -> None:
    """Remember an imported plug-in module and the sys.path folder it came from (its top-level package's parent)."""
    import sys

    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    folder = None
    if file:
        path = Path(file).resolve()
        top = path.parent if path.name == "__init__.py" else path
        folder = str(top.parents[name.count(".")])
    _PLUGINS[name] = folder


def plugins_in_use() -> list[dict]:
    """The plug-in modules this process imported, as run.json records them."""
    return [{"module": name, "path": folder} for name, folder in _PLUGINS.items()]


def import_plugins(entries: list[dict]) -> None:
    """Import a run's plug-in modules (run.json's ``plugins``) that this process has not: from their own folder when not on sys.path.

    Raises:
        ZeroPipeError: a module that cannot be imported, named with the error and the fix.
    """
    import importlib
    import sys

    for entry in entries:
        name, folder = entry.get("module"), entry.get("path")
        if not isinstance(name, str) or name in _PLUGINS:
            continue
        if name not in sys.modules and isinstance(folder, str) and folder not in sys.path and Path(folder).is_dir():
            sys.path.append(folder)
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - whatever a plug-in raises, the user needs its name
            raise ZeroPipeError(
                f"this run was prepared with the plug-in module {name!r} (from {folder}), which cannot be imported "
                f"({type(err).__name__}: {err}): put it back there, or name where it is now in ZEROPIPE_PLUGINS and PYTHONPATH"
            ) from None
        note_plugin(name)


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
    """A run directory: the name of every file in it, and the one reader of those files.

    Args:
        path: the run directory.
        confined_to: read confined (the UI and the run store): the run directory must resolve
            inside this folder, and every file read through this object must resolve inside
            the run directory; otherwise the read is refused (:class:`OutsideRoots`) or, for
            the lenient readers, reads as a missing file. ``confined_to=path`` confines the
            files to the run directory alone.
    """

    def __init__(self, path: str | Path, confined_to: str | Path | None = None):
        self.path = Path(path)
        self.confined_to = Path(confined_to) if confined_to is not None else None
        self._data_confinement: tuple[Confinement | None] | None = None  # read from run.json once, or set by the launcher

    @property
    def data_confinement(self) -> Confinement | None:
        """The folders this run may read and write (a run submitted through the UI), as run.json records them; None for a command-line run.

        Every reader of the run's data files (its preparation, the node's setup process, the
        ranks, export, eval, generate) tests each file against it when it uses the file.
        """
        if self._data_confinement is None:
            self._data_confinement = (Confinement.from_json(self.read_plan_fields().get("confined_to")),)
        return self._data_confinement[0]

    def use_checkpoint(self, checkpoint: Path) -> Path:
        """A checkpoint folder of this run, as export, eval and generate take it.

        For a run submitted through the UI (run.json's ``confined_to``) the run's confinement
        becomes this process's (its data readers skip files leading out of the run's folders),
        and a checkpoint folder that resolves outside the run directory (a symlink to elsewhere)
        is refused; a command-line run's checkpoint is used as it is.

        Raises:
            OutsideRoots: naming the folder, never what it holds.
        """
        confinement = self.data_confinement
        confine_process(confinement)
        if confinement is not None and confined(checkpoint, self.path) is None:
            raise OutsideRoots(f"{checkpoint} leads outside the run directory {self.path} (a symlink to elsewhere): it is not used")
        return checkpoint

    def confine_data(self, confinement: Confinement | None) -> None:
        """The launcher's resolved run's confinement, before run.json is written (the data preparation reads it)."""
        self._data_confinement = (confinement,)

    config = property(lambda self: self.path / "config.yaml")
    ds_config = property(lambda self: self.path / "ds_config.json")
    plan_file = property(lambda self: self.path / "run.json")
    # What the data preparation learned (dotted key -> value: the tokenizer's vocabulary size, a
    # Wan 2.2 expert's noise range), kept beside config.yaml instead of edited into it: config.yaml
    # is the config as resolved and checked, and the two together are what ran.
    learned_file = property(lambda self: self.path / "learned.json")
    status_file = property(lambda self: self.path / "status.json")
    # What a starting run is doing before its first step (building the pipeline, caching 40 of
    # 240): written by the launcher and the node's setup process, shown by the UI. Its own file:
    # the setup process writing status.json while the launcher does would lose fields.
    progress_file = property(lambda self: self.path / "progress.json")
    tokenizer = property(lambda self: self.path / "tokenizer")
    data = property(lambda self: self.path / "data")
    cache = property(lambda self: self.path / "cache")
    eval_cache = property(lambda self: self.path / "cache" / "eval")  # held-out data, tokenized like the training cache
    logs = property(lambda self: self.path / "logs")
    errors = property(lambda self: self.path / "errors")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    summary = property(lambda self: self.path / "summary.json")
    generations = property(lambda self: self.path / "generations.jsonl")
    completions = property(lambda self: self.path / "completions.jsonl")  # GRPO: completions sampled in the loop, with their rewards
    checkpoints = property(lambda self: self.path / "checkpoints")
    processor = property(lambda self: self.path / "processor")  # vision-language runs: the processor the ranks use
    pipeline = property(lambda self: self.path / "pipeline")  # diffusion runs from an inline preset: the built pipeline
    samples = property(lambda self: self.path / "samples")  # diffusion sample images, with index.jsonl
    samples_index = property(lambda self: self.path / "samples" / "index.jsonl")
    # "Sample now" from the UI: the request the ranks answer at their next step boundary (engine/trainer.py).
    sample_request = property(lambda self: self.path / "sample_request.json")
    owner_lock = property(lambda self: self.path / OWNER_LOCK)

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def rank_error(self, rank: int) -> Path:
        return self.errors / f"rank{rank}.json"

    # The node's setup process (RunPlan.node_setup): one per node, before its ranks start.
    node_setup_log = property(lambda self: self.logs / "node_setup.log")
    node_setup_error = property(lambda self: self.errors / "node_setup.json")

    stages_file = property(lambda self: self.path / "stages.json")  # curricula: each stage's state and step offset

    # ------------------------------------------------------------- confinement
    def own(self, name: str | Path) -> Path:
        """A path of this run directory (relative to it, or one of its named files), for reading.

        Unconfined, the path as named. Confined, resolved, and refused when it leads outside the run.

        Raises:
            OutsideRoots: confined, and the run directory lies outside its root, or the path
                leads out of the run directory (``..``, an absolute path, a symlink to elsewhere).
        """
        relative = self.relative(name)
        if self.confined_to is None:
            return self.path / relative
        if not is_inside(self.path, self.confined_to):
            raise OutsideRoots(f"{self.path} is not a run directory inside {self.confined_to} (a symlink to elsewhere?): nothing in it is read")
        try:
            return resolve_inside(self.path, relative)
        except OutsideRoots:
            raise OutsideRoots(
                f"{self.path / relative} leads outside the run directory {self.path} (a symlink or '..' to elsewhere): it is not read"
            ) from None

    def own_or_none(self, name: str | Path) -> Path | None:
        """:meth:`own`, or None where it is refused."""
        try:
            return self.own(name)
        except OutsideRoots:
            return None

    def relative(self, name: str | Path) -> Path:
        """``name`` relative to the run directory: a name such as ``"logs/rank0.log"``, or a path under it such as ``self.plan_file``.

        Raises:
            OutsideRoots: confined, and ``name`` is an absolute path elsewhere.
        """
        name = Path(name)
        if name.parts[: len(self.path.parts)] == self.path.parts:
            return name.relative_to(self.path)
        if name.is_absolute() and self.confined_to is not None:
            raise OutsideRoots(f"{name} is not a file of the run directory {self.path}: it is not read")
        return name

    def read_text(self, name: str | Path, last_bytes: int | None = None) -> str | None:
        """A file of the run as text (undecodable bytes replaced), or None when it does not exist.

        ``last_bytes``: only the file's end, from the first line that starts in its last ``last_bytes``.

        Raises:
            OutsideRoots: confined, and the file leads out of the run directory.
        """
        path = self.own(name)
        # O_NONBLOCK: a FIFO planted under a file's name opens at once (and is then no file), instead of hanging the reader.
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
        if self.confined_to is not None:
            flags |= os.O_NOFOLLOW  # the path is already resolved: a symlink put there since is refused
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return None
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise OutsideRoots(f"{self.path / self.relative(name)} became a symlink while it was read: it is not read") from None
            if err.errno == errno.ENOTDIR:
                return None
            raise
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                return None  # a folder or a device under a file's name
            size = os.fstat(handle.fileno()).st_size
            if last_bytes is not None and size > last_bytes:
                handle.seek(size - last_bytes - 1)
                chunk = handle.read()
                return chunk[chunk.find(b"\n") + 1 :].decode("utf-8", errors="replace")  # from the first whole line on
            return handle.read().decode("utf-8", errors="replace")

    # ------------------------------------------------------------- readers
    def read_config(self) -> "RunConfig":
        """The config the run was prepared with (config.yaml), without checking that its data paths still exist.

        Raises:
            ConfigError: missing, or edited into something the schema refuses.
            OutsideRoots: confined, and config.yaml leads out of the run directory.
        """
        learned = self.read_json(self.learned_file) or {}
        config = load_saved_config(self.own(self.config), learned.get("values") if isinstance(learned, dict) else None)
        if self.confined_to is None:
            # A run's family or entry may come from a plug-in: the run names it (run.json), no environment variable needed.
            # Never for a confined reader (the UI, the run store): a run.json there must not choose code to import.
            import_plugins(self.read_plan_fields().get("plugins") or [])
        return config

    def read_config_text(self) -> str | None:
        """config.yaml as the launcher wrote it (comments and all), or None before it is written.

        Raises:
            OutsideRoots: confined, and config.yaml leads out of the run directory.
        """
        return self.read_text(self.config)

    def read_config_fields(self) -> dict[str, Any]:
        """config.yaml's sections as plain values (no schema), ``{}`` before it is written.

        For readers that take the config as data (the UI's resume, the metric sinks' run
        config): parsed with the UI's guards against YAML nested or aliased to exhaust the parser.

        Raises:
            ConfigError: not YAML, or not a mapping of sections.
            OutsideRoots: confined, and config.yaml leads out of the run directory.
        """
        text = self.read_config_text()
        return parse_yaml_text(text, source=str(self.config)) if text is not None else {}

    def write_config_fields(self, fields: dict[str, Any]) -> None:
        """Replace config.yaml with ``fields`` (the UI's rename changes run.name there)."""
        write_atomic(self.config, yaml.safe_dump(fields, sort_keys=False))

    def read_plan(self) -> RunPlan:
        """run.json, typed: what the launcher decided (every rank reads it).

        Raises:
            OSError, ValueError, TypeError: missing, not JSON, or not a RunPlan.
            OutsideRoots: confined, and run.json leads out of the run directory.
        """
        text = self.read_text(self.plan_file)
        if text is None:
            raise FileNotFoundError(errno.ENOENT, "the run has no run.json (not prepared yet)", str(self.plan_file))
        return RunPlan(**json.loads(text))

    def read_plan_fields(self) -> dict[str, Any]:
        """run.json as plain values, ``{}`` when it is missing, unreadable or (confined) leads out.

        For readers that want a few of its values and must not fail on an older or partial file.
        """
        value = self.read_json(self.plan_file, {})
        return value if isinstance(value, dict) else {}

    def write_plan(self, plan: RunPlan) -> None:
        write_atomic(self.plan_file, json.dumps(asdict(plan), indent=2))

    def read_summary(self) -> dict[str, Any]:
        """summary.json (first and final loss, steps), ``{}`` before the run ends."""
        value = self.read_json(self.summary, {})
        return value if isinstance(value, dict) else {}

    def read_ds_config(self) -> dict[str, Any]:
        """ds_config.json, the DeepSpeed config the launcher wrote.

        Raises:
            OSError, ValueError: missing or not JSON.
        """
        text = self.read_text(self.ds_config)
        if text is None:
            raise FileNotFoundError(errno.ENOENT, "the run has no ds_config.json (not prepared yet)", str(self.ds_config))
        return json.loads(text)

    def read_stages(self) -> dict[str, Any]:
        """stages.json, a curriculum's record of its stages.

        Raises:
            OSError, ValueError: missing or not JSON.
        """
        text = self.read_text(self.stages_file)
        if text is None:
            raise FileNotFoundError(errno.ENOENT, "the run has no stages.json (not a curriculum)", str(self.stages_file))
        return json.loads(text)

    def read_json(self, path: Path | str, default: Any = None) -> Any:
        """A JSON file of the run, or ``default`` when it is missing, not JSON or (confined) leads out."""
        try:
            text = self.read_text(path)
        except (OSError, OutsideRoots):
            return default
        if text is None:
            return default
        try:
            return json.loads(text)
        except ValueError:
            return default

    def holds_run(self) -> bool:
        """Whether a launcher has written here (status.json or run.json)."""
        return self.status_file.is_file() or self.plan_file.is_file()

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
            # O_NOFOLLOW: the lock is truncated and written; a symlink planted in its place (the UI
            # marks lost runs through here) must not lead that write to a file elsewhere.
            fd = os.open(self.owner_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
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
            fd = os.open(self.owner_lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
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

    def read_status_fields(self) -> dict[str, Any]:
        """status.json as the launcher last wrote it, ``{}`` when missing, unreadable or (confined) leading out."""
        value = self.read_json(self.status_file, {})
        return value if isinstance(value, dict) else {}

    def read_status(self) -> dict[str, Any]:
        """status.json, with a ``running`` run whose launcher is gone (its lock free) reported as lost.

        The lost state is also written back, so every later reader agrees; nothing is written
        while a launcher owns the directory.
        """
        status = self.read_status_fields()
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

    def write_progress(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        """Say what the run is doing now (``phase``, with ``done`` of ``total`` when counted); never fails the run."""
        record = {"phase": phase, "done": done, "total": total, "at": time.time(), "pid": os.getpid()}
        try:
            write_atomic(self.progress_file, json.dumps(record))
        except OSError:
            pass  # a full disk shows no progress; the run goes on and says so where it matters

    def read_progress(self) -> dict[str, Any]:
        """progress.json, ``{}`` when missing or unreadable."""
        value = self.read_json(self.progress_file, {})
        return value if isinstance(value, dict) else {}

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
        return self.read_jsonl(self.metrics)

    def read_metrics_from(self, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
        """The metric rows written after byte ``offset``, whole lines only (rank 0 may be writing the next), and the offset after them.

        For followers of a live run (the CLI's progress bar, a curriculum's mirror of its stage).
        """
        try:
            with open(self.own(self.metrics), "rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
        except (FileNotFoundError, NotADirectoryError):
            return [], offset
        complete = chunk[: chunk.rfind(b"\n") + 1]
        return json_rows(complete.decode("utf-8", errors="replace")), offset + len(complete)

    def read_generations(self) -> list[dict[str, Any]]:
        """generations.jsonl: the trained model's answers to the run's prompts (prompt, output...)."""
        return self.read_jsonl(self.generations)

    def read_completions(self, last_bytes: int = 256 * 1024) -> list[dict[str, Any]]:
        """A GRPO run's sampled completions (completions.jsonl: step, prompt, completion, rewards, advantage), its last rows only.

        Untrusted text (what the model wrote): served as JSON strings, shown as text, never as markup.
        """
        try:
            rows = json_rows(self.read_text(self.completions, last_bytes=last_bytes) or "")
        except (OSError, OutsideRoots):
            return []
        keep = ("step", "prompt", "completion", "rewards", "advantage")
        return [{key: row.get(key) for key in keep} for row in rows]

    def read_jsonl(self, name: str | Path) -> list[dict[str, Any]]:
        """The records of a JSON-lines file of the run; ``[]`` when it is missing or (confined) leads out."""
        try:
            return json_rows(self.read_text(name) or "")
        except (OSError, OutsideRoots):
            return []


def json_rows(text: str) -> list[dict[str, Any]]:
    """The JSON objects of JSON-lines text; a line that is not one (being written right now) is skipped."""
    rows = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            rows.append(value)
    return rows
