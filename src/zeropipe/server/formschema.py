"""The New-run form, described from the config schema so a field is documented once.

Every field of ``RunConfig`` becomes an input of a kind the page knows how to draw, with its
``description`` as the help text, its default as the placeholder and its bounds; optional
sub-sections (``model.lora``, ``data.synthetic``) become fieldsets switched on by a checkbox.
Adding a field to the schema adds it to the form; nothing here names a field.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

from zeropipe.config.schema import RunConfig

NONE = type(None)

# The settings a run is set up with, in this order: what to train, on what, how (full, LoRA,
# QLoRA), how long, on how many GPUs with which ZeRO stage and offload (the plan is beside
# them). The page shows these first and folds every other field under "Advanced"; this list
# is the one place the form names fields (a key missing from the schema is skipped).
ESSENTIALS = [
    "run.name",
    "model.path", "model.config",
    "data.path", "data.synthetic", "data.format", "data.max_seq_len",
    "model.lora", "model.quantization",
    "train.max_steps", "train.epochs", "train.micro_batch_size", "train.gradient_accumulation_steps", "train.lr",
    "hardware.gpus", "deepspeed.zero_stage", "deepspeed.offload_optimizer", "deepspeed.offload_param", "deepspeed.precision",
]  # fmt: skip


def nested_model(annotation) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def members(annotation) -> list:
    """The alternatives of a union (``X | None`` gives [X, None]); [annotation] otherwise.

    Constrained types (``PositiveInt`` is ``Annotated[int, Gt(0)]``) count as their base type.
    """
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [plain(a) for a in typing.get_args(annotation)]
    return [plain(annotation)]


def plain(annotation):
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Annotated else annotation


def annotated_metadata(annotation) -> list:
    """The constraints inside the members of a union (``PositiveInt | 'auto'`` has Gt(0))."""
    found = []
    for member in typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else [annotation]:
        if typing.get_origin(member) is typing.Annotated:
            found += list(typing.get_args(member)[1:])
    return found


def input_kind(annotation) -> tuple[str, dict[str, Any]]:
    """(kind, extra) for a field type: bool, select, int, float, text, scalar (any YAML scalar) or yaml (lists, mappings)."""
    options = [a for a in members(annotation) if a is not NONE]
    if len(options) == 1:
        only = options[0]
        if only is bool:
            return "bool", {}
        if typing.get_origin(only) is typing.Literal:
            return "select", {"options": list(typing.get_args(only))}
        if only is int:
            return "int", {}
        if only is float:
            return "float", {}
        if only is str:
            return "text", {}
    if all(typing.get_origin(a) is typing.Literal or a in (int, float, str, bool) for a in options):
        # e.g. gpus: int | "auto": one line, read as YAML so 4 is a number and auto a word.
        choices = [value for a in options if typing.get_origin(a) is typing.Literal for value in typing.get_args(a)]
        return "scalar", {"options": choices}
    return "yaml", {}


def bounds(field) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in [*field.metadata, *annotated_metadata(field.annotation)]:
        if isinstance(item, annotated_types.Ge):
            out["min"] = item.ge
        elif isinstance(item, annotated_types.Gt):
            out["min"], out["exclusive_min"] = item.gt, True
        elif isinstance(item, annotated_types.Le):
            out["max"] = item.le
        elif isinstance(item, annotated_types.Lt):
            out["max"], out["exclusive_max"] = item.lt, True
    return out


def default_of(field) -> Any:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return None
    else:
        value = field.default
    return to_jsonable_python(value)


def describe_field(key: str, name: str, field) -> dict[str, Any]:
    sub = nested_model(field.annotation)
    nullable = NONE in members(field.annotation)
    item: dict[str, Any] = {"key": key, "name": name, "help": field.description or "", "nullable": nullable}
    if sub is not None:
        item["kind"] = "section"
        item["fields"] = [describe_field(f"{key}.{n}", n, f) for n, f in sub.model_fields.items()]
        return item
    kind, extra = input_kind(field.annotation)
    item.update(kind=kind, default=default_of(field), **extra, **bounds(field))
    return item


def form_schema() -> dict[str, Any]:
    """Sections of the run config, each with its help text and its fields."""
    sections = []
    for name, field in RunConfig.model_fields.items():
        model = nested_model(field.annotation)
        if model is None:
            # A list of sections (a curriculum's stages): one YAML field, the whole list.
            sections.append({"name": name, "help": field.description or "", "fields": [describe_field(name, name, field)]})
            continue
        sections.append({"name": name, "help": field.description or "", "fields": [describe_field(f"{name}.{n}", n, f) for n, f in model.model_fields.items()]})
    return {"sections": sections, "essentials": ESSENTIALS}
