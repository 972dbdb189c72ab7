"""Reward functions of a GRPO run (``grpo.rewards``), built once per rank, each called as TRL calls its reward functions.

Every reward is ``f(prompts, completions, **fields) -> list[float | None]``: ``prompts`` are the
prompts' texts (the last user turn), ``completions`` the decoded completions, ``fields`` each
record's other fields as lists (``answer`` among them), one entry per completion. ``None`` means
"not scored" (TRL's convention): a completion no reward scores gets no advantage.

Built in: ``answer`` (exact match), ``numeric`` (the last number matches), ``format`` (a regex
matches), ``length`` (close to a target length), ``model`` (a reward model's score: the export of a
``preference.method: reward`` run) and ``function`` (a user's importable ``module:function``).
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")

RewardFunction = Callable[..., list]


@dataclass
class Reward:
    name: str
    weight: float
    function: RewardFunction


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def answer_match(prompts, completions, answer=None, **fields) -> list[float | None]:
    answers = answer or [None] * len(completions)
    return [None if a is None else float(c.strip() == str(a).strip()) for c, a in zip(completions, answers, strict=True)]


def numeric_match(tolerance: float) -> RewardFunction:
    def numeric(prompts, completions, answer=None, **fields) -> list[float | None]:
        answers = answer or [None] * len(completions)
        scores = []
        for completion, expected in zip(completions, answers, strict=True):
            target = last_number(str(expected)) if expected is not None else None
            if target is None:
                scores.append(None)
                continue
            got = last_number(completion)
            scores.append(float(got is not None and math.isclose(got, target, rel_tol=0.0, abs_tol=tolerance)))
        return scores

    return numeric


def format_match(pattern: str) -> RewardFunction:
    compiled = re.compile(pattern, re.DOTALL)

    def matches_format(prompts, completions, **fields) -> list[float]:
        return [float(compiled.search(c) is not None) for c in completions]

    return matches_format


def length_closeness(target: int) -> RewardFunction:
    def length(prompts, completions, **fields) -> list[float]:
        return [max(-1.0, 1.0 - abs(len(c) - target) / target) for c in completions]

    return length


def reward_model(path: str, device: Any) -> RewardFunction:
    """A reward model's score of prompt + completion (its tokenizer; the prompt as the user turn, the completion as the answer)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from zeropipe.data.tokenize import render_example

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).to(device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @torch.no_grad()
    def model_score(prompts, completions, **fields) -> list[float]:
        rows = [render_example(tokenizer, [{"role": "user", "content": p}, {"role": "assistant", "content": c}])[0] for p, c in zip(prompts, completions, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
        return [float(v) for v in model(input_ids=ids, attention_mask=mask).logits.float().reshape(-1)]

    return model_score


def import_function(reference: str) -> RewardFunction:
    """The callable a ``module:function`` reference names.

    Raises:
        ValueError: the reference is malformed, the module cannot be imported or has no such callable.
    """
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"grpo.rewards function {reference!r}: write it as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"grpo.rewards function {reference!r}: cannot import {module_name} ({error}); put it on PYTHONPATH") from error
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"grpo.rewards function {reference!r}: {module_name} has no callable {attribute}")
    return function


def build_rewards(sections: list[Any], device: Any = "cpu") -> list[Reward]:
    """The run's rewards from its ``grpo.rewards`` sections."""
    rewards = []
    for section in sections:
        if section.kind == "answer":
            function = answer_match
        elif section.kind == "numeric":
            function = numeric_match(section.tolerance)
        elif section.kind == "format":
            function = format_match(section.pattern)
        elif section.kind == "length":
            function = length_closeness(section.target_length)
        elif section.kind == "model":
            function = reward_model(section.path, device)
        else:
            function = import_function(section.function)
        default = getattr(function, "__name__", section.kind) if section.kind == "function" else section.kind
        rewards.append(Reward(section.name or default, section.weight, function))
    return rewards


def reward_problems(config: Any) -> list[tuple[str, str]]:
    """(key, message with the fix) for rewards that cannot work; checked before any process starts."""
    problems = []
    for number, section in enumerate(config.grpo.rewards):
        key = f"grpo.rewards[{number}]"
        needs = {"format": "pattern", "length": "target_length", "model": "path", "function": "function"}.get(section.kind)
        if needs and getattr(section, needs) in (None, ""):
            problems.append((f"{key}.{needs}", f"a {section.kind} reward needs {needs}: set it"))
            continue
        if section.kind == "format":
            try:
                re.compile(section.pattern)
            except re.error as error:
                problems.append((f"{key}.pattern", f"not a regular expression ({error}): fix it"))
        if section.kind == "function":
            # Only its shape here: importing runs the module's code, which a config check (the UI's) must not do.
            # The ranks import it first thing and stop with the reason when it does not import.
            module_name, _, attribute = section.function.partition(":")
            if not module_name or not attribute:
                problems.append((f"{key}.function", f"{section.function!r}: write it as 'package.module:function'"))
    names = [section.name or section.kind for section in config.grpo.rewards if section.kind != "function"]
    if len(set(names)) != len(names):
        problems.append(("grpo.rewards", "two rewards share a name in the metrics: give each a distinct name"))
    if not config.grpo.rewards:
        problems.append(("grpo.rewards", "no reward: name at least one, e.g. [{kind: numeric}]"))
    return problems
