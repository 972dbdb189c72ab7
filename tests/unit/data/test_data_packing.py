"""Packing: the same loss as padding, positions restarting per example, no attention across examples."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from zeropipe.data.packing import PackedDataset, build_pack_index, collate_packed, pack_examples, pack_lengths, read_pack_info
from zeropipe.data.token_cache import TokenDataset, build_token_cache, collate
from zeropipe.data.tokenize import IGNORE_INDEX
from zeropipe.errors import DataError


def tiny_llama(attn_implementation: str, vocab_size: int = 400):
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # As in training (build_model): transformers ignores packed positions when it keeps a KV cache.
    model.config.use_cache = False
    return model


@pytest.fixture
def instruction_cache(tmp_path, tokenizer, write_jsonl):
    """A token cache of instruction examples of very different lengths."""
    rng = random.Random(3)
    records = []
    for number in range(24):
        words = " ".join(rng.choice(["cat", "dog", "fox", "what", "is", "the", "capital"]) for _ in range(rng.randint(1, 25)))
        records.append({"instruction": f"Repeat {number}: {words}", "output": words[: rng.randint(3, 60)] or "ok"})
    path = write_jsonl(tmp_path / "train.jsonl", records)
    build_token_cache(path, tokenizer, tmp_path / "cache", max_seq_len=96)
    return tmp_path / "cache"


def test_best_fit_places_every_example_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4, 0.8, size=500).astype(int), 8, 256)
    packs = pack_lengths(lengths, 256)
    members = sorted(index for pack in packs for index in pack)
    assert members == list(range(500))
    assert all(sum(int(lengths[i]) for i in pack) <= 256 for pack in packs)
    # Nearly full: no more than one pack beyond the lower bound in 5%.
    lower_bound = int(np.ceil(lengths.sum() / 256))
    assert len(packs) <= lower_bound * 1.05 + 1
    assert pack_lengths(lengths, 256) == packs  # decided by the lengths alone


def test_an_example_longer_than_a_pack_is_refused():
    with pytest.raises(DataError, match="max_seq_len"):
        pack_lengths([10, 300], 256)


def test_pack_index_on_disk_matches_the_cache(instruction_cache):
    info = build_pack_index(instruction_cache, 96)
    assert read_pack_info(instruction_cache) == info
    packed = PackedDataset(instruction_cache)
    examples = TokenDataset(instruction_cache)
    assert len(packed) == info["packs"] < len(examples)
    assert sorted(i for p in range(len(packed)) for i in packed.members(p)) == list(range(len(examples)))
    for p in range(len(packed)):
        sequence = packed[p]
        expected = torch.cat([examples[i]["input_ids"] for i in packed.members(p)])
        assert torch.equal(sequence["input_ids"], expected) and len(expected) <= 96


def test_positions_restart_for_each_example_and_padding_is_a_segment_of_its_own():
    a = {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([5, 6, 7])}
    b = {"input_ids": torch.tensor([8, 9]), "labels": torch.tensor([IGNORE_INDEX, 9])}
    c = {"input_ids": torch.tensor([10, 11, 12, 13, 14, 15]), "labels": torch.tensor([10, 11, 12, 13, 14, 15])}
    batch = collate_packed([pack_examples([a, b]), pack_examples([c])], pad_token_id=0)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    # Each example's first token is never a target: nothing predicts across a boundary.
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100], [-100, 11, 12, 13, 14, 15]]
    assert batch["input_ids"][0, -1] == 0
    assert int(batch["num_tokens"]) == 11 and int(batch["num_examples"]) == 3  # padding not counted
    assert "attention_mask" not in batch  # transformers only reads packed positions without one


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_batch_has_the_loss_of_the_same_examples_padded(instruction_cache, attn_implementation):
    build_pack_index(instruction_cache, 96)
    packed = PackedDataset(instruction_cache)
    examples = TokenDataset(instruction_cache)
    model = tiny_llama(attn_implementation)
    chosen = [0, 1, 2]
    members = [i for p in chosen for i in packed.members(p)]
    assert len(members) > len(chosen)  # several examples per sequence

    packed_batch = collate_packed([packed[p] for p in chosen], pad_token_id=0)
    real_tokens = packed_batch.pop("num_tokens")
    assert int(packed_batch.pop("num_examples")) == len(members)
    padded_batch = collate([examples[i] for i in members], pad_token_id=0)
    assert int(real_tokens) == int(padded_batch["attention_mask"].sum())
    with torch.no_grad():
        packed_loss = model(**packed_batch).loss
        padded_loss = model(**padded_batch).loss
    assert packed_loss.item() == pytest.approx(padded_loss.item(), rel=1e-5, abs=1e-6)
    # The test can fail: the same tokens without restarting positions attend across examples.
    with torch.no_grad():
        flat_loss = model(input_ids=packed_batch["input_ids"], labels=packed_batch["labels"]).loss
    assert abs(flat_loss.item() - padded_loss.item()) > 1e-4


def test_changing_one_example_leaves_the_next_one_in_the_pack_untouched():
    model = tiny_llama("sdpa")
    generator = torch.Generator().manual_seed(1)
    a = {"input_ids": torch.randint(3, 400, (20,), generator=generator), "labels": torch.randint(3, 400, (20,), generator=generator)}
    b = {"input_ids": torch.randint(3, 400, (15,), generator=generator), "labels": torch.randint(3, 400, (15,), generator=generator)}
    changed = {**a, "input_ids": a["input_ids"].clone()}
    changed["input_ids"][5:12] = torch.randint(3, 400, (7,), generator=generator)

    def logits(first, positions=True):
        batch = collate_packed([pack_examples([first, b])], pad_token_id=0)
        with torch.no_grad():
            return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"] if positions else None).logits[0]

    assert torch.equal(logits(a)[20:35], logits(changed)[20:35])
    assert not torch.allclose(logits(a)[:20], logits(changed)[:20])
    # Control: without the restarting positions, B does see A.
    assert not torch.allclose(logits(a, positions=False)[20:35], logits(changed, positions=False)[20:35])
