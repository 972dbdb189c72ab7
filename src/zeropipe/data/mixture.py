"""``data.mixture``: several datasets drawn into one training file by weight, once, before training.

Each source is read and checked like ``data.path`` (malformed records are counted against
``data.max_bad_fraction`` per source), turned into conversations (or texts), and then the
mixture is drawn with ``run.seed``: source k gives ``round(N * w_k / sum(w))`` examples, its
records shuffled and repeated as many times as that takes, and the whole is shuffled.
Writing the result as one chat-format JSONL file keeps everything after it (tokenizer
training, the token cache, packing, the held-out split) exactly as for a single file.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from zeropipe.config.schema import DataSection
from zeropipe.data.formats import RecordError, detect_format, read_located_records, to_conversation
from zeropipe.data.synthetic import generate_dataset
from zeropipe.errors import DataError

MIXTURE_FILE = "mixture.jsonl"
SUMMARY_FILE = "mixture.json"


def spec_of(data: DataSection, seed: int) -> dict[str, Any]:
    assert data.mixture is not None
    return {"sources": [source.model_dump(mode="json") for source in data.mixture], "examples": data.mixture_examples, "seed": seed}


def build_mixture(data: DataSection, out_dir: Path, seed: int) -> Path:
    """Draw ``data.mixture`` into ``out_dir/mixture.jsonl`` (reused when already drawn from the same spec).

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
    kinds = {label: isinstance(items[0], str) for label, _, items in sources}
    if len(set(kinds.values())) > 1:
        texts = [label for label, is_text in kinds.items() if is_text]
        raise DataError(
            f"data.mixture mixes plain text ({', '.join(texts)}) with conversations: a run trains on one or the other. "
            "Mix texts with texts and instructions or chats with each other"
        )
    total = data.mixture_examples or sum(len(items) for _, _, items in sources)
    counts = apportion(total, [weight for _, weight, _ in sources])
    rng = random.Random(seed)
    drawn: list[Any] = []
    rows = []
    for (label, weight, items), count in zip(sources, counts):
        drawn += draw(items, count, rng)
        rows.append({"source": label, "weight": weight, "records": len(items), "drawn": count, "passes": round(count / len(items), 2)})
    rng.shuffle(drawn)
    lines = [json.dumps({"text": item} if isinstance(item, str) else {"messages": item}) for item in drawn]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    summary_file.write_text(json.dumps({"spec": spec, "examples": len(drawn), "sources": rows}, indent=2))
    return path


def read_source(index: int, source, data: DataSection, out_dir: Path, seed: int) -> tuple[str, float, list]:

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
        records, bad = read_located_records(file, source.columns)
        if not records:
            raise DataError(f"no usable records ({len(bad)} malformed)")
        fmt = detect_format([record.value for record in records], source.format)
    except DataError as err:
        raise DataError(f"{key} ({label}): {err}") from None
    total = len(records) + len(bad)
    items = []
    for record in records:
        try:
            items.append(to_conversation(record.value, fmt))
        except RecordError as error:
            bad.append(record.bad(str(error)))
    allowed = data.max_bad_records if data.max_bad_records is not None else math.floor(data.max_bad_fraction * total)
    if len(bad) > allowed or not items:
        first = sorted(bad, key=lambda b: (b.file, b.line_number))[0]
        raise DataError(
            f"{key} ({label}): {len(bad)} of {total} records are malformed (first: {first}), more than the {allowed} "
            "data.max_bad_fraction / data.max_bad_records allow: fix the file or raise the limit"
        )
    return label, source.weight, items


def apportion(total: int, weights: list[float]) -> list[int]:
    """Split ``total`` in proportion to ``weights`` (largest remainders), every source at least one example."""
    scale = sum(weights)
    exact = [total * weight / scale for weight in weights]
    counts = [math.floor(value) for value in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return [max(1, count) for count in counts]


def draw(items: list, count: int, rng: random.Random) -> list:
    """``count`` items: whole shuffled passes over ``items``, then part of one more."""
    out: list = []
    order = list(range(len(items)))
    while len(out) < count:
        rng.shuffle(order)
        out += [items[i] for i in order[: count - len(out)]]
    return out


def mixture_note(out_dir: Path) -> str | None:
    """One line for the launcher's notes: what the drawn mixture holds."""
    try:
        summary = json.loads((Path(out_dir) / SUMMARY_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    parts = [f"{row['drawn']} from {row['source']} ({row['records']} records, {row['passes']} passes)" for row in summary["sources"]]
    return f"data.mixture: {summary['examples']} examples: " + ", ".join(parts)
