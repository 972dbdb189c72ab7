"""The peers' sequence-parallel degrees -> parallel.sequence_parallel_size (issue 40), their own splitting settings reported."""

from __future__ import annotations

import json

import pytest

from zeropipe.convert import convert_file
from tests.unit.convert.test_convert_llama_factory import ALPACA, dataset_dir, model_dir


@pytest.mark.parametrize(
    ("tool", "text", "mapped_from", "ignored"),
    [
        ("axolotl", "sequence_parallel_degree: 4\nheads_k_stride: 1\n", "sequence_parallel_degree", "heads_k_stride"),
        ("axolotl", "context_parallel_size: 4\nring_attn_func: varlen_llama3\n", "context_parallel_size", "ring_attn_func"),
        ("llama-factory", "sequence_parallel_size: 4\nsequence_parallel_mode: zigzag-ring\n", "sequence_parallel_size", "sequence_parallel_mode"),
    ],
)
def test_a_peers_degree_becomes_parallel_sequence_parallel_size(tmp_path, tool, text, mapped_from, ignored):
    model = model_dir(tmp_path)
    if tool == "axolotl":
        data = tmp_path / "alpaca.jsonl"
        data.write_text(json.dumps({"instruction": "a", "input": "", "output": "b"}) + "\n")
        path = tmp_path / "axolotl.yml"
        path.write_text(f"base_model: {model}\ndatasets:\n  - path: alpaca.jsonl\n    type: alpaca\n{text}")
    else:
        dataset_dir(tmp_path, {"demo": {"file_name": "demo.json"}}, {"demo.json": ALPACA})
        path = tmp_path / "llama3_lora_sft.yaml"
        path.write_text(f"model_name_or_path: {model}\nstage: sft\ndataset: demo\n{text}")
    conversion = convert_file(path)
    entry = conversion.entries["parallel.sequence_parallel_size"]
    assert entry.value == 4 and f"from {mapped_from}: 4" in entry.comment and "Ulysses" in entry.comment
    assert ignored in dict(conversion.unmapped)


def test_a_degree_of_one_is_said_as_no_split_and_a_bad_one_is_named(tmp_path):
    model = model_dir(tmp_path)
    dataset_dir(tmp_path, {"demo": {"file_name": "demo.json"}}, {"demo.json": ALPACA})
    path = tmp_path / "llama3_lora_sft.yaml"
    path.write_text(f"model_name_or_path: {model}\nstage: sft\ndataset: demo\nsequence_parallel_size: 1\n")
    entry = convert_file(path).entries["parallel.sequence_parallel_size"]  # said, not silent: every key is converted, listed or refused
    assert entry.value == 1 and "no split" in entry.comment
    path.write_text(f"model_name_or_path: {model}\nstage: sft\ndataset: demo\nsequence_parallel_size: two\n")
    assert "a whole number" in dict(convert_file(path).unmapped)["sequence_parallel_size"]
