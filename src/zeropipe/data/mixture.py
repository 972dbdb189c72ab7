"""``data.mixture``: several datasets drawn into one training file by weight, once, before training.

Each source is read and checked like ``data.path`` (malformed records are counted against
``data.max_bad_fraction`` per source), turned into conversations (or texts), and then the
mixture is drawn with ``run.seed``: source k gives ``round(N * w_k / sum(w))`` examples, its
records shuffled and repeated as many times as that takes, and the whole is shuffled.
Sources are streamed (see :func:`build_mixture`): a mixture of millions of records holds
their offsets, not the records.
Writing the result as one chat-format JSONL file keeps everything after it (tokenizer
training, the token cache, packing, the held-out split) exactly as for a single file.
"""

from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zeropipe.config.schema import DataSection
from zeropipe.data.formats import DETECTION_SAMPLE, RecordError, detect_format, to_conversation
from zeropipe.data.records import BadRecord, iter_records, sample_records
from zeropipe.data.synthetic import generate_dataset
from zeropipe.errors import DataError

MIXTURE_FILE = "mixture.jsonl"
SUMMARY_FILE = "mixture.json"


def spec_of(data: DataSection, seed: int) -> dict[str, Any]:
    assert data.mixture is not None
    return {"sources": [source.model_dump(mode="json") for source in data.mixture], "examples": data.mixture_examples, "seed": seed}


def build_mixture(data: DataSection, out_dir: Path, seed: int) -> Path:
    """Draw ``data.mixture`` into ``out_dir/mixture.jsonl`` (reused when already drawn from the same spec).

    Each source is streamed once into a spool file of converted records (one JSON line each)
    while only their byte offsets are kept; the draw is then a shuffled array of (source,
    offset) pairs, and the mixture is written by reading those lines back. Memory is bounded by
    the offsets (16 bytes a drawn example), not by the records.

    Raises:
        DataError: a source is missing, unreadable, has too many malformed records, or the
            sources mix plain text with conversations.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path, summary_file = out_dir / MIXTURE_FILE, out_dir / SUMMARY_FILE
    spec = spec_of(data, seed)
    if path.is_file() and summary_file.is_file():
        try:
            if json.loads(summary_file.read_text()).get("spec") == spec:
                return path
        except json.JSONDecodeError:
            pass
    assert data.mixture is not None
    sources = [read_source(index, source, data, out_dir, seed) for index, source in enumerate(data.mixture)]
    try:
        kinds = {source.label: source.is_text for source in sources}
        if len(set(kinds.values())) > 1:
            texts = [label for label, is_text in kinds.items() if is_text]
            raise DataError(
                f"data.mixture mixes plain text ({', '.join(texts)}) with conversations: a run trains on one or the other. "
                "Mix texts with texts and instructions or chats with each other"
            )
        total = data.mixture_examples or sum(len(source.offsets) for source in sources)
        counts = apportion(total, [source.weight for source in sources])
        rng = np.random.default_rng(seed)
        drawn_sources, drawn_offsets, rows = [], [], []
        for number, (source, count) in enumerate(zip(sources, counts)):
            drawn_offsets.append(source.offsets[draw(len(source.offsets), count, rng)])
            drawn_sources.append(np.full(count, number, dtype=np.int32))
            records = len(source.offsets)
            rows.append({"source": source.label, "weight": source.weight, "records": records, "drawn": count, "passes": round(count / records, 2)})
        order = rng.permutation(sum(counts))
        which, where = np.concatenate(drawn_sources)[order], np.concatenate(drawn_offsets)[order]
        partial = path.with_name(path.name + ".partial")
        spools = [source.spool.open("rb") for source in sources]
        try:
            with partial.open("wb") as out:
                for number, offset in zip(which.tolist(), where.tolist()):
                    spool = spools[number]
                    spool.seek(offset)
                    out.write(spool.readline())
        finally:
            for spool in spools:
                spool.close()
        partial.replace(path)
    finally:
        for source in sources:
            source.spool.unlink(missing_ok=True)
    summary_file.write_text(json.dumps({"spec": spec, "examples": int(sum(counts)), "sources": rows}, indent=2))
    return path


@dataclass
class Source:
    """One source streamed into its spool file: the byte offset of each usable record's line."""

    label: str
    weight: float
    spool: Path
    offsets: np.ndarray
    is_text: bool


def read_source(index: int, source, data: DataSection, out_dir: Path, seed: int) -> Source:
    """Stream one source: check and convert each record, spool it, keep its offset.

    Malformed records are counted as they stream by (the first one by file and line is kept
    for the message), against the source's ``data.max_bad_fraction`` / ``max_bad_records``.
    """
    key = f"data.mixture[{index}]"
    if source.synthetic is not None:
        label = f"synthetic {source.synthetic.task}"
        file = out_dir / f"mixture-{index}-{source.synthetic.task}.jsonl"
        if not file.is_file():
            generate_dataset(source.synthetic.task, source.synthetic.examples, source.synthetic.seed, file)
    else:
        label = str(source.path)
        file = Path(source.path).expanduser()
    try:
        sample, sample_bad = sample_records(file, source.columns, DETECTION_SAMPLE)
        if not sample:
            raise DataError(f"no usable records ({len(sample_bad)} malformed)")
        fmt = detect_format([record.value for record in sample], source.format)
    except DataError as err:
        raise DataError(f"{key} ({label}): {err}") from None
    del sample, sample_bad
    spool = out_dir / f"mixture-{index}.spool.jsonl"
    offsets = array("q")
    bad_count, first_bad, is_text = 0, None, None

    def count_bad(item: BadRecord) -> None:
        nonlocal bad_count, first_bad
        bad_count += 1
        if first_bad is None or (item.file, item.line_number) < (first_bad.file, first_bad.line_number):
            first_bad = item

    try:
        with spool.open("wb") as out:
            for item in iter_records(file, source.columns):
                if isinstance(item, BadRecord):
                    count_bad(item)
                    continue
                try:
                    converted = to_conversation(item.value, fmt)
                except RecordError as error:
                    count_bad(item.bad(str(error)))
                    continue
                if is_text is None:
                    is_text = isinstance(converted, str)
                offsets.append(out.tell())
                line = {"text": converted} if isinstance(converted, str) else {"messages": converted}
                out.write((json.dumps(line) + "\n").encode("utf-8"))
    except DataError as err:
        spool.unlink(missing_ok=True)
        raise DataError(f"{key} ({label}): {err}") from None
    total = len(offsets) + bad_count
    allowed = data.max_bad_records if data.max_bad_records is not None else math.floor(data.max_bad_fraction * total)
    if bad_count > allowed or not offsets:
        spool.unlink(missing_ok=True)
        if first_bad is None:
            raise DataError(f"{key} ({label}): no usable records")
        raise DataError(
            f"{key} ({label}): {bad_count} of {total} records are malformed (first: {first_bad}), more than the {allowed} "
            "data.max_bad_fraction / data.max_bad_records allow: fix the file or raise the limit"
        )
    return Source(label, source.weight, spool, np.frombuffer(offsets, dtype=np.int64), bool(is_text))


def apportion(total: int, weights: list[float]) -> list[int]:
    """Split ``total`` in proportion to ``weights`` (largest remainders), every source at least one example."""
    scale = sum(weights)
    exact = [total * weight / scale for weight in weights]
    counts = [math.floor(value) for value in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return [max(1, count) for count in counts]


def draw(records: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` indices into ``records``: whole shuffled passes, then part of one more."""
    passes, rest = divmod(count, records)
    parts = [rng.permutation(records) for _ in range(passes)]
    if rest:
        parts.append(rng.permutation(records)[:rest])
    return np.concatenate(parts)


def mixture_note(out_dir: Path) -> str | None:
    """One line for the launcher's notes: what the drawn mixture holds."""
    try:
        summary = json.loads((Path(out_dir) / SUMMARY_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    parts = [f"{row['drawn']} from {row['source']} ({row['records']} records, {row['passes']} passes)" for row in summary["sources"]]
    return f"data.mixture: {summary['examples']} examples: " + ", ".join(parts)
