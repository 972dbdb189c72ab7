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

from zeropipe.errors import ZeroPipeError

# A run name becomes a directory name: no separators, no leading dot, nothing a shell would mangle.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
# Folders under a runs root that are not runs.
RESERVED_NAMES = {"configs"}

# Config keys that name files the launcher will read, and so must lie inside a root.
PATH_KEYS = [("model", "path"), ("model", "tokenizer"), ("data", "path"), ("data", "eval_path"), ("deepspeed", "config_file")]


class OutsideRoots(ZeroPipeError):
    """A path that resolves outside every allowed root (traversal, absolute path or symlink)."""


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
        path = Path(path).expanduser()
        return (path if path.is_absolute() else self.base / path).resolve()

    @property
    def primary_runs(self) -> Path:
        return self.runs[0]

    def readable(self) -> list[Path]:
        return [*self.runs, *self.data]

    def runs_root_of(self, path: Path) -> Path | None:
        return next((root for root in self.runs if is_inside(path, root)), None)


def is_inside(path: Path, root: Path) -> bool:
    try:
        Path(path).resolve().relative_to(Path(root).resolve())
        return True
    except ValueError:
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


def check_name(name: Any, what: str = "run.name") -> list[tuple[str, str]]:
    if not isinstance(name, str) or not SAFE_NAME.match(name):
        return [(what, f"{name!r} cannot be a folder name: use letters, digits, '.', '_' and '-' (not starting with '.' or '-'), at most 100 characters")]
    if name in RESERVED_NAMES:
        return [(what, f"{name!r} is reserved for the UI's own files: choose another name")]
    return []


def config_path_problems(raw: dict[str, Any], roots: Roots) -> list[tuple[str, str]]:
    """Problems with the paths of a config submitted through the UI, in ConfigError's (key, message) form."""
    problems: list[tuple[str, str]] = []
    run = raw.get("run") if isinstance(raw.get("run"), dict) else {}
    problems += check_name(run.get("name"))
    output_dir = run.get("output_dir")
    if output_dir is not None:
        if not isinstance(output_dir, str) or roots.absolute(output_dir) not in roots.runs:
            shown = ", ".join(str(r) for r in roots.runs)
            problems.append(("run.output_dir", f"the UI writes runs into its runs folder ({shown}), not {output_dir!r}: remove the key or set it to that folder"))
    allowed = roots.readable()
    for dotted, node, key in path_fields(raw):
        value = node[key]
        resolved = roots.absolute(value)
        if not any(is_inside(resolved, root) for root in allowed):
            shown = ", ".join(str(r) for r in roots.data) or "(none configured: start zeropipe ui with --data-dir)"
            problems.append((dotted, f"{value} is outside the folders this UI may read ({shown}): move the file there or start zeropipe ui with --data-dir"))
    return problems


def path_fields(raw: dict[str, Any]) -> list[tuple[str, dict, str]]:
    """(dotted key, the mapping that holds it, its key) for every path a config names.

    The sections' own (PATH_KEYS), each data.mixture source's, and the same inside every
    stage of a curriculum: a path the UI must not read may hide in any of them.
    """
    found: list[tuple[str, dict, str]] = []

    def collect(prefix: str, config: dict[str, Any]) -> None:
        for section, key in PATH_KEYS:
            node = config.get(section)
            if isinstance(node, dict) and isinstance(node.get(key), str) and node[key]:
                found.append((f"{prefix}{section}.{key}", node, key))
        data = config.get("data")
        mixture = data.get("mixture") if isinstance(data, dict) else None
        for index, source in enumerate(mixture if isinstance(mixture, list) else []):
            if isinstance(source, dict) and isinstance(source.get("path"), str) and source["path"]:
                found.append((f"{prefix}data.mixture[{index}].path", source, "path"))

    collect("", raw)
    stages = raw.get("stages")
    for index, stage in enumerate(stages if isinstance(stages, list) else []):
        if isinstance(stage, dict):
            collect(f"stages[{index}].", stage)
    return found


def absolutize(raw: dict[str, Any], roots: Roots) -> dict[str, Any]:
    """The same config with every path made absolute, so the launcher's working directory does not matter."""
    out = copy.deepcopy(raw)
    run = out.setdefault("run", {})
    run["output_dir"] = str(roots.absolute(run.get("output_dir") or roots.primary_runs))
    for _, node, key in path_fields(out):
        node[key] = str(roots.absolute(node[key]))
    return out
