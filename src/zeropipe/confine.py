"""Confinement: the folders a run submitted through the UI may read and write, and the test of a path against them.

``zeropipe ui`` acts for whoever can reach it, so a config it launches may only touch the UI's
runs and data folders (``Confinement.roots``). The UI checks a submitted config against them
(``store.sandbox``), hands them to the launcher (``zeropipe train --confine-to DIR``), the
launcher's resolved run applies them to every path the run names, the user's DeepSpeed JSON
included (``launch.resolve``: :meth:`Confinement.run_problems`), and saves them in ``run.json``
(``RunPlan.confined_to``), where every later reader of the run (the ranks, the node's setup
process, export, eval, generate) finds them. Each reader of a data file tests the file when it
uses it (:meth:`Confinement.allows`, after resolving symlinks): a file inside a data folder that
is a symlink to ``/etc/shadow`` is skipped and counted, never read.

A run started from the command line has no confinement (``None`` everywhere): the user runs on
their own files. Paths are compared after resolving symlinks and ``..``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeropipe.errors import ConfigError, ZeroPipeError


class OutsideRoots(ZeroPipeError):
    """A path that resolves outside the folder it must stay in (traversal, absolute path or symlink)."""


class ConfinementError(ConfigError):
    """A confined run (submitted through the UI) names a path outside its roots, or a field it may not set; each problem names its key."""


def is_inside(path: Path, root: Path) -> bool:
    try:
        Path(path).resolve().relative_to(Path(root).resolve())
        return True
    except (ValueError, OSError, RuntimeError):
        return False


def resolve_inside(root: Path, relative: str | Path) -> Path:
    """``root / relative``, refused when it resolves outside ``root``.

    Raises:
        OutsideRoots: for absolute paths, ``..`` that climbs out, or a symlink that leads out.
    """
    text = str(relative)
    if not text or "\x00" in text:
        raise OutsideRoots("an empty or malformed path was given")
    candidate = Path(text)
    if candidate.is_absolute():
        raise OutsideRoots(f"{text}: an absolute path is not allowed here; give a path inside the run")
    resolved = (Path(root) / candidate).resolve()
    if not is_inside(resolved, root):
        raise OutsideRoots(f"{text}: leads outside {root}; nothing outside the run and data folders is served")
    return resolved


def confined(path: Path, root: Path) -> Path | None:
    """``path`` resolved, or None when it resolves outside ``root`` (a symlink leading out)."""
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    return resolved if is_inside(resolved, root) else None


# ------------------------------------------------------------------ which keys of a config are paths
# Typed config fields that name a file or folder (list items as [*]); the same inside every
# curriculum stage. The launcher reads them; data.cache.dir and run.output_dir are written to.
PATH_FIELDS = {
    "model.path", "model.tokenizer", "model.processor", "model.diffusion.denoiser_file", "model.lora.init_from",
    "data.path", "data.eval_path", "data.control_path", "data.control_paths[*]", "data.cache.dir", "data.vision.image_root", "data.mixture[*].path",
    "generate.images[*]", "deepspeed.config_file", "hardware.hostfile",
    "grpo.rewards[*].path",
}  # fmt: skip
# Free-form mappings handed on to other libraries (transformers' from_pretrained, DeepSpeed's
# JSON): any key there may name a path, e.g. csv_monitor.output_path or load_kwargs.cache_dir.
FREE_FORM = {"model.config", "model.load_kwargs", "deepspeed.overrides"}
PATH_LIKE_KEY = re.compile(r"(path|dir|directory|file|filename|folder|root|output|storage)s?$", re.IGNORECASE)
REMOTE_CODE_KEY = "trust_remote_code"
# The fields that choose where and how commands run: which machines are started over ssh/srun,
# with which ssh arguments, and which address every rank connects to. A UI refuses them unless
# started with --trust-multinode.
MULTINODE_FIELDS = ("hardware.nodes", "hardware.hostfile", "hardware.ssh_options", "hardware.ssh_port", "hardware.launcher", "hardware.master_addr")


@dataclass
class FoundPath:
    key: str  # dotted, as problems name it: stages[1].data.mixture[0].path
    holder: dict | list
    slot: str | int
    typed: bool | None  # True: a typed path field; False: a path-like value in a free-form mapping; None: trust_remote_code

    @property
    def value(self) -> Any:
        return self.holder[self.slot]


def config_paths(raw: dict[str, Any], free_form: bool = False, prefix: str = "") -> list[FoundPath]:
    """Every path a config names, and every trust_remote_code key, walking the whole tree.

    Typed fields are found by name (``PATH_FIELDS``, also inside ``stages[N]``); inside the
    free-form mappings (``FREE_FORM``; the whole tree with ``free_form``, as for a DeepSpeed
    JSON) a string is a path when its key looks like one (output_path, nvme_path, cache_dir...)
    or it is absolute, starts with ``~`` or climbs with ``..``. Callers check the depth first
    (``too_deep``); this walk does not recurse anyway.
    """
    found: list[FoundPath] = []
    # (node, dotted key, pattern with list indices as [*] and the stage prefix dropped, inside free-form, its key)
    stack: list[tuple[Any, str, str, bool, str]] = [(raw, prefix, "", free_form, "")]
    while stack:
        node, key, pattern, free, name = stack.pop()
        if isinstance(node, dict):
            for child_name, child in node.items():
                child_name = str(child_name)
                child_key = f"{key}.{child_name}" if key and not key.endswith(":") else f"{key}{child_name}"  # prefix "FILE:" names a file's keys
                child_pattern = f"{pattern}.{child_name}" if pattern else child_name
                if child_name == REMOTE_CODE_KEY:
                    found.append(FoundPath(child_key, node, child_name, None))
                    continue
                if pattern == "stages[*]":
                    child_pattern = child_name  # a stage's sections are the top level's
                if isinstance(child, str):
                    if is_path(child_pattern, child_name, child, free):
                        found.append(FoundPath(child_key, node, child_name, child_pattern in PATH_FIELDS))
                else:
                    stack.append((child, child_key, child_pattern, free or child_pattern in FREE_FORM, child_name))
        elif isinstance(node, list):
            for index, child in enumerate(node):
                child_key, child_pattern = f"{key}[{index}]", f"{pattern}[*]"
                if isinstance(child, str):
                    if is_path(child_pattern, name, child, free):
                        found.append(FoundPath(child_key, node, index, child_pattern in PATH_FIELDS))
                else:
                    stack.append((child, child_key, child_pattern, free, name))
    found.sort(key=lambda f: f.key)
    return found


def is_path(pattern: str, name: str, value: str, free: bool) -> bool:
    if not value:
        return False
    if pattern in PATH_FIELDS:
        return True
    if not free:
        return False
    return bool(PATH_LIKE_KEY.search(name)) or value.startswith(("/", "~", "\\")) or ".." in re.split(r"[/\\]", value)


def multinode_problems(raw: dict[str, Any]) -> list[tuple[str, str]]:
    """The fields of ``raw`` that choose where and how commands run, each refused (for a UI without --trust-multinode)."""
    hardware = raw.get("hardware") if isinstance(raw, dict) else None
    if not isinstance(hardware, dict):
        return []
    problems = []
    for key in MULTINODE_FIELDS:
        name = key.split(".", 1)[1]
        value = hardware.get(name)
        if value in (None, "", [], "auto"):
            continue
        problems.append((key, (f"{name} chooses which machines this server starts commands on, and how (ssh, srun): the UI refuses it "
                               "unless started with `zeropipe ui --trust-multinode`; or run this config with `zeropipe train`")))  # fmt: skip
    return problems


# ------------------------------------------------------------------ the confinement of one run
@dataclass(frozen=True)
class Confinement:
    """The folders a UI-submitted run may read and write; None (no confinement) for a command-line run.

    Args:
        roots: the UI's runs and data folders, absolute and resolved.
        multinode: the UI was started with --trust-multinode: a config may name other machines
            (hardware.nodes, hostfile, ssh options from the allow-list).
    """

    roots: tuple[Path, ...]
    multinode: bool = False
    base: Path = field(default_factory=Path.cwd)  # relative paths are relative to this (the launcher's working directory)

    def __post_init__(self):
        object.__setattr__(self, "roots", tuple(Path(root).expanduser().resolve() for root in self.roots))
        object.__setattr__(self, "base", Path(self.base).resolve())

    def absolute(self, path: str | Path) -> Path:
        """``path`` made absolute (relative to ``base``) and resolved, symlinks followed.

        Raises:
            OutsideRoots: a NUL character in it (no file is named that way).
        """
        if "\x00" in str(path):
            raise OutsideRoots(f"{str(path)!r} contains a NUL character: no file is named that way")
        path = Path(path).expanduser()
        return (path if path.is_absolute() else self.base / path).resolve()

    def allows(self, path: str | Path) -> bool:
        """Whether ``path`` resolves (symlinks followed, now) inside one of the roots."""
        try:
            resolved = self.absolute(path)
        except (OutsideRoots, OSError, RuntimeError, ValueError):
            return False
        return any(is_inside(resolved, root) for root in self.roots)

    def require(self, path: str | Path, what: str) -> Path:
        """``path`` resolved, refused when it leads outside the roots.

        Raises:
            OutsideRoots: naming ``what`` and the path, never the file's contents.
        """
        if not self.allows(path):
            raise OutsideRoots(f"{what} {path} resolves outside the folders this run may use ({self.shown()}): it is not read")
        return self.absolute(path)

    def shown(self) -> str:
        return ", ".join(str(root) for root in self.roots)

    def path_problems(self, found: Iterable[FoundPath]) -> list[tuple[str, str]]:
        problems = []
        for item in found:
            if item.typed is None or not isinstance(item.value, str):
                continue
            if not self.allows(item.value):
                problems.append((item.key, (f"{item.value} is outside the folders this UI may read and write ({self.shown()}): "
                                            "use a path inside them, or start zeropipe ui with --data-dir naming its folder")))  # fmt: skip
        return problems

    def run_problems(self, config: dict[str, Any], user_ds_config: dict[str, Any] | None = None) -> list[tuple[str, str]]:
        """Every path of a resolved run outside the roots, and (without ``multinode``) every field choosing other machines.

        Args:
            config: the run's config as plain values (``RunConfig.model_dump()``).
            user_ds_config: deepspeed.config_file as read: every path-like key inside it
                (csv_monitor/tensorboard output_path, offload nvme_path, ...) is a path the run writes.
        """
        problems = [] if self.multinode else multinode_problems(config)
        output_dir = (config.get("run") or {}).get("output_dir")
        if isinstance(output_dir, str) and not self.allows(output_dir):
            problems.append(("run.output_dir", f"{output_dir} is outside the folders this UI may write ({self.shown()}): remove the key"))
        problems += self.path_problems(config_paths(config))
        if user_ds_config is not None:
            problems += self.path_problems(config_paths(user_ds_config, free_form=True, prefix="deepspeed.config_file:"))
        return problems

    def to_json(self) -> dict[str, Any]:
        return {"roots": [str(root) for root in self.roots], "multinode": self.multinode}

    @classmethod
    def from_json(cls, value: Any) -> Confinement | None:
        """The confinement saved in run.json (``RunPlan.confined_to``); None for a command-line run."""
        if not isinstance(value, dict) or not isinstance(value.get("roots"), list):
            return None
        return cls(tuple(Path(str(root)) for root in value["roots"]), bool(value.get("multinode")))


# ------------------------------------------------------------------ the confinement the readers apply
# The readers of data files are many and deep (text records, image and video folders, captions,
# metadata files, control images, a VLM's images, single-file denoisers), and each is called from
# several commands. Rather than a parameter through every one of them, the entry point of each
# process that reads a confined run's files sets the run's confinement once, here: the launcher
# around the data preparation (from the resolved run), the node's setup process, every rank,
# export, eval and generate (from run.json), and the UI around its preview and generation (its own
# roots). A reader asks :func:`usable` for each file at the moment it opens it.
_ACTIVE: ContextVar[Confinement | None] = ContextVar("zeropipe_confinement", default=None)


@contextmanager
def confining(confinement: Confinement | None) -> Iterator[Confinement | None]:
    """Readers inside the block skip (or refuse) files that resolve outside ``confinement``'s roots; None: no confinement."""
    token = _ACTIVE.set(confinement)
    try:
        yield confinement
    finally:
        _ACTIVE.reset(token)


def confine_process(confinement: Confinement | None) -> None:
    """For a process's entry point (rank, node setup, export, eval, generate): the run's confinement for the rest of the process."""
    _ACTIVE.set(confinement)


def active() -> Confinement | None:
    return _ACTIVE.get()


def also_allowing(folder: Path) -> Confinement | None:
    """The active confinement with one more root (a scratch folder of the process's own making, such as generated data)."""
    confinement = _ACTIVE.get()
    if confinement is None:
        return None
    return Confinement((*confinement.roots, Path(folder)), confinement.multinode, confinement.base)


def usable(path: str | Path) -> bool:
    """Whether a reader may open ``path`` now: no confinement is active, or it resolves (symlinks followed) inside the roots."""
    confinement = _ACTIVE.get()
    return confinement is None or confinement.allows(path)


def require_usable(path: str | Path, what: str) -> Path:
    """``path``, refused when the active confinement does not allow it (a symlink out of a data folder).

    Raises:
        OutsideRoots: naming ``what`` and the path, never the file's contents.
    """
    confinement = _ACTIVE.get()
    if confinement is not None:
        confinement.require(path, what)
    return Path(path)


OUTSIDE_REASON = "resolves outside the folders this run may read (a symlink to elsewhere?): skipped, not read"
