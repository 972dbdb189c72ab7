"""Curricula (``stages:``): each stage is the top-level config with the stage's sections merged over it.

Merging is key by key, recursively (``train: {lr: 1e-4}`` keeps the top level's other train
keys; ``model: {lora: null}`` removes LoRA for a full fine-tune), with one exception: a
stage that names its data source (``data.path``, ``data.synthetic`` or ``data.mixture``)
replaces the top level's source rather than adding a second one.

Every stage is validated as the config it will run with, and its problems are reported
together, each prefixed ``stages[N].``; a problem of the top level that every stage
inherits is reported once, unprefixed.
"""

from __future__ import annotations

import copy
from typing import Any

from zeropipe.config.schema import RunConfig

STAGE_SECTIONS = ("model", "data", "train", "deepspeed")
DATA_SOURCES = ("path", "synthetic", "mixture")
# What the model is, as opposed to how it trains: fixed for the whole curriculum, because
# each stage starts from the weights the stage before it ended with.
TOP_LEVEL_MODEL_KEYS = ("path", "config", "family", "tokenizer", "tokenizer_vocab_size", "processor")


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and value and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge_stage(top: dict[str, Any], stage: dict[str, Any]) -> dict[str, Any]:
    """The raw config a stage runs with: ``top`` (without its stages) with the stage's sections over it."""
    merged = copy.deepcopy({key: value for key, value in top.items() if key != "stages"})
    for section in STAGE_SECTIONS:
        overrides = stage.get(section)
        if not isinstance(overrides, dict) or not overrides:
            continue
        base = merged.get(section) if isinstance(merged.get(section), dict) else {}
        if section == "model":
            overrides = {key: value for key, value in overrides.items() if key not in TOP_LEVEL_MODEL_KEYS}
        if section == "data" and any(key in overrides for key in DATA_SOURCES):
            base = {key: value for key, value in base.items() if key not in DATA_SOURCES}
        merged[section] = deep_merge(base, overrides)
    return merged


def stage_configs(config: RunConfig) -> list[RunConfig]:
    """The validated config of every stage of a curriculum (already checked when the config was loaded)."""
    assert config.stages, "not a curriculum"
    top = config.model_dump(mode="json")
    return [RunConfig.model_validate(merge_stage(top, stage.model_dump(mode="json"))) for stage in config.stages]


def stage_key(index: int, key: str) -> str:
    return f"stages[{index}].{key}" if key else f"stages[{index}]"


def stage_directory_name(index: int, name: str) -> str:
    """RUN/stages/<this>: numbered from 01 so that a listing shows the order."""
    return f"{index + 1:02d}-{name}"
