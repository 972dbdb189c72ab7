"""Which paths the UI may touch: the runs roots (where run directories live) and the data roots.

The server launches processes on behalf of whoever can reach it, so nothing it reads, writes
or hands to ``zeropipe train`` may lie outside these folders. Paths are compared after
resolving symlinks and ``..``, so neither a crafted name nor a symlink inside a root can
lead out of it.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeropipe.config.yaml_text import too_deep

# The confinement of paths inside a folder lives with RunDir, which every reader of a run goes
# through (its files are read nowhere else); the roots here are checked with the same functions.
from zeropipe.rundir import OutsideRoots, confined, is_inside, resolve_inside  # noqa: F401  (the store's names for them)

# A run name becomes a directory name: no separators, no leading dot, nothing a shell would mangle.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
# Folders under a runs root that are not runs.
RESERVED_NAMES = {"configs"}

# Typed config fields that name a file or folder (list items as [*]); the same inside every
# curriculum stage. The launcher reads them, and data.cache.dir is written to.
PATH_FIELDS = {
    "model.path", "model.tokenizer", "model.processor",
    "data.path", "data.eval_path", "data.cache.dir", "data.vision.image_root", "data.mixture[*].path",
    "generate.images[*]", "deepspeed.config_file",
}  # fmt: skip
# Free-form mappings handed on to other libraries (transformers' from_pretrained, DeepSpeed's
# JSON): any key there may name a path, e.g. csv_monitor.output_path or load_kwargs.cache_dir.
FREE_FORM = {"model.config", "model.load_kwargs", "deepspeed.overrides"}
PATH_LIKE_KEY = re.compile(r"(path|dir|directory|file|filename|folder|root|output)s?$", re.IGNORECASE)
REMOTE_CODE_KEY = "trust_remote_code"


@dataclass
class Roots:
    runs: list[Path]
    data: list[Path] = field(default_factory=list)
    base: Path = field(default_factory=Path.cwd)  # relative paths in configs are relative to this

    def __post_init__(self):
        self.base = Path(self.base).resolve()
        self.runs = [self.absolute(p) for p in self.runs]
        self.data = [self.absolute(p) for p in self.data]

    def absolute(self, path: str | Path) -> Path:
        """``path`` made absolute (relative to ``base``) and resolved.

        Raises:
            OutsideRoots: a NUL character in it (no file has one; the OS refuses it).
        """
        if "\x00" in str(path):
            raise OutsideRoots(f"{str(path)!r} contains a NUL character: no file is named that way")
        path = Path(path).expanduser()
        return (path if path.is_absolute() else self.base / path).resolve()

    @property
    def primary_runs(self) -> Path:
        return self.runs[0]

    def readable(self) -> list[Path]:
        return [*self.runs, *self.data]

    def runs_root_of(self, path: Path) -> Path | None:
        return next((root for root in self.runs if is_inside(path, root)), None)


def check_name(name: Any, what: str = "run.name") -> list[tuple[str, str]]:
    if not isinstance(name, str) or not SAFE_NAME.match(name):
        return [(what, f"{name!r} cannot be a folder name: use letters, digits, '.', '_' and '-' (not starting with '.' or '-'), at most 100 characters")]
    if name in RESERVED_NAMES:
        return [(what, f"{name!r} is reserved for the UI's own files: choose another name")]
    return []


def config_path_problems(raw: dict[str, Any], roots: Roots, allow_remote_code: bool = False) -> list[tuple[str, str]]:
    """Problems of a config submitted through the UI, in ConfigError's (key, message) form.

    Every path the config names (typed fields, and path-like values inside model.config,
    model.load_kwargs and deepspeed.overrides, in every stage too) must lie inside the runs or
    data folders; ``trust_remote_code`` is refused unless the server allows remote code.
    """
    problems = too_deep(raw)
    if problems:
        return problems
    run = raw.get("run") if isinstance(raw.get("run"), dict) else {}
    if run.get("name") is None:
        problems.append(("run.name", "missing: name the run (it becomes the folder RUNS/NAME)"))
    else:
        problems += check_name(run.get("name"))
    output_dir = run.get("output_dir")
    if output_dir is not None:
        if not isinstance(output_dir, str) or "\x00" in output_dir or roots.absolute(output_dir) not in roots.runs:
            shown = ", ".join(str(r) for r in roots.runs)
            problems.append(("run.output_dir", f"the UI writes runs into its runs folder ({shown}), not {output_dir!r}: remove the key or set it to that folder"))
    allowed = roots.readable()
    shown = ", ".join(str(r) for r in roots.readable())
    for found in config_paths(raw):
        if found.typed is None:  # a trust_remote_code key
            if not allow_remote_code and found.value not in (False, None):
                problems.append((found.key, "trust_remote_code runs Python code from the model's folder on this machine: the UI refuses it unless "
                                 "started with `zeropipe ui --allow-remote-code`; or run this config with `zeropipe train`"))  # fmt: skip
            continue
        try:
            resolved = roots.absolute(found.value)
        except (OutsideRoots, OSError, RuntimeError, ValueError):
            resolved = None
        if resolved is None or not any(is_inside(resolved, root) for root in allowed):
            problems.append((found.key, f"{found.value} is outside the folders this UI may read and write ({shown}): "
                             "use a path inside them, or start zeropipe ui with --data-dir naming its folder"))  # fmt: skip
    return problems


@dataclass
class FoundPath:
    key: str  # dotted, as problems name it: stages[1].data.mixture[0].path
    holder: dict | list
    slot: str | int
    typed: bool | None  # True: a typed path field; False: a path-like value in a free-form mapping; None: trust_remote_code

    @property
    def value(self) -> Any:
        return self.holder[self.slot]


def config_paths(raw: dict[str, Any]) -> list[FoundPath]:
    """Every path a config names, and every trust_remote_code key, walking the whole tree.

    Typed fields are found by name (``PATH_FIELDS``, also inside ``stages[N]``); inside the
    free-form mappings (``FREE_FORM``) a string is a path when its key looks like one
    (output_path, cache_dir, ...) or it is absolute, starts with ``~`` or climbs with ``..``.
    Callers check the depth first (``too_deep``); this walk does not recurse anyway.
    """
    found: list[FoundPath] = []
    # (node, dotted key, pattern with list indices as [*] and the stage prefix dropped, inside free-form, its key)
    stack: list[tuple[Any, str, str, bool, str]] = [(raw, "", "", False, "")]
    while stack:
        node, key, pattern, free, name = stack.pop()
        if isinstance(node, dict):
            for child_name, child in node.items():
                child_name = str(child_name)
                child_key = f"{key}.{child_name}" if key else child_name
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


def absolutize(raw: dict[str, Any], roots: Roots) -> dict[str, Any]:
    """The same config with every typed path made absolute, so the launcher's working directory does not matter."""
    out = copy.deepcopy(raw)
    run = out.setdefault("run", {})
    if isinstance(run, dict):  # anything else is reported by the validation
        output_dir = run.get("output_dir")
        clean = isinstance(output_dir, str) and output_dir and "\x00" not in output_dir
        run["output_dir"] = str(roots.absolute(output_dir) if clean else roots.primary_runs)
    for found in config_paths(out):
        if found.typed:
            try:
                found.holder[found.slot] = str(roots.absolute(found.value))
            except (OutsideRoots, OSError, RuntimeError, ValueError):
                pass  # left as it is: config_path_problems reports it
    return out
