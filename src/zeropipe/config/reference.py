"""The YAML reference of the run config, generated from the schema's field descriptions.

``python -m zeropipe.config.reference > docs/config.md`` rewrites the docs page; a test
keeps the two in step.
"""

from __future__ import annotations

import json
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from zeropipe.config.schema import RunConfig


def nested_model(annotation) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def list_item_model(annotation) -> type[BaseModel] | None:
    """The section of a list of sections (``list[StageSection] | None`` -> StageSection), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is list:
            return nested_model(typing.get_args(candidate)[0])
    return None


def type_name(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(annotation)))
    args = typing.get_args(annotation)
    if args and typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType")):
        return " or ".join(type_name(arg) for arg in args)
    if annotation is type(None):
        return "null"
    text = str(annotation).replace("typing.", "")
    return text.replace("<class '", "").replace("'>", "")


def default_text(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, list):  # a list of sections (grpo.rewards)
            value = [item.model_dump(exclude_defaults=True) if isinstance(item, BaseModel) else item for item in value]
        return json.dumps(value.model_dump() if isinstance(value, BaseModel) else value)
    if field.default is PydanticUndefined:
        return "required"
    return json.dumps(field.default)


def reference() -> str:
    lines = [
        "# Run config reference",
        "",
        "Generated from `src/zeropipe/config/schema.py` by `python -m zeropipe.config.reference`; do not edit by hand.",
        "Unknown keys are errors. Any key can be overridden on the command line: `zeropipe train run.yaml train.lr=2e-5`.",
        "",
    ]
    for section_name, section_field in RunConfig.model_fields.items():
        section = nested_model(section_field.annotation)
        prefix = section_name
        if section is None:  # a list of sections (stages): one row per key of an item
            section, prefix = list_item_model(section_field.annotation), f"{section_name}[]"
        lines += [f"## `{section_name}`", "", section_field.description or "", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        rows: list[tuple[str, object]] = [(f"{prefix}.{name}", field) for name, field in section.model_fields.items()]
        while rows:
            key, field = rows.pop(0)
            sub, items = nested_model(field.annotation), list_item_model(field.annotation)
            if items is not None:
                lines.append(f"| `{key}` | list of sections or null | `{default_text(field)}` | {field.description or ''} |")
                rows[0:0] = [(f"{key}[].{name}", f) for name, f in items.model_fields.items()]
                continue
            lines.append(f"| `{key}` | {type_name(field.annotation) if sub is None else 'section or null'} | `{default_text(field) if sub is None else 'null'}` | {field.description or ''} |")
            if sub is not None:
                rows[0:0] = [(f"{key}.{name}", f) for name, f in sub.model_fields.items()]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference(), end="")
