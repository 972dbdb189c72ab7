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

# The confinement of paths lives in confine.py, below every reader of a run or its data; the roots
# here are checked with the same functions, and handed to the launcher as a Confinement.
from zeropipe.confine import (  # noqa: F401  (the store's names for them)
    FREE_FORM,
    PATH_FIELDS,
    REMOTE_CODE_KEY,
    Confinement,
    FoundPath,
    OutsideRoots,
    config_paths,
    confined,
    is_inside,
    is_path,
    multinode_problems,
    resolve_inside,
)

# A run name becomes a directory name: no separators, no leading dot, nothing a shell would mangle.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
# Folders under a runs root that are not runs.
RESERVED_NAMES = {"configs"}

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

    def confinement(self, multinode: bool = False) -> Confinement:
        """These roots as the launcher's resolved run and every later reader of the run apply them (``zeropipe.confine``)."""
        return Confinement(tuple(self.readable()), multinode, self.base)


def check_name(name: Any, what: str = "run.name") -> list[tuple[str, str]]:
    if not isinstance(name, str) or not SAFE_NAME.match(name):
        return [(what, f"{name!r} cannot be a folder name: use letters, digits, '.', '_' and '-' (not starting with '.' or '-'), at most 100 characters")]
    if name in RESERVED_NAMES:
        return [(what, f"{name!r} is reserved for the UI's own files: choose another name")]
    return []


def config_path_problems(raw: dict[str, Any], roots: Roots, allow_remote_code: bool = False, allow_multinode: bool = False) -> list[tuple[str, str]]:
    """Problems of a config submitted through the UI, in ConfigError's (key, message) form.

    Every path the config names (typed fields, and path-like values inside model.config,
    model.load_kwargs and deepspeed.overrides, in every stage too) must lie inside the runs or
    data folders; ``trust_remote_code`` is refused unless the server allows remote code; the
    fields choosing other machines and how they are reached (``confine.MULTINODE_FIELDS``)
    unless it trusts multinode configs. What the config's files hold (a DeepSpeed JSON's
    output paths) is checked when the run is resolved (``Confinement.run_problems``).
    """
    problems = too_deep(raw)
    if problems:
        return problems
    if not allow_multinode:
        problems += multinode_problems(raw)
    else:
        from zeropipe.launch.nodes import hardware_problems

        problems += hardware_problems(raw.get("hardware"), confined=True)  # the ssh allow-list and host names, as the launcher applies them
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
    if not allow_remote_code:
        problems += python_code_problems(raw)
    allowed = roots.readable()
    shown = ", ".join(str(r) for r in roots.readable())
    for found in config_paths(raw):
        if found.key == "hardware.hostfile" and not allow_multinode:
            continue  # refused above, whatever its path
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
        elif found.key != "data.cache.dir" and hidden_in_data(resolved, roots):
            problems.append((found.key, f"{found.value} is a hidden file or folder (its name, or a folder's on the way, starts with '.'): "
                             "the UI reads no hidden files of its data folders; rename it"))  # fmt: skip
        elif (kind := special_file(resolved)) is not None:
            problems.append((found.key, f"{found.value} is a {kind}, not a file or a folder: reading it would wait for a writer "
                             "(or never end); give a regular file or a folder"))  # fmt: skip
    return problems


def special_file(path: Path) -> str | None:
    """What ``path`` is when it exists and is neither a regular file nor a folder (a FIFO, a socket, a device), else None."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return {stat.S_IFIFO: "named pipe (FIFO)", stat.S_IFSOCK: "socket", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device"}.get(stat.S_IFMT(mode), "special file")


def python_code_problems(raw: dict[str, Any]) -> list[tuple[str, str]]:
    """A GRPO reward that names a Python function (``grpo.rewards[N].function``, in every stage too): refused unless the UI trusts code."""
    problems = []
    sections = [("", raw)] + [(f"stages[{n}].", stage) for n, stage in enumerate(raw.get("stages") or []) if isinstance(stage, dict)]
    for prefix, section in sections:
        grpo = section.get("grpo")
        rewards = grpo.get("rewards") if isinstance(grpo, dict) else None
        for number, reward in enumerate(rewards if isinstance(rewards, list) else []):
            if isinstance(reward, dict) and reward.get("function") not in (None, ""):
                problems.append((f"{prefix}grpo.rewards[{number}].function", "a reward function is Python code imported and run on this machine: the UI refuses it "
                                 "unless started with `zeropipe ui --allow-remote-code`; use a built-in reward (answer, numeric, format, length, model), or run this config with `zeropipe train`"))  # fmt: skip
    return problems


def hidden_in_data(path: Path, roots: Roots) -> bool:
    """Whether ``path`` (resolved) lies in a data folder (not a runs folder) under a name starting with '.' (``.secret/creds.txt``)."""
    if roots.runs_root_of(path) is not None:
        return False
    for root in roots.data:
        try:
            parts = Path(path).relative_to(root).parts
        except ValueError:
            continue
        return any(part.startswith(".") for part in parts)
    return False


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
