"""Synthetic data is streamed to disk: its memory does not grow with data.synthetic.examples (issue 46, defect 3)."""

from __future__ import annotations

import tracemalloc

from zeropipe.data.synthetic import generate_dataset


def test_a_large_synthetic_dataset_is_written_without_holding_it_in_memory(tmp_path):
    tracemalloc.start()
    try:
        path = generate_dataset("mixed", 20_000, 3, tmp_path / "train.jsonl")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = path.stat().st_size
    assert sum(1 for _ in open(path)) == 20_000 and size > 1_000_000
    # Before: every line and the list of them in memory at once (about 3x the file); now one line and a byte per record.
    assert peak < 500_000, f"peak {peak:,} bytes for a {size:,}-byte file"
