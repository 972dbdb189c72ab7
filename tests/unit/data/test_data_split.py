"""data.eval_fraction: the held-out records are the same every time and never trained on."""

from __future__ import annotations

from zeropipe.data.split import RecordSplit
from zeropipe.data.token_cache import TokenDataset, build_token_cache


def test_split_is_deterministic_disjoint_and_complete():
    records = list(range(200))
    held = RecordSplit(0.05, seed=7, held_out=True).select(records)
    kept = RecordSplit(0.05, seed=7, held_out=False).select(records)
    assert len(held) == 10 and len(kept) == 190
    assert sorted(held + kept) == records
    assert held == RecordSplit(0.05, seed=7, held_out=True).select(records)
    assert held != RecordSplit(0.05, seed=8, held_out=True).select(records)


def test_tiny_data_keeps_one_record_on_each_side():
    assert RecordSplit(0.01, 0, True).select([1, 2, 3]) != []
    assert RecordSplit(0.99, 0, False).select([1, 2, 3]) != []


def test_caches_of_the_two_sides_hold_different_records(tmp_path, tokenizer, write_jsonl):
    records = [{"instruction": f"Say {n}", "output": f"number {n}"} for n in range(40)]
    path = write_jsonl(tmp_path / "train.jsonl", records)
    train = build_token_cache(path, tokenizer, tmp_path / "train", max_seq_len=64, split=RecordSplit(0.1, 42, held_out=False))
    held = build_token_cache(path, tokenizer, tmp_path / "eval", max_seq_len=64, split=RecordSplit(0.1, 42, held_out=True))
    assert (train.examples, held.examples) == (36, 4)

    def texts(cache):
        dataset = TokenDataset(cache)
        return {tokenizer.decode(dataset[i]["input_ids"]) for i in range(len(dataset))}

    assert not texts(tmp_path / "train") & texts(tmp_path / "eval")
