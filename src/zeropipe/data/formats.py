"""Telling the format of training records and turning them into conversations.

The records themselves are read by :mod:`zeropipe.data.records` (``.jsonl``, ``.json``,
``.txt``, ``.parquet``, ``.csv``/``.tsv``, ``.arrow``, a folder of shards of these or a
``datasets.save_to_disk`` folder), streamed; :func:`read_records` is the list of them for
small files. A record that cannot be used is reported as a :class:`BadRecord` with its line
(or row) number instead of stopping the run; the caller decides how many are acceptable.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from zeropipe.data.records import SUPPORTED_SUFFIXES, BadRecord, Record, iter_records, json_type
from zeropipe.errors import DataError

__all__ = ["SUPPORTED_SUFFIXES", "BadRecord", "Record", "detect_format", "read_located_records", "read_records", "to_conversation"]

FORMATS = ("alpaca", "dolly", "chat", "sharegpt", "text")

# What each format looks like, for error messages that tell the user what we accept.
FORMAT_SHAPES = {
    "alpaca": '{"instruction": ..., "input": ..., "output": ...}',
    "dolly": '{"instruction": ..., "context": ..., "response": ...}',
    "chat": '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}',
    "sharegpt": '{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}',
    "text": '{"text": ...} or a .txt file',
}

CHAT_ROLES = ("system", "user", "assistant")
# ShareGPT dumps use several speaker names; "user"/"assistant" appear in converted copies.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}

# Detection looks at this many good records: enough to outvote a few odd ones, cheap on
# datasets with millions of records.
DETECTION_SAMPLE = 100


class RecordError(ValueError):
    """Raised by :func:`to_conversation` when a record does not fit its format."""


def read_records(path: Path, columns: Mapping[str, str] | None = None) -> tuple[list[dict | str], list[BadRecord]]:
    """Every record under ``path`` as a list; malformed ones are returned, not raised.

    This holds the whole dataset: for small files (previews, conversions, mixtures of small
    sources). Data preparation streams with :func:`zeropipe.data.records.iter_records`.

    Raises:
        DataError: the path does not exist, has an unsupported suffix, or a file cannot be read.
    """
    located, bad = read_located_records(path, columns)
    return [record.value for record in located], bad


def read_located_records(path: Path, columns: Mapping[str, str] | None = None) -> tuple[list[Record], list[BadRecord]]:
    """Like :func:`read_records`, keeping each record's file and line number."""
    records: list[Record] = []
    bad: list[BadRecord] = []
    for item in iter_records(Path(path), columns):
        (bad if isinstance(item, BadRecord) else records).append(item)
    return records, bad


def _record_format(record: dict | str) -> str | None:
    """The format a single record looks like, or None."""
    if isinstance(record, str):
        return "text"
    if "messages" in record:
        return "chat"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "instruction" in record and "response" in record:
        return "dolly"
    if "text" in record:
        return "text"
    return None


def detect_format(records: list[dict | str], format: str = "auto", source: Path | None = None, bad: list[BadRecord] | None = None) -> str:
    """The format of the dataset: ``format`` when forced, else the majority of the first records.

    Args:
        source: data.path, named in the messages.
        bad: the malformed records read with ``records``, to say why there is nothing to detect from.

    Raises:
        DataError: ``format`` is not a known name, or no record looks like a supported format.
    """
    if format != "auto":
        if format not in FORMATS:
            raise DataError(f"data.format '{format}' is not supported. Use auto or one of {', '.join(FORMATS)}.")
        return format
    where = f"data.path {source}: " if source is not None else ""
    if not records and bad:
        raise DataError(f"{where}all {len(bad)} records are malformed, so there is nothing to tell the format from; first: {bad[0]}. Fix the file.")
    if not records:
        raise DataError(f"{where}no records: the file is empty or holds only blank lines. Point data.path at your data.")
    sample = records[:DETECTION_SAMPLE]
    votes = Counter(fmt for fmt in map(_record_format, sample) if fmt is not None)
    if votes:
        # most_common keeps first-seen order on ties, so the result is deterministic.
        return votes.most_common(1)[0][0]
    keys_seen = sorted({key for record in sample if isinstance(record, dict) for key in record})
    shapes = "; ".join(f"{name}: {shape}" for name, shape in FORMAT_SHAPES.items())
    seen = ", ".join(keys_seen) if keys_seen else "none"
    raise DataError(
        f"{where}could not tell the data format from the first {len(sample)} records (keys seen: {seen}). "
        f"Supported forms are {shapes}. Rename the keys, or set data.format if the records match one."
    )


def to_conversation(record: dict | str, fmt: str) -> list[dict[str, str]] | str:
    """Messages (``role``/``content``) for a record, or the text itself for ``text``.

    Raises:
        RecordError: the record lacks a key the format needs or a value has the wrong type;
            the message is the reason to show next to the line number.
    """
    if fmt == "text":
        return _text(record)
    if isinstance(record, str):
        raise RecordError(f"plain text cannot be used as {fmt} format")
    if fmt == "alpaca":
        return _instruction_pair(record, fmt, prompt_key="instruction", extra_key="input", answer_key="output")
    if fmt == "dolly":
        return _instruction_pair(record, fmt, prompt_key="instruction", extra_key="context", answer_key="response")
    if fmt == "chat":
        return _turns(record, fmt, list_key="messages", role_key="role", content_key="content", roles=None)
    if fmt == "sharegpt":
        return _turns(record, fmt, list_key="conversations", role_key="from", content_key="value", roles=SHAREGPT_ROLES)
    raise DataError(f"data.format '{fmt}' is not supported. Use auto or one of {', '.join(FORMATS)}.")


def _text(record: dict | str) -> str:
    if isinstance(record, str):
        return record
    if "text" not in record:
        raise RecordError("missing key 'text' (text format)")
    if not isinstance(record["text"], str):
        raise RecordError(f"'text' should be a string, got {json_type(record['text'])} (text format)")
    return record["text"]


def _required_string(record: dict, key: str, fmt: str) -> str:
    if key not in record:
        raise RecordError(f"missing key '{key}' ({fmt} format)")
    value = record[key]
    if not isinstance(value, str):
        raise RecordError(f"'{key}' should be a string, got {json_type(value)} ({fmt} format)")
    return value


def _instruction_pair(record: dict, fmt: str, *, prompt_key: str, extra_key: str, answer_key: str) -> list[dict]:
    instruction = _required_string(record, prompt_key, fmt)
    answer = _required_string(record, answer_key, fmt)
    # The extra field is optional in both formats and often null in exported datasets.
    extra = record.get(extra_key) or ""
    if not isinstance(extra, str):
        raise RecordError(f"'{extra_key}' should be a string, got {json_type(extra)} ({fmt} format)")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def _turns(
    record: dict, fmt: str, *, list_key: str, role_key: str, content_key: str, roles: dict[str, str] | None
) -> list[dict]:
    if list_key not in record:
        raise RecordError(f"missing key '{list_key}' ({fmt} format)")
    turns = record[list_key]
    if not isinstance(turns, list):
        raise RecordError(f"'{list_key}' should be a list, got {json_type(turns)} ({fmt} format)")
    if not turns:
        raise RecordError(f"'{list_key}' is empty ({fmt} format)")
    known = sorted(roles) if roles else list(CHAT_ROLES)
    messages = []
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise RecordError(f"{list_key}[{number}] should be an object, got {json_type(turn)} ({fmt} format)")
        for key in (role_key, content_key):
            if key not in turn:
                raise RecordError(f"{list_key}[{number}] is missing key '{key}' ({fmt} format)")
        role, content = turn[role_key], turn[content_key]
        if not isinstance(content, str):
            raise RecordError(
                f"{list_key}[{number}].{content_key} should be a string, got {json_type(content)} ({fmt} format)"
            )
        if not isinstance(role, str) or role not in known:
            raise RecordError(
                f"{list_key}[{number}].{role_key} is {json.dumps(role)}; expected one of {', '.join(known)} "
                f"({fmt} format)"
            )
        messages.append({"role": roles[role] if roles else role, "content": content})
    if not any(message["role"] == "assistant" for message in messages):
        raise RecordError(f"no assistant turn in '{list_key}', so nothing to learn from ({fmt} format)")
    return messages
