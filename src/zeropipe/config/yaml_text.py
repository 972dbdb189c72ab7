"""A run config from YAML text that may come from anyone (the UI's form, a run directory the UI reads).

PyYAML composes recursively and expands aliases: text that nests thousands of levels deep, or
a "billion laughs" of aliases, would exhaust the stack or the memory of whoever parses it.
These checks refuse such text first, with the same messages as a config file's problems.
"""

from __future__ import annotations

from typing import Any

import yaml

from zeropipe.config.load import parse_yaml
from zeropipe.errors import ConfigError

# Deeper than this, a config is not a config (and deep nesting exhausts recursive parsers).
MAX_DEPTH = 40
MAX_VALUES = 100_000
TOO_DEEP = ("", f"the config nests more than {MAX_DEPTH} levels deep: a run config has a few levels of sections; send the config itself")


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


def parse_yaml_text(text: str, source: str = "the submitted config") -> dict[str, Any]:
    """A run config from YAML text, with the same messages as a config file.

    Raises:
        ConfigError: not YAML, or not a mapping of sections, or nested too deeply.
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
