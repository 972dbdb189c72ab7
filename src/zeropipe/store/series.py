"""A run's metrics.jsonl as numeric columns, read incrementally and served downsampled.

Rank 0 appends one JSON object per optimizer step. A long run has 100,000 of them (20 MB);
parsing that takes about a second here, far too slow for a page load, so:

- each file is parsed once and then only its appended lines (``Series.update``);
- the columns are saved next to the run database (``.npz``) so a restarted server starts warm;
- a chart asks for its width in pixels and gets at most four points per pixel column: the
  first, last, minimum and maximum of each bucket (M4 aggregation), which draws the same
  line as all the points, spikes included.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

# Scalars every record has; lists (one value per rank) become "<key>/<rank>" columns.
# A curriculum's RUN/metrics.jsonl also numbers each row's stage (stage_index), so a chart can mark the boundaries.
SCALARS = ("step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "step_time_s", "time", "stage_index")
PER_RANK = ("host_rss_bytes", "gpu_max_allocated_bytes")
# Rows with "kind": "eval" hold an evaluation of the step written just before them.
EVAL_SCALARS = ("eval_loss", "eval_perplexity")
HEAD_BYTES = 256  # a rewritten file (a resume dropped later steps) has a different start or is shorter


class Series:
    """The columns of one metrics.jsonl, kept in step with the file."""

    def __init__(self, path: Path, cache_file: Path | None = None):
        self.path = Path(path)
        self.cache_file = cache_file
        self.lock = threading.Lock()
        self.reset()
        self.saved_rows = 0
        self.saved_at = 0.0
        if cache_file is not None:
            self.load_cache()

    def reset(self) -> None:
        self.offset = 0
        self.head = b""
        self.columns: dict[str, np.ndarray] = {}
        self.rows = 0
        self.eval_version = 0  # counts evaluations attached: a stream resends them when it moves

    # --------------------------------------------------------------- reading
    def update(self) -> int:
        """Read lines appended since the last call; return how many rows were added."""
        with self.lock:
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                if self.rows:
                    self.reset()
                return 0
            if size < self.offset or (self.offset and self.read_head() != self.head):
                self.reset()
            if size == self.offset:
                return 0
            with open(self.path, "rb") as handle:
                if not self.head:
                    self.head = handle.read(HEAD_BYTES)
                handle.seek(self.offset)
                chunk = handle.read(size - self.offset)
            # Only whole lines: rank 0 may be writing the next one right now.
            end = chunk.rfind(b"\n") + 1
            if end == 0:
                return 0
            self.offset += end
            records = parse_lines(chunk[:end])
            self.append(records)
            return len(records)

    def read_head(self) -> bytes:
        with open(self.path, "rb") as handle:
            return handle.read(min(HEAD_BYTES, len(self.head) or HEAD_BYTES))

    def append(self, records: list[dict[str, Any]]) -> None:
        evals = [r for r in records if r.get("kind") == "eval"]
        records = [r for r in records if r.get("kind") is None]
        self.append_steps(records)
        for record in evals:
            self.attach_eval(record)

    def attach_eval(self, record: dict[str, Any]) -> None:
        """Put an eval row's values on its step's row: a row of its own would leave a gap in every other column."""
        steps = self.columns.get("step")
        matches = np.flatnonzero(steps == record["step"]) if steps is not None else []
        if not len(matches):
            return  # its step's row was dropped (a resume rewrote the file): nothing to attach to
        for key in EVAL_SCALARS:
            self.columns.setdefault(key, np.full(self.rows, np.nan))[matches[-1]] = number(record.get(key))
        self.eval_version += 1

    def evals(self) -> dict[str, list]:
        """Every evaluation: ``step`` and the EVAL_SCALARS columns at the steps that have one (a few dozen at most)."""
        with self.lock:
            losses = self.columns.get("eval_loss")
            if losses is None:
                return {"step": [], **{key: [] for key in EVAL_SCALARS}}
            index = np.flatnonzero(np.isfinite(losses))
            steps = self.columns["step"][index]
            return {"step": to_json(steps), **{key: to_json(self.columns.get(key, np.full(self.rows, np.nan))[index]) for key in EVAL_SCALARS}}

    def append_steps(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        new: dict[str, np.ndarray] = {key: column(records, key) for key in SCALARS}
        for key in PER_RANK:
            new.update(per_rank_columns(records, key))
        for key in set(self.columns) | set(new):
            old = self.columns.get(key, np.full(self.rows, np.nan))
            added = new.get(key, np.full(len(records), np.nan))
            self.columns[key] = np.concatenate([old, added])
        self.rows += len(records)

    # ----------------------------------------------------------------- cache
    def load_cache(self) -> None:
        try:
            with np.load(self.cache_file, allow_pickle=False) as data:
                meta = json.loads(str(data["__meta__"]))
                columns = {key: data[key] for key in data.files if key != "__meta__"}
        except (OSError, ValueError, KeyError, json.JSONDecodeError):
            return
        if meta.get("path") != str(self.path):
            return
        self.offset, self.head, self.rows = int(meta["offset"]), bytes.fromhex(meta["head"]), int(meta["rows"])
        self.columns = columns
        self.saved_rows = self.rows

    def save_cache(self, force: bool = False) -> None:
        """Write the columns for the next server start; skipped for small or unchanged series."""
        if self.cache_file is None or self.rows == self.saved_rows or self.rows < 2000:
            return
        if not force and time.time() - self.saved_at < 30:
            return
        with self.lock:
            meta = json.dumps({"path": str(self.path), "offset": self.offset, "head": self.head.hex(), "rows": self.rows})
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_file.with_name(f".{self.cache_file.name}.{os.getpid()}.tmp.npz")
            np.savez(tmp, __meta__=np.array(meta), **self.columns)
            os.replace(tmp, self.cache_file)
            self.saved_rows, self.saved_at = self.rows, time.time()

    # --------------------------------------------------------------- serving
    def keys(self) -> list[str]:
        return sorted(key for key, values in self.columns.items() if key != "step" and np.isfinite(values).any())

    def recent_step_time(self, last: int = 20) -> float | None:
        values = self.columns.get("step_time_s")
        if values is None or not len(values):
            return None
        tail = values[-last:]
        tail = tail[np.isfinite(tail)]
        return float(tail.mean()) if len(tail) else None

    def window(self, keys: list[str], width: int | None = None, after_step: float | None = None) -> dict[str, Any]:
        """Columns ``step`` + ``keys``; downsampled to ``width`` pixel columns when given and needed."""
        with self.lock:
            steps = self.columns.get("step", np.zeros(0))
            selected = {key: self.columns.get(key, np.full(self.rows, np.nan)) for key in keys}
            if after_step is not None:
                mask = steps > after_step
                steps = steps[mask]
                selected = {key: values[mask] for key, values in selected.items()}
            total = len(steps)
            downsampled = bool(width) and total > 4 * width
            if downsampled:
                index = m4_indices(total, selected.values(), width)
                steps = steps[index]
                selected = {key: values[index] for key, values in selected.items()}
        return {
            "step": to_json(steps),
            "series": {key: to_json(values) for key, values in selected.items()},
            "points": total,
            "downsampled": downsampled,
        }


def parse_lines(chunk: bytes) -> list[dict[str, Any]]:
    """Parse JSON lines; one json.loads over the joined lines is about twice as fast as one per line."""
    lines = [line for line in chunk.split(b"\n") if line.strip()]
    try:
        records = json.loads(b"[" + b",".join(lines) + b"]")
    except json.JSONDecodeError:
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn line from a crash: skip it, keep the rest
    return [r for r in records if isinstance(r, dict) and isinstance(r.get("step"), (int, float))]


def number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def column(records: list[dict[str, Any]], key: str) -> np.ndarray:
    values = [r.get(key) for r in records]
    try:
        # The common case, in C: numbers, with None (a missing key) read as NaN.
        return np.array(values, dtype=np.float64)
    except (TypeError, ValueError):
        return np.array([number(v) for v in values], dtype=np.float64)


def per_rank_columns(records: list[dict[str, Any]], key: str) -> dict[str, np.ndarray]:
    """``key`` holds one value per rank: one column per rank, ``key/0``, ``key/1``..."""
    values = [r.get(key) for r in records]
    if all(v is None for v in values):
        return {}
    try:
        table = np.array(values, dtype=np.float64)
        if table.ndim != 2:
            raise ValueError("not one list of the same length per row")
    except (TypeError, ValueError):
        width = max((len(v) for v in values if isinstance(v, list)), default=0)
        rows = [[number(v[i]) if isinstance(v, list) and i < len(v) else math.nan for i in range(width)] for v in values]
        table = np.array(rows, dtype=np.float64).reshape(len(values), width)
    return {f"{key}/{rank}": table[:, rank].copy() for rank in range(table.shape[1])}


def m4_indices(total: int, columns, width: int) -> np.ndarray:
    """Indices of the first, last, min and max point of each of about ``width`` equal buckets, for every column."""
    size = math.ceil(total / width)
    buckets = math.ceil(total / size)
    starts = np.arange(buckets) * size
    keep = [starts, np.minimum(starts + size, total) - 1]
    pad = buckets * size - total
    for values in columns:
        # NaN never wins a min/max (a diverged step is still drawn as a gap by its neighbours).
        finite = np.isfinite(values)
        low = np.pad(np.where(finite, values, np.inf), (0, pad), constant_values=np.inf).reshape(buckets, size)
        high = np.pad(np.where(finite, values, -np.inf), (0, pad), constant_values=-np.inf).reshape(buckets, size)
        keep += [starts + low.argmin(axis=1), starts + high.argmax(axis=1)]
    return np.unique(np.minimum(np.concatenate(keep), total - 1))


def to_json(values: np.ndarray) -> list[float | None]:
    """A column as a JSON-safe list: NaN and infinities become null (a gap in the chart)."""
    out = values.astype(object)
    out[~np.isfinite(values)] = None
    return out.tolist()


def cache_name(path: Path) -> str:
    return hashlib.sha1(str(path).encode()).hexdigest()[:16] + ".npz"


class SeriesCache:
    """Series of recently viewed or live runs, least recently used dropped first."""

    def __init__(self, cache_dir: Path | None = None, capacity: int = 16):
        self.cache_dir = cache_dir
        self.capacity = capacity
        self.items: OrderedDict[Path, Series] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, metrics_path: Path, update: bool = True) -> Series:
        metrics_path = Path(metrics_path)
        with self.lock:
            series = self.items.get(metrics_path)
            if series is None:
                cache_file = self.cache_dir / cache_name(metrics_path) if self.cache_dir else None
                series = Series(metrics_path, cache_file)
                self.items[metrics_path] = series
            self.items.move_to_end(metrics_path)
            while len(self.items) > self.capacity:
                _, dropped = self.items.popitem(last=False)
                dropped.save_cache(force=True)
        if update:
            series.update()
        return series

    def forget(self, metrics_path: Path) -> None:
        """Drop a run's series and its cache file (the run was deleted or moved)."""
        metrics_path = Path(metrics_path)
        with self.lock:
            self.items.pop(metrics_path, None)
        if self.cache_dir is not None:
            (self.cache_dir / cache_name(metrics_path)).unlink(missing_ok=True)

    def save_all(self, force: bool = False) -> None:
        with self.lock:
            items = list(self.items.values())
        for series in items:
            series.save_cache(force=force)
