"""A resumed run continues with exactly the micro-batches the uninterrupted run would have trained on,
with packed sequences and with length-grouped batches too (sampler_batches counts micro-batches)."""

from __future__ import annotations

import itertools
import random
from functools import partial

import pytest
import torch

from zeropipe.data.packing import PackedDataset, build_pack_index, collate_packed
from zeropipe.data.sampler import DataPosition, LengthGroupedSampler, ResumableDistributedSampler
from zeropipe.data.token_cache import TokenDataset, build_token_cache, collate
from zeropipe.engine.task import sampler_batches


@pytest.fixture
def cache(tmp_path, tokenizer, write_jsonl):
    rng = random.Random(0)
    records = [{"instruction": "Say " + " ".join("word" for _ in range(rng.randint(1, 20))), "output": f"number {n}"} for n in range(120)]
    build_token_cache(write_jsonl(tmp_path / "train.jsonl", records), tokenizer, tmp_path / "cache", max_seq_len=64)
    build_pack_index(tmp_path / "cache", 64)
    return tmp_path / "cache"


def batches_from(step: int, dataset, sampler, collate_fn, micro: int, accumulation: int = 2):
    """What a rank's task yields from optimizer step ``step`` on (2 ranks, this is rank 1)."""
    start = DataPosition.at_micro_step(step * accumulation, (len(dataset) // 2) // micro, 2, micro)
    return sampler_batches(sampler, dataset, collate_fn, micro, start)


@pytest.mark.parametrize("layout", ["packed", "grouped"])
def test_resume_continues_with_the_same_batches_across_epochs(cache, layout):
    micro = 2 if layout == "packed" else 4
    if layout == "packed":
        dataset = PackedDataset(cache)
        make_sampler = lambda: ResumableDistributedSampler(len(dataset), 1, 2, seed=5)  # noqa: E731
        collate_fn = partial(collate_packed, pad_token_id=0)
    else:
        dataset = TokenDataset(cache)
        make_sampler = lambda: LengthGroupedSampler(dataset.lengths(), 1, 2, seed=5, micro_batch_size=micro)  # noqa: E731
        collate_fn = partial(collate, pad_token_id=0)
    per_epoch = (len(dataset) // 2) // micro
    total_micro = per_epoch * 2 + 3  # into the third epoch
    reference = list(itertools.islice(batches_from(0, dataset, make_sampler(), collate_fn, micro), total_micro))
    resume_step = per_epoch // 2 + 1  # mid-epoch, then across the epoch boundary
    resumed = list(itertools.islice(batches_from(resume_step, dataset, make_sampler(), collate_fn, micro), total_micro - 2 * resume_step))
    assert len(resumed) == total_micro - 2 * resume_step
    for (epoch_a, a), (epoch_b, b) in zip(reference[2 * resume_step :], resumed):
        assert epoch_a == epoch_b and a.keys() == b.keys()
        assert all(torch.equal(a[key], b[key]) for key in a)
