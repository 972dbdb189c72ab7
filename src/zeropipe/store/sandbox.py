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

import yaml

from zeropipe.config.load import parse_yaml
from zeropipe.errors import ConfigError, ZeroPipeError

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
# Deeper than this, a config is not a config (and deep nesting exhausts recursive parsers).
MAX_DEPTH = 40
MAX_VALUES = 100_000
TOO_DEEP = ("", f"the config nests more than {MAX_DEPTH} levels deep: a run config has a few levels of sections; send the config itself")
REMOTE_CODE_KEY = "trust_remote_code"

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


def confined(path: Path, root: Path) -> Path | None:
    """``path`` resolved, or None when it resolves outside ``root`` (a symlink leading out)."""
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    return resolved if is_inside(resolved, root) else None


def check_name(name: Any, what: str = "run.name") -> list[tuple[str, str]]:
    if not isinstance(name, str) or not SAFE_NAME.match(name):
        return [(what, f"{name!r} cannot be a folder name: use letters, digits, '.', '_' and '-' (not starting with '.' or '-'), at most 100 characters")]
    if name in RESERVED_NAMES:
        return [(what, f"{name!r} is reserved for the UI's own files: choose another name")]
    return []


def config_shape(value: Any) -> tuple[int, int]:
    """(how deeply mappings and lists nest, how many values there are), without recursion.

    Stops counting past the limits: a YAML alias expanded a billion times is not walked.
    """
    deepest, count, stack = 0, 0, [(value, 0)]
    while stack and deepest <= MAX_DEPTH and count <= MAX_VALUES:
        node, depth = stack.pop()
        count += 1
        if isinstance(node, dict):
            children = list(node.values())
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest, count


def too_deep(value: Any) -> list[tuple[str, str]]:
    """One problem when a config nests too deeply or holds too many values to be a run config."""
    depth, count = config_shape(value)
    if depth > MAX_DEPTH:
        return [TOO_DEEP]
    if count > MAX_VALUES:
        return [("", f"the config holds more than {MAX_VALUES:,} values (YAML aliases count every time they are used): send the config itself")]
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


def parse_yaml_text(text: str, source: str = "the submitted config") -> dict[str, Any]:
    """A run config from YAML text, with the same messages as a config file.

    Raises:
        ConfigError: not YAML, or not a mapping of sections.
    """
    if yaml_depth(text) > MAX_DEPTH:  # PyYAML composes recursively: refuse before it overflows the stack
        raise ConfigError([TOO_DEEP], source=source)
    raw = parse_yaml(text, source)
    if too_deep(raw):
        raise ConfigError(too_deep(raw), source=source)
    return raw


def yaml_depth(text: str) -> int:
    """How deeply the YAML text's collections nest, from its tokens (PyYAML's scanner does not recurse)."""
    opening = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken, yaml.FlowSequenceStartToken)
    closing = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)
    depth = deepest = 0
    try:
        for token in yaml.scan(text, Loader=yaml.SafeLoader):
            if isinstance(token, opening):
                depth += 1
                deepest = max(deepest, depth)
                if deepest > MAX_DEPTH:
                    break
            elif isinstance(token, closing):
                depth -= 1
    except yaml.YAMLError:
        pass  # safe_load reports the syntax error with its line
    return deepest
