"""Prompts for online reinforcement learning (GRPO): each record's prompt, its reference answer and its other fields.

Layouts read (one record each):

- TRL's prompt-only layout: ``prompt`` (a string or a conversation) with any other fields
  (``answer``, ``solution``, ``ground_truth``...), handed to reward functions by name, as TRL does;
- every supervised format ZeRO-Pipe reads (alpaca, dolly, chat, sharegpt): the turns before the
  last assistant turn are the prompt, and that turn's text is the record's ``answer``.

The launcher writes the prompts once into ``RUN/cache/prompts.jsonl`` (the ranks render them with
the run's template); bad records are counted and named as in the other caches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from zeropipe.data.formats import RecordError, detect_format, to_conversation
from zeropipe.data.records import BadRecord, Record

PROMPTS_FILE = "prompts.jsonl"
ANSWER_KEYS = ("answer", "solution", "ground_truth", "target", "completion")


def _prompt_messages(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(turn, dict) and "role" in turn and "content" in turn for turn in value):
        return [{"role": str(turn["role"]), "content": str(turn["content"])} for turn in value]
    raise RecordError("'prompt' should be a string or a list of {role, content} turns")


def prompt_record(record: dict | str, fmt: str) -> dict[str, Any]:
    """``{"prompt": messages, "answer": str | None, "fields": {...}}`` for one record.

    Raises:
        RecordError: a record with no prompt (a plain text, or a conversation without a user turn).
    """
    if isinstance(record, dict) and "prompt" in record:
        messages = _prompt_messages(record["prompt"])
        answer = next((record[key] for key in ANSWER_KEYS if key in record and record[key] is not None), None)
        fields = {key: value for key, value in record.items() if key != "prompt"}
        return {"prompt": messages, "answer": None if answer is None else str(answer), "fields": fields}
    if fmt == "text":
        raise RecordError("a plain text has no prompt: give records with 'prompt' (and 'answer'), or a supervised format")
    conversation = to_conversation(record, fmt)
    assert isinstance(conversation, list)
    last = max((i for i, turn in enumerate(conversation) if turn["role"] == "assistant"), default=None)
    prompt = conversation[:last] if last is not None else conversation
    if not any(turn["role"] == "user" for turn in prompt):
        raise RecordError("no user turn before the answer: nothing to prompt with")
    answer = conversation[last]["content"] if last is not None else None
    fields = {key: value for key, value in record.items() if isinstance(value, (str, int, float, bool))} if isinstance(record, dict) else {}
    return {"prompt": prompt, "answer": answer, "fields": {**fields, "answer": answer}}


def write_prompts(items: Iterable[Record | BadRecord], format: str, cache: Path) -> dict[str, Any]:
    """Every good record's prompt into ``cache/prompts.jsonl``; returns counts and the first bad records."""
    items = list(items)
    good = [item for item in items if isinstance(item, Record)]
    bad: list[BadRecord] = [item for item in items if isinstance(item, BadRecord)]
    fmt = detect_format([item.value for item in good], format, bad=bad) if not any(isinstance(item.value, dict) and "prompt" in item.value for item in good[:100]) else "prompt"
    rows = []
    for item in good:
        try:
            rows.append(prompt_record(item.value, fmt))
        except RecordError as error:
            bad.append(item.bad(str(error)))
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / (PROMPTS_FILE + ".partial")
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    partial.replace(cache / PROMPTS_FILE)
    return {"examples": len(rows), "format": fmt, "with_answers": sum(row["answer"] is not None for row in rows),
            "bad_record_count": len(bad), "bad_records": [b.to_json() for b in bad[:10]]}


def read_prompts(cache: Path) -> list[dict[str, Any]]:
    with open(Path(cache) / PROMPTS_FILE, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
