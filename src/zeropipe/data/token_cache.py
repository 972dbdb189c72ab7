"""The memory-mapped token cache: built once from the records, then read by every rank.

The launcher calls :func:`build_token_cache` once before any rank starts (the records turned
into token ids by ``data.tokenize``, on worker processes a batch at a time); every rank then
opens the same files through :class:`TokenDataset`, which memory-maps them, so a machine
holds one copy of the data in its page cache however many ranks it runs.
"""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from zeropipe.data.formats import DETECTION_SAMPLE, RecordError, detect_format, to_conversation
from zeropipe.data.records import SAMPLE_MOST_BAD, BadRecord, Record, iter_records, sample_records
from zeropipe.data.split import RecordSplit
from zeropipe.data.tokenize import IGNORE_INDEX, Segment, conversation_segments, tokenize_batch
from zeropipe.errors import DataError

TOKEN_CACHE_ARRAYS = ("tokens.npy", "loss_mask.npy", "offsets.npy")
CACHE_FILES = (*TOKEN_CACHE_ARRAYS, "cache.json")
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
    bad_record_count: int = 0  # all of them; bad_records holds the first BAD_RECORDS_KEPT


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
    columns: Mapping[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
    num_workers: int = 1,
) -> CacheInfo:
    """Read, check and tokenize the data at ``path`` into ``out_dir``; run once per run, before ranks start.

    The records are streamed a batch at a time from reading to the cache files: the
    launcher's memory is that of one batch (and the malformed records kept for the report),
    whatever the size of the data.

    Args:
        fmt: ``"auto"`` (detected from the first records) or a name in ``zeropipe.data.formats.FORMATS``.
        max_bad_fraction: share of malformed records tolerated before failing.
        max_bad_records: when given, a count used instead of ``max_bad_fraction``.
        split: keep only the training (or only the held-out) records of ``data.eval_fraction``.
        columns: ZeRO-Pipe's key -> the dataset's column (``data.columns``).
        progress: called with the number of records read after each batch.
        num_workers: processes that render and tokenize batches side by side (1: this process);
            the cache is the same whatever the number.

    Raises:
        DataError: missing or unreadable data, too many malformed records, or nothing to train on.
    """
    path, out_dir = Path(path), Path(out_dir)
    if max_seq_len < 2:
        raise DataError(f"data.max_seq_len is {max_seq_len}; it must be at least 2 (one token to predict from).")
    sample, sample_bad = sample_records(path, columns, DETECTION_SAMPLE)
    if not sample and not sample_bad:
        raise DataError(f"data.path {path}: no records found: the file is empty or holds only blank lines. Fix data.path or add data.")
    if not sample:
        # Say "malformed" rather than "unknown format": there was nothing to detect from.
        total = len(sample_bad)
        partial = total >= SAMPLE_MOST_BAD
        _check_bad_records(path, BadRecords.of(sample_bad), total, max_bad_fraction, max_bad_records, partial=partial)
        which = f"the first {total}" if partial else f"all {total}"
        raise DataError(f"data.path {path}: {which} records are malformed, first: {sample_bad[0]}. Fix the file.")
    fmt = detect_format([record.value for record in sample], fmt, source=path, bad=sample_bad)
    del sample, sample_bad
    vocab_size = len(tokenizer)
    tokenizer = PreparedTokenizer(tokenizer)

    items = iter_records(path, columns)
    good_records = None
    if split is not None:
        # The split draws positions among the good records, so they are counted first: one
        # more pass over the file (reading only, no tokenizing) buys the same split as when
        # the records were all held, for the same data and seed.
        good_records = sum(1 for item in iter_records(path, columns) if isinstance(item, Record))
        items = _split_records(items, split, good_records)
    bad = BadRecords()
    total = truncated = dropped_empty = 0
    writer = TokenCacheWriter(out_dir, vocab_size)
    work = _BatchWork(tokenizer, fmt, max_seq_len)
    try:
        for done in _map_batches(work, _batches(items, TOKENIZE_BATCH), num_workers):
            if max_bad_records is not None and bad.count > max_bad_records:
                # Already too many, and there is more to read: no need to tokenize the rest.
                _check_bad_records(path, bad, total, max_bad_fraction, max_bad_records, partial=True)
            for item in done.bad:
                bad.add(item)
            total += done.records
            truncated += done.truncated
            dropped_empty += done.dropped_empty
            writer.add_batch(done.tokens, done.loss_mask, done.lengths)
            if progress is not None:
                progress(total)
        if good_records is not None:
            total = good_records + bad.count  # every record read, on both sides of the split, as max_bad_fraction counts them
        _check_bad_records(path, bad, total, max_bad_fraction, max_bad_records)
        writer.flush()
        if not writer.examples:
            raise DataError(
                f"data.path {path}: no usable examples: {total} records, {bad.count} malformed, "
                f"{dropped_empty} with nothing to learn from (empty responses or texts, or replies cut off by "
                f"data.max_seq_len {max_seq_len}). Check the file and data.max_seq_len."
            )
        info = CacheInfo(
            format=fmt,
            examples=writer.examples,
            tokens=writer.tokens,
            loss_tokens=writer.loss_tokens,
            bad_records=bad.kept,
            truncated=truncated,
            dropped_empty=dropped_empty,
            path=out_dir,
            source=path.resolve(),
            records=total,
            max_seq_len=max_seq_len,
            vocab_size=vocab_size,
            bad_record_count=bad.count,
        )
        writer.finish(info)
    finally:
        writer.close()
    return info


@dataclass
class _DoneBatch:
    """A batch of records rendered and tokenized: its examples end to end, and what was skipped."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    lengths: np.ndarray
    bad: list[BadRecord]
    records: int
    truncated: int
    dropped_empty: int


class _BatchWork:
    """Turns a batch of records into tokens and loss masks; run in this process or in a worker."""

    def __init__(self, tokenizer: PreparedTokenizer, fmt: str, max_seq_len: int):
        self.tokenizer, self.fmt, self.max_seq_len = tokenizer, fmt, max_seq_len

    def __call__(self, batch: list[Record | BadRecord]) -> _DoneBatch:
        # Rendering comes before the malformed-record check because a chat template can
        # reject a conversation (roles out of order), which makes that record malformed too.
        plans: list[list[Segment] | str] = []
        bad: list[BadRecord] = []
        for item in batch:
            if isinstance(item, BadRecord):
                bad.append(item)
                continue
            try:
                content = to_conversation(item.value, self.fmt)
                plans.append(content if isinstance(content, str) else conversation_segments(self.tokenizer, content, False))
            except RecordError as error:
                bad.append(item.bad(str(error)))
        tokens: list[int] = []
        labels: list[int] = []
        lengths: list[int] = []
        truncated = 0
        for input_ids, example_labels, was_truncated in tokenize_batch(self.tokenizer, plans, self.max_seq_len):
            truncated += was_truncated
            tokens += input_ids
            labels += example_labels
            lengths.append(len(input_ids))
        # Whole-batch arrays rather than a Python test per token: the mask, and which examples
        # have a token to learn from (the others are dropped).
        token_array = np.asarray(tokens, dtype=np.int64)
        mask = np.asarray(labels, dtype=np.int64) != IGNORE_INDEX
        length_array = np.asarray(lengths, dtype=np.int64)
        starts = np.cumsum(length_array) - length_array
        nonempty = length_array > 0
        keep = np.zeros(len(length_array), dtype=bool)
        keep[nonempty] = np.add.reduceat(mask, starts[nonempty]) > 0 if nonempty.any() else False
        if not keep.all():
            kept_tokens = np.repeat(keep, length_array)
            token_array, mask = token_array[kept_tokens], mask[kept_tokens]
        return _DoneBatch(
            token_array, mask.astype(np.uint8), length_array[keep],
            bad, len(batch), truncated, int((~keep).sum()),
        )  # fmt: skip


_WORKER_TASK: _BatchWork | None = None  # a worker's copy, inherited when the pool forks


def _run_in_worker(batch: list[Record | BadRecord]) -> _DoneBatch:
    assert _WORKER_TASK is not None
    return _WORKER_TASK(batch)


def _start_worker() -> None:
    # Each worker is one of the processes sharing the cores: its tokenizer runs on one thread.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # A forked worker inherits the launcher's Python signal handlers (the supervisor's and the
    # curriculum's turn SIGTERM into KeyboardInterrupt, or only note it): Pool.terminate's SIGTERM
    # must end the worker, and a Ctrl-C is the launcher's to handle (it terminates the pool).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _map_batches(work: _BatchWork, batches: Iterator[list], num_workers: int) -> Iterator[_DoneBatch]:
    """``work`` over the batches in order; with workers, a few batches in flight at a time, never the dataset.

    ``multiprocessing.Pool.imap`` would read its input as fast as it can (the whole file into
    the queue), so batches are handed out here, at most two per worker ahead of the writer.
    """
    if num_workers <= 1:
        yield from map(work, batches)
        return
    import multiprocessing
    from collections import deque

    global _WORKER_TASK
    _WORKER_TASK = work
    pool = multiprocessing.get_context("fork").Pool(num_workers, initializer=_start_worker)
    finished = False
    try:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_run_in_worker, (batch,)))
            if len(pending) >= 2 * num_workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        finished = True
    finally:
        # Done: the workers leave on the pool's own end-of-work message. Stopped or failed: killed.
        # (A worker blocked on the task queue's lock while terminate() held it, its SIGTERM taken
        # by an inherited handler, once left the launcher waiting in join() for good.)
        if finished:
            pool.close()
        else:
            pool.terminate()
        pool.join()
        _WORKER_TASK = None


MOST_DEFAULT_WORKERS = 8  # past this one reading process feeds the workers no faster; each worker costs its own memory


def default_workers() -> int:
    """Processes for data preparation: the launcher's cores (the ranks start after it is done), at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, MOST_DEFAULT_WORKERS))


class PreparedTokenizer:
    """A tokenizer as data preparation calls it, a million times: the same ids, less overhead.

    Its special ids are read once (each read of ``tokenizer.eos_token_id`` converts the token
    again: a tenth of the preparation's time in a profile), and a fast tokenizer without
    truncation or padding of its own is called through its Rust tokenizer, skipping the
    per-text ``BatchEncoding`` conversion. Anything else falls back to the tokenizer itself.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.bos_token_id = tokenizer.bos_token_id
        self.eos_token_id = tokenizer.eos_token_id
        self.chat_template = getattr(tokenizer, "chat_template", None)
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if backend is not None and (backend.truncation is not None or backend.padding is not None):
            backend = None  # transformers turns those off for the call; the Rust tokenizer would apply them
        self._backend = backend

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        if self._backend is None:
            return self.tokenizer(texts, add_special_tokens=add_special_tokens)
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        return {"input_ids": [encoding.ids for encoding in encode(texts, add_special_tokens=add_special_tokens)]}


class BadRecords:
    """The malformed records of a dataset: all counted, the first ones kept for the report."""

    def __init__(self, keep: int = BAD_RECORDS_KEPT):
        self.keep = keep
        self.count = 0
        self.kept: list[BadRecord] = []

    @classmethod
    def of(cls, items: list[BadRecord]) -> BadRecords:
        bad = cls()
        for item in items:
            bad.add(item)
        return bad

    def add(self, item: BadRecord) -> None:
        self.count += 1
        if len(self.kept) < self.keep:
            self.kept.append(item)


def _batches(items: Iterable, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _split_records(items: Iterator[Record | BadRecord], split: RecordSplit, good_records: int) -> Iterator[Record | BadRecord]:
    """The records of one side of ``split`` (of ``good_records`` good ones); malformed records pass through to be counted."""
    held = split.held_out_positions(good_records)  # a set of the held-out share only
    position = 0
    for item in items:
        if isinstance(item, BadRecord):
            yield item
            continue
        if (position in held) == split.held_out:
            yield item
        position += 1


class TokenCacheWriter:
    """Appends examples to the cache files as they come, so no dataset is ever held.

    Tokens are stored as uint16 when every id fits (vocabulary <= 65,536), else uint32;
    instead of int32 labels a one-byte loss mask says which tokens are targets (a label is
    always either its token or ``IGNORE_INDEX``, so the mask loses nothing). Each ``.npy``
    file is written with a header for a placeholder length, rewritten with the real length
    at the end: the arrays are valid ``.npy`` files that :class:`TokenDataset` memory-maps.
    """

    def __init__(self, out_dir: Path, vocab_size: int):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # cache.json is written last and its presence means the cache is complete: remove an
        # old one first so a crash halfway never leaves old metadata beside new arrays.
        (self.out_dir / "cache.json").unlink(missing_ok=True)
        self.token_dtype = token_dtype(vocab_size)
        self.examples = self.tokens = self.loss_tokens = 0
        self._files = {
            "tokens.npy": _NpyAppender(self.out_dir / "tokens.npy", self.token_dtype),
            "loss_mask.npy": _NpyAppender(self.out_dir / "loss_mask.npy", np.dtype(np.uint8)),
            "offsets.npy": _NpyAppender(self.out_dir / "offsets.npy", np.dtype(np.int64)),
        }
        self._files["offsets.npy"].append(np.zeros(1, dtype=np.int64))
        self._pending_ids: list[int] = []
        self._pending_mask: list[bool] = []
        self._pending_ends: list[int] = []

    def add_batch(self, tokens: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray) -> None:
        """Examples end to end (``lengths`` tokens each), with their loss mask."""
        self.flush()
        if not len(lengths):
            return
        if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(self.token_dtype).max):
            raise DataError(f"token id {int(tokens.max())} does not fit the cache's {self.token_dtype}: the tokenizer's vocabulary is larger than its length says")
        self._files["tokens.npy"].append(tokens.astype(self.token_dtype))
        self._files["loss_mask.npy"].append(loss_mask)
        self._files["offsets.npy"].append(self.tokens + np.cumsum(lengths))
        self.examples += len(lengths)
        self.tokens += int(tokens.size)
        self.loss_tokens += int(loss_mask.sum())

    def add(self, input_ids: list[int], labels: list[int]) -> None:
        self._pending_ids += input_ids
        self._pending_mask += [label != IGNORE_INDEX for label in labels]
        self._pending_ends.append(self.tokens + len(self._pending_ids))
        if len(self._pending_ids) >= 1 << 20:
            self.flush()

    def flush(self) -> None:
        if not self._pending_ends:
            return
        ids = np.asarray(self._pending_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(self.token_dtype).max):
            raise DataError(f"token id {int(ids.max())} does not fit the cache's {self.token_dtype}: the tokenizer's vocabulary is larger than its length says")
        mask = np.asarray(self._pending_mask, dtype=np.uint8)
        self._files["tokens.npy"].append(ids.astype(self.token_dtype))
        self._files["loss_mask.npy"].append(mask)
        self._files["offsets.npy"].append(np.asarray(self._pending_ends, dtype=np.int64))
        self.examples += len(self._pending_ends)
        self.tokens += int(ids.size)
        self.loss_tokens += int(mask.sum())
        self._pending_ids, self._pending_mask, self._pending_ends = [], [], []

    def finish(self, info: CacheInfo) -> None:
        """Complete the arrays and write cache.json (which marks the cache complete)."""
        self.flush()
        info.examples, info.tokens, info.loss_tokens = self.examples, self.tokens, self.loss_tokens
        for appender in self._files.values():
            appender.finish()
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
            "token_dtype": self.token_dtype.name,
            "bad_record_count": info.bad_record_count,
            "bad_records": [item.to_json() for item in info.bad_records[:BAD_RECORDS_KEPT]],
        }
        _replace_atomically(self.out_dir / "cache.json", lambda handle: handle.write(json.dumps(metadata, indent=2) + "\n"))

    def close(self) -> None:
        for appender in self._files.values():
            appender.close()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits (vocabulary <= 65,536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class _NpyAppender:
    """A 1-D ``.npy`` file written by appending, its header fixed once the length is known."""

    HEADER_BYTES = 128  # room for any 1-D shape; numpy aligns headers to 64 bytes

    def __init__(self, target: Path, dtype: np.dtype):
        self.target = target
        self.dtype = dtype
        self.length = 0
        self.partial = target.with_name(target.name + ".partial")
        self.handle = open(self.partial, "wb")
        self.handle.write(self._header(0))

    def _header(self, length: int) -> bytes:
        header = repr({"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (length,)})
        prefix = b"\x93NUMPY\x01\x00"
        room = self.HEADER_BYTES - len(prefix) - 2
        text = header.encode("latin1").ljust(room - 1) + b"\n"
        return prefix + room.to_bytes(2, "little") + text

    def append(self, array: np.ndarray) -> None:
        self.handle.write(np.ascontiguousarray(array, dtype=self.dtype).tobytes())
        self.length += len(array)

    def finish(self) -> None:
        self.handle.seek(0)
        self.handle.write(self._header(self.length))
        self.handle.close()
        os.replace(self.partial, self.target)

    def close(self) -> None:
        if not self.handle.closed:
            self.handle.close()
            self.partial.unlink(missing_ok=True)


def _check_bad_records(
    path: Path, bad: BadRecords, total: int, max_bad_fraction: float, max_bad_records: int | None, partial: bool = False
) -> None:
    # With the exact setting that would skip them: users should not have to do the arithmetic.
    count = bad.count
    if max_bad_records is not None:
        if count <= max_bad_records:
            return
        limit = f"{count} > data.max_bad_records {max_bad_records}"
        enough = f"data.max_bad_records={count}" if not partial else f"a larger data.max_bad_records (more than {count})"
    else:
        if count <= max_bad_fraction * total:
            return
        limit = f"{100 * count / total:.3g}% > data.max_bad_fraction {100 * max_bad_fraction:.3g}%"
        enough = f"data.max_bad_fraction={math.ceil(1000 * count / total) / 1000:g} (or data.max_bad_records={count})"
    first = ", ".join(str(item) for item in bad.kept[:BAD_RECORDS_SHOWN])
    of = f"the first {total} records read" if partial else f"{total} records"
    raise DataError(
        f"data.path {path}: {count} of {of} are malformed ({limit}); first ones: {first}. "
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
        bad_records=[BadRecord(item["line"], item["reason"], item["file"], item.get("unit", "line")) for item in metadata["bad_records"]],
        truncated=metadata["truncated"],
        dropped_empty=metadata["dropped_empty"],
        path=cache_dir,
        source=Path(metadata["source"]),
        records=metadata["records"],
        max_seq_len=metadata["max_seq_len"],
        vocab_size=metadata["vocab_size"],
        bad_record_count=metadata.get("bad_record_count", len(metadata["bad_records"])),
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
        if (self.cache_dir / "labels.npy").is_file() and not (self.cache_dir / "loss_mask.npy").is_file():
            # A cache written before the loss mask (int32 labels beside int32 tokens): a run resumed on it still reads it.
            self._labels, self._loss_mask = np.load(self.cache_dir / "labels.npy", mmap_mode="r"), None
        else:
            self._labels, self._loss_mask = None, np.load(_require_cache(self.cache_dir, "loss_mask.npy"), mmap_mode="r")
        self._offsets = np.load(_require_cache(self.cache_dir, "offsets.npy"), mmap_mode="r")

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} out of range for {len(self)} examples")
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
        input_ids = torch.from_numpy(self._tokens[start:end].astype(np.int64))
        if self._loss_mask is None:
            labels = torch.from_numpy(self._labels[start:end].astype(np.int64))
        else:
            # A target is its own token (the model shifts labels itself); the rest carries no loss.
            labels = torch.where(torch.from_numpy(self._loss_mask[start:end].astype(np.bool_)), input_ids, IGNORE_INDEX)
        return {"input_ids": input_ids, "labels": labels}

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
