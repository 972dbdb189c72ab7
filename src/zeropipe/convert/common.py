"""What every converter shares: the result it builds, path lookup, and the YAML it writes.

A converter reads another tool's config and fills a :class:`Conversion`: each ZeRO-Pipe key it
sets comes with the source key(s) it came from and why, and each source key it cannot carry
over is listed with the reason. Nothing is dropped silently: a key is either mapped or listed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from zeropipe.errors import ZeroPipeError

SECTION_ORDER = ("run", "model", "data", "train", "deepspeed", "hardware", "generate", "logging")


class ConversionError(ZeroPipeError):
    """A file that cannot be converted (unreadable, or asking for training ZeRO-Pipe does not do)."""


@dataclass
class Entry:
    value: Any
    comment: str


@dataclass
class Conversion:
    """A converted config: ZeRO-Pipe keys with the reason for each, and what could not be mapped."""

    tool: str  # "diffusion-pipe", "axolotl", "llama-factory"
    source: Path
    entries: dict[str, Entry] = field(default_factory=dict)  # dotted ZeRO-Pipe key -> value and why
    unmapped: list[tuple[str, str]] = field(default_factory=list)  # (source key, why not mapped)
    # Folder name -> target folder: a kohya-layout folder of links the caller creates (diffusion-pipe
    # [[directory]] entries with repeats); see :func:`write_links`.
    links: dict[str, Path] = field(default_factory=dict)
    links_dir: Path | None = None
    # Why the converted config cannot train yet (an architecture ZeRO-Pipe does not have): `zeropipe
    # train` refuses with these; `zeropipe convert` still writes the file, for when support lands.
    blocking: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any, comment: str) -> None:
        self.entries[key] = Entry(value, comment)

    def skip(self, key: str, why: str) -> None:
        self.unmapped.append((key, why))

    def ordered(self) -> list[tuple[str, Entry]]:
        """Entries in the order of the schema's sections (run, model, data, train, ...), as the examples read."""
        rank = {name: index for index, name in enumerate(SECTION_ORDER)}
        return sorted(self.entries.items(), key=lambda item: rank.get(item[0].split(".")[0], len(rank)))

    def raw(self) -> dict[str, Any]:
        """The converted config as the nested dict the schema validates."""
        tree: dict[str, Any] = {}
        for dotted, entry in self.ordered():
            node = tree
            *parents, last = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = entry.value
        return tree

    def to_yaml(self, command_path: str | None = None) -> str:
        """ZeRO-Pipe YAML with a comment on every key and the unmapped keys listed at the top."""
        lines = [f"# Converted by `zeropipe convert` from the {self.tool} config {self.source}."]
        lines.append(f"# Run it:  zeropipe train {command_path or 'THIS_FILE.yaml'}")
        for reason in self.blocking:
            lines.append(f"# CANNOT TRAIN YET: {reason}")
        if self.links:
            lines.append(f"# data.path is a folder of links in the kohya layout (<repeats>_<name>) made by the conversion: {self.links_dir}")
        if self.unmapped:
            lines.append("#")
            lines.append(f"# Not mapped ({len(self.unmapped)}):")
            for key, why in self.unmapped:
                lines.append(f"#   - {key}: {why}")
        lines.append("")
        tree: dict[str, Any] = {}
        for dotted, entry in self.ordered():
            node = tree
            *parents, last = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = entry
        _emit(tree, 0, lines)
        return "\n".join(lines) + "\n"


def _emit(node: dict[str, Any], depth: int, lines: list[str]) -> None:
    indent = "  " * depth
    for key, value in node.items():
        if isinstance(value, Entry):
            lines.append(f"{indent}{key}: {_flow(value.value)}  # {value.comment}")
        else:
            lines.append(f"{indent}{key}:")
            _emit(value, depth + 1, lines)


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, allow_unicode=True).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


def find_path(name: str, *bases: Path) -> Path | None:
    """``name`` as an existing path: absolute, or relative to one of ``bases`` (first match), else None."""
    path = Path(name).expanduser()
    if path.is_absolute():
        return path if path.exists() else None
    for base in bases:
        candidate = (base / path).resolve()
        if candidate.exists():
            return candidate
    return None


def local_model(conversion: Conversion, key: str, name: str, bases: tuple[Path, ...]) -> None:
    """Map a model named by path or Hub id onto model.path; a Hub id is listed with how to fetch it."""
    found = find_path(name, *bases)
    if found is not None and found.is_dir():
        conversion.set("model.path", str(found), f"from {key}")
        return
    conversion.set("model.path", name, f"from {key}: not a local folder, see the list above")
    conversion.skip(
        key,
        f"{name!r} is not a local folder; ZeRO-Pipe loads local folders and downloads nothing: "
        f"`huggingface-cli download {name} --local-dir DIR`, then set model.path: DIR",
    )


def as_number(value: Any) -> float | None:
    """YAML 1.1 reads 1e-4 (no dot) as a string; configs written for these tools are full of them."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def write_links(conversion: Conversion) -> list[str]:
    """Create the kohya-layout folder of links a diffusion-pipe conversion asks for; return what was made.

    Raises:
        ConversionError: the folder cannot be written, or a name there is already something else.
    """
    if not conversion.links:
        return []
    assert conversion.links_dir is not None
    made = []
    try:
        conversion.links_dir.mkdir(parents=True, exist_ok=True)
        for name, target in conversion.links.items():
            link = conversion.links_dir / name
            if link.is_symlink():
                if link.resolve() == target.resolve():
                    continue
                link.unlink()
            elif link.exists():
                raise ConversionError(f"{link} exists and is not a link made by zeropipe convert: move it away or remove it")
            link.symlink_to(target, target_is_directory=True)
            made.append(f"{link} -> {target}")
    except OSError as err:
        raise ConversionError(f"cannot create the image folder links in {conversion.links_dir} ({err}): make that folder writable") from None
    # A link left over from an earlier conversion of a dataset that has since lost a directory.
    for stale in conversion.links_dir.iterdir():
        if stale.is_symlink() and stale.name not in conversion.links:
            stale.unlink()
    return made
