"""Reading training records and turning them into conversations.

Supported files: ``.jsonl`` (one JSON object per line), ``.json`` (an array of objects)
and ``.txt`` (documents separated by blank lines), or a directory of them. A record that
cannot be used is reported as a :class:`BadRecord` with its line number instead of
stopping the run; the caller decides how many of those are acceptable.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeropipe.confine import OUTSIDE_REASON, require_usable, usable
from zeropipe.errors import DataError

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".txt")
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


@dataclass(frozen=True)
class BadRecord:
    """A record that was skipped, with where it is and why."""

    line_number: int
    reason: str
    file: str = ""  # set when data.path is a directory, so the line number can be found

    def __str__(self) -> str:
        where = f"{self.file} line {self.line_number}" if self.file else f"line {self.line_number}"
        return f"{where}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line_number, "reason": self.reason}


@dataclass(frozen=True)
class Record:
    """A good record and where it came from, so later problems can name its line."""

    value: dict | str
    line_number: int
    file: str = ""

    def bad(self, reason: str) -> BadRecord:
        return BadRecord(self.line_number, reason, self.file)


class RecordError(ValueError):
    """Raised by :func:`to_conversation` when a record does not fit its format."""


def read_records(path: Path) -> tuple[list[dict | str], list[BadRecord]]:
    """Read every record under ``path``; malformed ones are returned, not raised.

    Raises:
        DataError: the path does not exist, has an unsupported suffix, or a ``.json``
            file is not a JSON array.
    """
    located, bad = read_located_records(path)
    return [record.value for record in located], bad


def read_located_records(path: Path) -> tuple[list[Record], list[BadRecord]]:
    """Like :func:`read_records`, keeping each record's file and line number."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data.path {path}: no such file or directory. Fix data.path to point at your data.")
    require_usable(path, "data.path")  # a UI run's data (zeropipe.confine): never through a symlink out of its folders
    if path.is_dir():
        # Hidden files are editor and notebook leftovers, not data.
        listed = sorted(
            p for p in path.iterdir() if p.is_file() and p.suffix in SUPPORTED_SUFFIXES and not p.name.startswith(".")
        )
        files = [p for p in listed if usable(p)]
        outside = [BadRecord(0, OUTSIDE_REASON, file=p.name) for p in listed if p not in files]
        if not files:
            raise DataError(
                f"data.path {path}: the directory has no {', '.join(SUPPORTED_SUFFIXES)} files. "
                "Fix data.path or add data files to it."
            )
        records: list[Record] = []
        bad: list[BadRecord] = outside  # each file skipped for leading out of the folders is one skipped record, named
        for file in files:
            file_records, file_bad = _read_file(file, label=file.name)
            records += file_records
            bad += file_bad
        return records, bad
    if path.suffix not in SUPPORTED_SUFFIXES:
        raise DataError(
            f"data.path {path}: unsupported file type '{path.suffix}'. "
            f"Use one of {', '.join(SUPPORTED_SUFFIXES)}."
        )
    return _read_file(path, label="")


def _read_file(path: Path, label: str) -> tuple[list[Record], list[BadRecord]]:
    with open(path, "rb") as handle:
        head = handle.read(8192)
    if b"\0" in head:
        # Text never holds NUL bytes: every "line" would be a malformed record, which hides the point.
        raise DataError(
            f"data.path {path}: this is a binary file, not {path.suffix} text (it holds NUL bytes). "
            "Point data.path at your JSONL, JSON or text data."
        )
    if path.suffix == ".jsonl":
        return _read_jsonl(path, label)
    if path.suffix == ".json":
        return _read_json_array(path, label)
    return _read_text(path, label)


def _read_jsonl(path: Path, label: str) -> tuple[list[Record], list[BadRecord]]:
    records: list[Record] = []
    bad: list[BadRecord] = []
    # Bytes, not text: one line with broken UTF-8 should cost one record, not the file.
    for line_number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if line_number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte order mark written by some editors
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            bad.append(BadRecord(line_number, f"not valid UTF-8 (byte {error.start + 1})", label))
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            bad.append(BadRecord(line_number, f"not valid JSON ({error.msg} at column {error.colno})", label))
            continue
        if not isinstance(value, dict):
            bad.append(BadRecord(line_number, f"expected a JSON object, got {_json_type(value)}", label))
            continue
        records.append(Record(value, line_number, label))
    return records, bad


def _read_json_array(path: Path, label: str) -> tuple[list[Record], list[BadRecord]]:
    where = f"data.path {path}"
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise DataError(f"{where}: not valid UTF-8 (byte {error.start + 1}). Save the file as UTF-8.") from None
    decoder = json.JSONDecoder()
    position = _skip_space(text, 0)
    if position >= len(text) or text[position] != "[":
        raise DataError(
            f"{where}: a .json file must hold a JSON array of records ([{{...}}, {{...}}]). "
            "Wrap the records in [ ] or save one object per line as .jsonl."
        )
    # Walk the array element by element rather than json.loads() so every record keeps
    # the line it starts on; a broken element breaks the whole array, so that one raises.
    records: list[Record] = []
    bad: list[BadRecord] = []
    position = _skip_space(text, position + 1)
    if position < len(text) and text[position] == "]":
        return records, bad
    while True:
        line_number = text.count("\n", 0, position) + 1
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{where}: line {error.lineno}: not valid JSON ({error.msg} at column {error.colno}). "
                "A broken .json array cannot be partly read: fix the file, or save one record per line "
                "as .jsonl so broken lines are skipped."
            ) from None
        if isinstance(value, dict):
            records.append(Record(value, line_number, label))
        else:
            bad.append(BadRecord(line_number, f"expected a JSON object, got {_json_type(value)}", label))
        position = _skip_space(text, position)
        if position < len(text) and text[position] == ",":
            position = _skip_space(text, position + 1)
            continue
        if position < len(text) and text[position] == "]":
            break
        line_number = text.count("\n", 0, position) + 1
        raise DataError(f"{where}: line {line_number}: expected ',' or ']' in the JSON array. Fix the file.")
    if _skip_space(text, position + 1) != len(text):
        line_number = text.count("\n", 0, position + 1) + 1
        raise DataError(f"{where}: line {line_number}: extra data after the JSON array. Fix the file.")
    return records, bad


def _read_text(path: Path, label: str) -> tuple[list[Record], list[BadRecord]]:
    text = path.read_text(encoding="utf-8-sig", errors="replace")
    records: list[Record] = []
    document: list[str] = []
    start = 0
    for line_number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            if not document:
                start = line_number
            document.append(line)
        elif document:
            records.append(Record("\n".join(document), start, label))
            document = []
    if document:
        records.append(Record("\n".join(document), start, label))
    return records, []


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


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
        raise RecordError(f"'text' should be a string, got {_json_type(record['text'])} (text format)")
    return record["text"]


def _required_string(record: dict, key: str, fmt: str) -> str:
    if key not in record:
        raise RecordError(f"missing key '{key}' ({fmt} format)")
    value = record[key]
    if not isinstance(value, str):
        raise RecordError(f"'{key}' should be a string, got {_json_type(value)} ({fmt} format)")
    return value


def _instruction_pair(record: dict, fmt: str, *, prompt_key: str, extra_key: str, answer_key: str) -> list[dict]:
    instruction = _required_string(record, prompt_key, fmt)
    answer = _required_string(record, answer_key, fmt)
    # The extra field is optional in both formats and often null in exported datasets.
    extra = record.get(extra_key) or ""
    if not isinstance(extra, str):
        raise RecordError(f"'{extra_key}' should be a string, got {_json_type(extra)} ({fmt} format)")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def _turns(
    record: dict, fmt: str, *, list_key: str, role_key: str, content_key: str, roles: dict[str, str] | None
) -> list[dict]:
    if list_key not in record:
        raise RecordError(f"missing key '{list_key}' ({fmt} format)")
    turns = record[list_key]
    if not isinstance(turns, list):
        raise RecordError(f"'{list_key}' should be a list, got {_json_type(turns)} ({fmt} format)")
    if not turns:
        raise RecordError(f"'{list_key}' is empty ({fmt} format)")
    known = sorted(roles) if roles else list(CHAT_ROLES)
    messages = []
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise RecordError(f"{list_key}[{number}] should be an object, got {_json_type(turn)} ({fmt} format)")
        for key in (role_key, content_key):
            if key not in turn:
                raise RecordError(f"{list_key}[{number}] is missing key '{key}' ({fmt} format)")
        role, content = turn[role_key], turn[content_key]
        if not isinstance(content, str):
            raise RecordError(
                f"{list_key}[{number}].{content_key} should be a string, got {_json_type(content)} ({fmt} format)"
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
