"""Configs of other training tools turned into ZeRO-Pipe run configs.

``convert_file(path)`` reads a diffusion-pipe TOML (and the dataset TOML it names), an axolotl
YAML or a LLaMA-Factory YAML (and the ``dataset_info.json`` its datasets are described in),
and returns a :class:`~zeropipe.convert.common.Conversion`: the ZeRO-Pipe keys with a comment
saying where each came from, and the source keys that could not be mapped, each with why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomllib
import yaml

from zeropipe.convert.common import Conversion, ConversionError, write_links

__all__ = ["Conversion", "ConversionError", "TOOLS", "convert_file", "detect_tool", "read_source", "write_links"]

TOOLS = ("diffusion-pipe", "axolotl", "llama-factory")
# Top-level sections of a ZeRO-Pipe run config: a file with these is already ours.
ZEROPIPE_SECTIONS = ("run", "model", "data", "train", "deepspeed", "hardware", "generate", "logging", "stages")


def read_source(path: Path) -> dict[str, Any]:
    """The file as a dict: TOML for ``.toml``, YAML otherwise.

    Raises:
        ConversionError: missing file, or not valid TOML/YAML (with the line), or not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path} does not exist: check the path")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".toml":
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConversionError(f"{path} is not valid TOML: {err}; fix the syntax (quotes around strings, [table] headers, key = value)") from None
        return raw
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConversionError(f"{path} is not valid YAML{where}: {problem}; fix the syntax (indentation, a missing ':' or quote)") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConversionError(f"{path}: the top level must be a mapping of keys, not {type(raw).__name__}")
    return raw


def detect_tool(path: Path, raw: dict[str, Any]) -> str | None:
    """Which tool the file was written for: one of TOOLS, "zeropipe", or None when it is not clear."""
    if Path(path).suffix == ".toml":
        if isinstance(raw.get("model"), dict) and "type" in raw["model"] or "dataset" in raw:
            return "diffusion-pipe"
        return None
    if "model_name_or_path" in raw or ("stage" in raw and "finetuning_type" in raw):
        return "llama-factory"
    if "base_model" in raw:
        return "axolotl"
    if any(isinstance(raw.get(name), dict) or (name == "stages" and isinstance(raw.get(name), list)) for name in ZEROPIPE_SECTIONS):
        return "zeropipe"
    if "datasets" in raw:
        return "axolotl"
    return None


def convert_file(path: str | Path, links_dir: Path | None = None) -> Conversion:
    """Convert a diffusion-pipe, axolotl or LLaMA-Factory config.

    Args:
        path: the config file.
        links_dir: diffusion-pipe only: where the kohya-layout folder of links goes when the
            dataset has several directories or repeats (default: beside the dataset TOML).

    Raises:
        ConversionError: the file cannot be read, its tool cannot be told, or it asks for what
            ZeRO-Pipe does not train (an RL stage such as DPO, PPO or KTO).
    """
    path = Path(path).expanduser().resolve()
    raw = read_source(path)
    tool = detect_tool(path, raw)
    try:
        return _convert(path, raw, tool, links_dir)
    except (TypeError, ValueError, AttributeError) as err:
        # A key holding a list where a table belongs, and the like: the tool itself would refuse the
        # file too. Say so in one line rather than with a traceback.
        raise ConversionError(f"{path}: a value has a type {tool or 'the tool'} does not accept ({err}): check the file against the tool's examples") from None


def _convert(path: Path, raw: dict[str, Any], tool: str | None, links_dir: Path | None) -> Conversion:
    if tool == "diffusion-pipe":
        from zeropipe.convert import diffusion_pipe

        return diffusion_pipe.convert(path, raw, links_dir)
    if tool == "axolotl":
        from zeropipe.convert import axolotl

        return axolotl.convert(path, raw)
    if tool == "llama-factory":
        from zeropipe.convert import llama_factory

        return llama_factory.convert(path, raw)
    if tool == "zeropipe":
        raise ConversionError(f"{path} is already a ZeRO-Pipe run config: train it with `zeropipe train {path}`")
    raise ConversionError(
        f"cannot tell which tool {path} was written for: expected a diffusion-pipe TOML (a [model] table with type = ...), "
        "an axolotl YAML (base_model:, datasets:) or a LLaMA-Factory YAML (model_name_or_path:, stage:)"
    )
