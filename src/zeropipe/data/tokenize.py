"""Turning records into token ids with loss masks, and the memory-mapped token cache.

The launcher calls :func:`build_token_cache` once before any rank starts; every rank then
opens the same files through :class:`TokenDataset`, which memory-maps them, so a machine
holds one copy of the data in its page cache however many ranks it runs.

Labels are aligned with ``input_ids`` (the Hugging Face convention): the model shifts them
by one itself. ``IGNORE_INDEX`` marks tokens that carry no loss.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from zeropipe.data.formats import (
    BadRecord,
    RecordError,
    detect_format,
    read_located_records,
    to_conversation,
)
from zeropipe.data.split import RecordSplit
from zeropipe.errors import DataError

IGNORE_INDEX = -100

# The built-in template for tokenizers without a chat_template. The markers are special
# tokens in tokenizers made by zeropipe.data.tokenizer, so each is a single token.
PLAIN_SYSTEM = "<|system|>\n{content}\n"
PLAIN_USER = "<|user|>\n{content}\n"
PLAIN_ASSISTANT_PROMPT = "<|assistant|>\n"

CACHE_FILES = ("tokens.npy", "labels.npy", "offsets.npy", "cache.json")
BAD_RECORDS_KEPT = 50  # in cache.json: enough to fix a file, small enough to read
BAD_RECORDS_SHOWN = 5  # in the error message
TOKENIZE_BATCH = 1000  # records per call to the fast tokenizer, which parallelises a batch


@dataclass
class CacheInfo:
    """What went into a token cache."""

    format: str
    examples: int
    tokens: int
    loss_tokens: int
    bad_records: list[BadRecord]
    truncated: int  # conversations cut at max_seq_len
    dropped_empty: int  # examples with no token to learn from
    path: Path  # the cache directory
    source: Path | None = None  # data.path the cache was built from
    records: int = 0  # records read, good and bad
    max_seq_len: int = 0
    vocab_size: int = 0


@dataclass
class _Segment:
    """A piece of an example, tokenized on its own so its boundaries are the same in
    training and in :func:`render_prompt`."""

    text: str = ""
    ids: list[int] = field(default_factory=list)  # for tokens given by id (bos, eos)
    has_loss: bool = False


def render_example(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids and labels for one conversation; only assistant turns carry loss."""
    segments = _conversation_segments(tokenizer, messages, add_generation_prompt=False)
    texts = [segment.text for segment in segments]
    return _assemble(segments, _encode_texts(tokenizer, texts))


def pad_token_id(tokenizer: Any) -> int:
    """The id batches are padded with: the pad token, else EOS (padding is masked out of attention and loss)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Ids to generate the next assistant turn from, rendered exactly as in training."""
    segments = _conversation_segments(tokenizer, messages, add_generation_prompt=True)
    ids, _ = _assemble(segments, _encode_texts(tokenizer, [segment.text for segment in segments]))
    return ids


def _conversation_segments(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> list[_Segment]:
    if getattr(tokenizer, "chat_template", None):
        return _template_segments(tokenizer, messages, add_generation_prompt)
    return _plain_segments(tokenizer, messages, add_generation_prompt)


def _plain_segments(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> list[_Segment]:
    if tokenizer.eos_token_id is None:
        raise DataError(
            "the tokenizer has no eos token and no chat_template: the built-in template ends each assistant "
            "turn with eos so the model learns to stop. Use a tokenizer with an eos token or a chat_template."
        )
    segments = []
    if tokenizer.bos_token_id is not None:
        segments.append(_Segment(ids=[tokenizer.bos_token_id]))
    # Everything between two assistant replies is one prompt segment, so the text the model
    # sees before a reply is tokenized the same way whether it is training or generating.
    prompt = ""
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            prompt += PLAIN_SYSTEM.format(content=content)
        elif role == "user":
            prompt += PLAIN_USER.format(content=content)
        elif role == "assistant":
            segments.append(_Segment(text=prompt + PLAIN_ASSISTANT_PROMPT))
            segments.append(_Segment(text=content, has_loss=True))
            segments.append(_Segment(ids=[tokenizer.eos_token_id], has_loss=True))
            prompt = ""
        else:
            raise RecordError(f"unknown role '{role}'")
    if add_generation_prompt:
        prompt += PLAIN_ASSISTANT_PROMPT
    if prompt:
        segments.append(_Segment(text=prompt))
    return segments


def _template_segments(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> list[_Segment]:
    """Split the chat-template rendering into prompt and assistant pieces.

    For each assistant turn, the rendering of the conversation up to it (with the
    generation prompt) and through it tell where the reply starts and ends, and the
    reply's end includes whatever the template closes a turn with (eos, <|im_end|>...).
    Bos is left to the template: chat templates write it themselves when the model wants it.
    """
    from jinja2 import TemplateError

    def render(turns: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    try:
        full = render(messages, add_generation_prompt)
    except (TemplateError, ValueError) as error:
        # e.g. "Conversation roles must alternate user/assistant/user/assistant/..."
        raise RecordError(f"the tokenizer's chat_template rejected this conversation: {error}") from None
    segments = []
    cursor = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            before = render(messages[:index], True)
            through = render(messages[: index + 1], False)
        except (TemplateError, ValueError):
            # An assistant turn the template cannot render on its own (say, the first
            # message) stays in the prompt without loss rather than losing the record.
            continue
        # Templates that re-render earlier turns differently (some drop past reasoning)
        # are not prefix-stable; such a turn stays in the prompt without loss.
        if cursor <= len(before) and through.startswith(before) and full.startswith(through):
            segments.append(_Segment(text=full[cursor : len(before)]))
            segments.append(_Segment(text=full[len(before) : len(through)], has_loss=True))
            cursor = len(through)
    if cursor < len(full):
        segments.append(_Segment(text=full[cursor:]))
    return segments


def _encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids for each text, without the tokenizer adding bos/eos on its own."""
    wanted = [text for text in texts if text]
    encoded = iter(tokenizer(wanted, add_special_tokens=False)["input_ids"]) if wanted else iter(())
    return [list(next(encoded)) if text else [] for text in texts]


def _assemble(segments: list[_Segment], encoded: list[list[int]]) -> tuple[list[int], list[int]]:
    input_ids: list[int] = []
    labels: list[int] = []
    for segment, text_ids in zip(segments, encoded):
        ids = segment.ids + text_ids
        input_ids += ids
        labels += ids if segment.has_loss else [IGNORE_INDEX] * len(ids)
    return input_ids, labels


def _text_chunks(tokenizer: Any, text_ids: list[int], max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    if not text_ids:
        return [([], [])]  # an empty document teaches nothing; build_token_cache counts it as dropped
    ids = list(text_ids)
    if tokenizer.bos_token_id is not None:
        ids.insert(0, tokenizer.bos_token_id)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)  # marks where a document ends for the next one
    # Consecutive chunks overlap by one token: the first token of a chunk is never predicted
    # (nothing comes before it), so overlapping lets every token of the text be a target once.
    chunks = []
    start = 0
    while True:
        chunk = ids[start : start + max_seq_len]
        labels = list(chunk)
        if labels:
            labels[0] = IGNORE_INDEX
        chunks.append((chunk, labels))
        if start + max_seq_len >= len(ids):
            return chunks
        start += max_seq_len - 1


def build_token_cache(
    path: Path,
    tokenizer: Any,
    out_dir: Path,
    *,
    fmt: str = "auto",
    max_seq_len: int,
    max_bad_fraction: float = 0.01,
    max_bad_records: int | None = None,
    split: RecordSplit | None = None,
) -> CacheInfo:
    """Read, check and tokenize the data at ``path`` into ``out_dir``; run once per run, before ranks start.

    Args:
        fmt: ``"auto"`` or one of the format names in ``zeropipe.data.formats.FORMATS``.
        max_bad_fraction: share of malformed records tolerated before failing.
        max_bad_records: when given, a count used instead of ``max_bad_fraction``.
        split: keep only the training (or only the held-out) records of ``data.eval_fraction``.

    Raises:
        DataError: missing or unreadable data, too many malformed records, or nothing to train on.
    """
    path, out_dir = Path(path), Path(out_dir)
    if max_seq_len < 2:
        raise DataError(f"data.max_seq_len is {max_seq_len}; it must be at least 2 (one token to predict from).")
    records, bad = read_located_records(path)
    total = len(records) + len(bad)
    if total == 0:
        raise DataError(f"data.path {path}: no records found, only blank lines. Fix data.path or add data.")
    if not records:
        # Say "malformed" rather than "unknown format": there was nothing to detect from.
        _check_bad_records(path, bad, total, max_bad_fraction, max_bad_records)
        raise DataError(f"data.path {path}: all {total} records are malformed, first: {bad[0]}. Fix the file.")
    fmt = detect_format([record.value for record in records], fmt, source=path, bad=bad)
    if split is not None:
        records = split.select(records)

    # Rendering happens before the malformed-record check because a chat template can
    # reject a conversation (roles out of order), which makes that record malformed too.
    plans: list[list[_Segment] | str] = []
    for record in records:
        try:
            content = to_conversation(record.value, fmt)
            plans.append(content if isinstance(content, str) else _conversation_segments(tokenizer, content, False))
        except RecordError as error:
            bad.append(record.bad(str(error)))
    bad.sort(key=lambda item: (item.file, item.line_number))
    _check_bad_records(path, bad, total, max_bad_fraction, max_bad_records)

    token_arrays: list[np.ndarray] = []
    label_arrays: list[np.ndarray] = []
    truncated = dropped_empty = 0
    for start in range(0, len(plans), TOKENIZE_BATCH):
        batch = plans[start : start + TOKENIZE_BATCH]
        for input_ids, labels, was_truncated in _tokenize_batch(tokenizer, batch, max_seq_len):
            truncated += was_truncated
            if not any(label != IGNORE_INDEX for label in labels):
                dropped_empty += 1
                continue
            token_arrays.append(np.asarray(input_ids, dtype=np.int32))
            label_arrays.append(np.asarray(labels, dtype=np.int32))

    if not token_arrays:
        raise DataError(
            f"data.path {path}: no usable examples: {total} records, {len(bad)} malformed, "
            f"{dropped_empty} with nothing to learn from (empty responses or texts, or replies cut off by "
            f"data.max_seq_len {max_seq_len}). Check the file and data.max_seq_len."
        )
    lengths = np.array([len(array) for array in token_arrays], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate(token_arrays)
    labels = np.concatenate(label_arrays)
    info = CacheInfo(
        format=fmt,
        examples=len(token_arrays),
        tokens=int(tokens.size),
        loss_tokens=int(np.count_nonzero(labels != IGNORE_INDEX)),
        bad_records=bad,
        truncated=truncated,
        dropped_empty=dropped_empty,
        path=out_dir,
        source=path.resolve(),
        records=total,
        max_seq_len=max_seq_len,
        vocab_size=len(tokenizer),
    )
    _write_cache(out_dir, tokens, labels, offsets, info)
    return info


def _tokenize_batch(
    tokenizer: Any, plans: list[list[_Segment] | str], max_seq_len: int
) -> list[tuple[list[int], list[int], bool]]:
    """``(input_ids, labels, truncated)`` per example; a text record may give several chunks."""
    # One tokenizer call for the whole batch: the fast tokenizer runs it in parallel.
    texts: list[str] = []
    for plan in plans:
        texts += [plan] if isinstance(plan, str) else [segment.text for segment in plan]
    encoded = iter(_encode_texts(tokenizer, texts))

    examples = []
    for plan in plans:
        if isinstance(plan, str):
            for chunk, labels in _text_chunks(tokenizer, next(encoded), max_seq_len):
                examples.append((chunk, labels, False))
            continue
        input_ids, labels = _assemble(plan, [next(encoded) for _ in plan])
        was_truncated = len(input_ids) > max_seq_len
        input_ids, labels = input_ids[:max_seq_len], labels[:max_seq_len]
        if labels:
            labels[0] = IGNORE_INDEX  # never a target after the model's shift; keeps loss_tokens honest
        examples.append((input_ids, labels, was_truncated))
    return examples


def _check_bad_records(
    path: Path, bad: list[BadRecord], total: int, max_bad_fraction: float, max_bad_records: int | None
) -> None:
    # With the exact setting that would skip them: users should not have to do the arithmetic.
    if max_bad_records is not None:
        if len(bad) <= max_bad_records:
            return
        limit = f"{len(bad)} > data.max_bad_records {max_bad_records}"
        enough = f"data.max_bad_records={len(bad)}"
    else:
        if len(bad) <= max_bad_fraction * total:
            return
        limit = f"{100 * len(bad) / total:.3g}% > data.max_bad_fraction {100 * max_bad_fraction:.3g}%"
        enough = f"data.max_bad_fraction={math.ceil(1000 * len(bad) / total) / 1000:g} (or data.max_bad_records={len(bad)})"
    first = ", ".join(str(item) for item in bad[:BAD_RECORDS_SHOWN])
    raise DataError(
        f"data.path {path}: {len(bad)} of {total} records are malformed ({limit}); first ones: {first}. "
        f"Fix the file, or skip them with {enough}; each skipped record is listed when the run starts."
    )


def describe_cache(info: dict[str, Any], source: Path, format_setting: str) -> list[str]:
    """What the launcher says about the data it prepared: the format, and what max_seq_len cut."""
    detected = "detected" if format_setting == "auto" else "data.format"
    notes = [f"data: {info['examples']} examples from {info.get('records', info['examples'])} records of {source} ({info['format']} format, {detected})"]
    limit = info.get("max_seq_len")
    if info.get("truncated"):
        notes.append(
            f"{info['truncated']} conversation(s) were longer than data.max_seq_len {limit} tokens and were cut there "
            "(their ends are not trained on): raise data.max_seq_len to keep them whole"
        )
    if info.get("dropped_empty"):
        notes.append(
            f"{info['dropped_empty']} example(s) were dropped with nothing to learn from (an empty reply, or one that "
            f"starts beyond data.max_seq_len {limit} tokens)"
        )
    return notes


def _write_cache(out_dir: Path, tokens: np.ndarray, labels: np.ndarray, offsets: np.ndarray, info: CacheInfo) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # cache.json is written last and its presence means the cache is complete: remove an old
    # one first so a crash halfway never leaves old metadata beside new arrays.
    (out_dir / "cache.json").unlink(missing_ok=True)
    for name, array in (("tokens.npy", tokens), ("labels.npy", labels), ("offsets.npy", offsets)):
        _replace_atomically(out_dir / name, lambda handle, array=array: np.save(handle, array), binary=True)
    metadata = {
        "format": info.format,
        "source": str(info.source),
        "records": info.records,
        "examples": info.examples,
        "tokens": info.tokens,
        "loss_tokens": info.loss_tokens,
        "truncated": info.truncated,
        "dropped_empty": info.dropped_empty,
        "max_seq_len": info.max_seq_len,
        "vocab_size": info.vocab_size,
        "bad_record_count": len(info.bad_records),
        "bad_records": [item.to_json() for item in info.bad_records[:BAD_RECORDS_KEPT]],
    }
    _replace_atomically(out_dir / "cache.json", lambda handle: handle.write(json.dumps(metadata, indent=2) + "\n"))


def _replace_atomically(target: Path, write, binary: bool = False) -> None:
    temporary = target.with_name(target.name + ".partial")
    with open(temporary, "wb" if binary else "w", encoding=None if binary else "utf-8") as handle:
        write(handle)
    os.replace(temporary, target)


def load_cache_info(cache_dir: Path) -> CacheInfo:
    """The :class:`CacheInfo` of a finished cache (the first 50 bad records only)."""
    cache_dir = Path(cache_dir)
    metadata = json.loads(_require_cache(cache_dir, "cache.json").read_text(encoding="utf-8"))
    return CacheInfo(
        format=metadata["format"],
        examples=metadata["examples"],
        tokens=metadata["tokens"],
        loss_tokens=metadata["loss_tokens"],
        bad_records=[BadRecord(item["line"], item["reason"], item["file"]) for item in metadata["bad_records"]],
        truncated=metadata["truncated"],
        dropped_empty=metadata["dropped_empty"],
        path=cache_dir,
        source=Path(metadata["source"]),
        records=metadata["records"],
        max_seq_len=metadata["max_seq_len"],
        vocab_size=metadata["vocab_size"],
    )


def _require_cache(cache_dir: Path, name: str) -> Path:
    file = cache_dir / name
    if not file.is_file() or not (cache_dir / "cache.json").is_file():
        raise DataError(
            f"token cache {cache_dir} is missing or incomplete (no {name} or cache.json). "
            "It is built by the launcher before the ranks start: start the run again to rebuild it."
        )
    return file


class TokenDataset(Dataset):
    """The examples of a token cache, read through memory maps shared by every rank."""

    def __init__(self, cache_dir: Path):
        self.cache_dir = Path(cache_dir)
        self._open()

    def _open(self) -> None:
        self._tokens = np.load(_require_cache(self.cache_dir, "tokens.npy"), mmap_mode="r")
        self._labels = np.load(_require_cache(self.cache_dir, "labels.npy"), mmap_mode="r")
        self._offsets = np.load(_require_cache(self.cache_dir, "offsets.npy"), mmap_mode="r")

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} out of range for {len(self)} examples")
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
        return {
            "input_ids": torch.from_numpy(self._tokens[start:end].astype(np.int64)),
            "labels": torch.from_numpy(self._labels[start:end].astype(np.int64)),
        }

    def lengths(self) -> np.ndarray:
        """Tokens per example, for length-grouped batching and token counts."""
        return np.diff(self._offsets)

    # DataLoader workers receive the dataset pickled; send the directory and map it again
    # there, instead of pickling the arrays' contents.
    def __getstate__(self) -> dict[str, Any]:
        return {"cache_dir": self.cache_dir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.cache_dir = state["cache_dir"]
        self._open()


def pad_right(batch: list[dict[str, torch.Tensor]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(input_ids, labels, lengths)`` of a batch padded on the right to its longest row; padded labels carry no loss."""
    if not batch:
        raise ValueError("cannot collate an empty batch")
    lengths = [len(example["input_ids"]) for example in batch]
    longest = max(lengths)
    input_ids = torch.full((len(batch), longest), pad_token_id, dtype=torch.long)
    labels = torch.full((len(batch), longest), IGNORE_INDEX, dtype=torch.long)
    for row, (example, length) in enumerate(zip(batch, lengths)):
        input_ids[row, :length] = example["input_ids"]
        labels[row, :length] = example["labels"]
    return input_ids, labels, lengths


def collate(batch: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Examples padded on the right to the longest one, with the attention mask of the real tokens."""
    input_ids, labels, lengths = pad_right(batch, pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
