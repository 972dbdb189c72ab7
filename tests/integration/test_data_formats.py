"""Training from the formats people download: a Parquet file with its own column names trains exactly as the same records in JSONL."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.integration.conftest import assert_ok, metrics, zeropipe

pytestmark = pytest.mark.integration


def test_parquet_with_mapped_columns_trains_with_the_losses_of_the_same_jsonl(tmp_run):
    """Same records, same seed: the token cache and so every step's loss are the same whatever the file format.

    The Parquet file names its columns as a Hub dataset might (question/answer) and
    data.columns maps them, as a converted LLaMA-Factory config does; it is written in small
    row groups so that it is read a row group at a time.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zeropipe.data.synthetic import generate_dataset

    tmp_path, make = tmp_run
    jsonl = generate_dataset("arithmetic", 400, 3, tmp_path / "train.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert set(rows[0]) >= {"instruction", "output"}
    table = pa.Table.from_pylist([{"question": row["instruction"], "context": row.get("input", ""), "answer": row["output"]} for row in rows])
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=64)

    losses = {}
    for name, data in {
        "from-jsonl": {"synthetic": None, "path": str(jsonl)},
        "from-parquet": {"synthetic": None, "path": str(tmp_path / "train.parquet"), "columns": {"instruction": "question", "input": "context", "output": "answer"}},
    }.items():
        config = make(name, data=data, model={"tokenizer_vocab_size": 300}, train={"max_steps": 6, "log_every": 1}, generate={"prompts": []})
        assert_ok(zeropipe("train", config))
        rows_logged = metrics(tmp_path / "runs" / name)
        losses[name] = [row["loss"] for row in rows_logged if "loss" in row]
        cache = tmp_path / "runs" / name / "cache"
        assert json.loads((cache / "cache.json").read_text())["token_dtype"] == "uint16"
        assert np.load(cache / "loss_mask.npy", mmap_mode="r").dtype == np.uint8
    assert len(losses["from-parquet"]) == 6 and losses["from-parquet"][-1] < losses["from-parquet"][0], losses
    assert losses["from-parquet"] == losses["from-jsonl"]
