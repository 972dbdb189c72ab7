"""The eval loss: a mean over loss tokens that does not depend on batching or on the number of ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig

from zeropipe.data.token_cache import collate
from zeropipe.families.causal_lm.evaluation import eval_batch_indices, eval_record, eval_sums


def test_every_rank_runs_the_same_number_of_batches_and_counts_each_example_once():
    lengths = np.arange(1, 12)  # 11 examples over 3 ranks: 4, 4 and 3
    shares = [eval_batch_indices(lengths, rank, 3, batch_size=2) for rank in range(3)]
    assert [len(share) for share in shares] == [2, 2, 2]
    counted = [i for share in shares for batch, is_counted in share if is_counted for i in batch]
    assert sorted(counted) == list(range(11))
    assert [is_counted for _, is_counted in shares[2]] == [True, True]
    # A rank with nothing left still runs a batch (a ZeRO-3 collective), uncounted.
    few = [eval_batch_indices(np.arange(1, 4), rank, 4, batch_size=2) for rank in range(4)]
    assert [len(share) for share in few] == [1, 1, 1, 1] and few[3][0][1] is False


def test_loss_is_the_same_however_the_examples_are_batched_and_split():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    dataset = []
    for length in (5, 9, 3, 12, 7, 4, 10):
        ids = torch.randint(0, 50, (length,), generator=generator)
        labels = ids.clone()
        labels[: length // 2] = -100  # a prompt without loss
        dataset.append({"input_ids": ids, "labels": labels})
    lengths = np.array([len(example["input_ids"]) for example in dataset])

    def loss_of(batch):
        return model(**batch, use_cache=False).loss

    def run(world_size, batch_size):
        totals = np.zeros(3)
        for rank in range(world_size):
            batches = eval_batch_indices(lengths, rank, world_size, batch_size)
            totals += eval_sums(loss_of, dataset, batches, lambda items: collate(items, pad_token_id=0), torch.device("cpu"))
        return eval_record(1, *totals, 0.0)

    one = run(1, 7)
    assert one["eval_loss"] == pytest.approx(run(2, 2)["eval_loss"], rel=1e-5)
    assert one["eval_loss"] == pytest.approx(run(3, 1)["eval_loss"], rel=1e-5)
    # The mean over all loss tokens at once, by hand.
    with torch.no_grad():
        total = sum(float(model(**collate([ex], 0)).loss) * int((ex["labels"][1:] != -100).sum()) for ex in dataset)
    tokens = sum(int((ex["labels"][1:] != -100).sum()) for ex in dataset)
    assert one["eval_tokens"] == tokens and one["eval_examples"] == 7
    assert one["eval_loss"] == pytest.approx(total / tokens, rel=1e-5)
    assert one["eval_perplexity"] == pytest.approx(math.exp(one["eval_loss"]))
    assert one["kind"] == "eval"


def fake_run(tmp_path: Path, checkpoint: bool) -> Path:
    """A run directory as far as `zeropipe eval` looks before loading any weights."""
    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    config = {"model": {"family": "causal_lm", "config": {"model_type": "llama", "hidden_size": 32}}, "data": {"path": str(data)}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    if checkpoint:
        (run / "checkpoints" / "step_00000004").mkdir()
        (run / "checkpoints" / "step_00000004" / "zeropipe_complete.json").write_text(json.dumps({"step": 4, "zero_stage": 2}))
    return run


def test_eval_says_what_is_missing(tmp_path, capsys):
    from zeropipe.cli.main import main

    assert main(["eval", str(fake_run(tmp_path / "a", checkpoint=False))]) == 2
    assert "has no complete checkpoint" in capsys.readouterr().err
    run = fake_run(tmp_path / "b", checkpoint=True)
    assert main(["eval", str(run)]) == 2
    error = capsys.readouterr().err
    assert "no held-out data" in error and "--data FILE" in error
    assert main(["eval", str(run), "--checkpoint", "step_00000009"]) == 2
    assert "no checkpoint step_00000009: complete ones are step_00000004" in capsys.readouterr().err
    assert main(["eval", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err
