"""Length-grouped batching: similar lengths per micro-batch, shuffled, deterministic, split between ranks."""

from __future__ import annotations

import numpy as np

from zeropipe.data.sampler import LengthGroupedSampler, ResumableDistributedSampler

LENGTHS = np.clip(np.random.default_rng(0).lognormal(4.0, 0.9, size=1000).astype(int), 8, 512)


def micro_batches(sampler_class, rank, world_size, micro, epoch=0, **kwargs):
    if sampler_class is LengthGroupedSampler:
        sampler = LengthGroupedSampler(LENGTHS, rank, world_size, seed=3, micro_batch_size=micro, **kwargs)
    else:
        sampler = ResumableDistributedSampler(len(LENGTHS), rank, world_size, seed=3)
    sampler.set_epoch(epoch)
    indices = list(sampler)
    usable = (len(indices) // micro) * micro
    return [indices[i : i + micro] for i in range(0, usable, micro)]


def padded_tokens(batches):
    return sum(len(batch) * max(LENGTHS[i] for i in batch) for batch in batches)


def test_grouping_cuts_padding_against_random_batches():
    grouped = [micro_batches(LengthGroupedSampler, rank, 2, 8) for rank in range(2)]
    random_order = [micro_batches(ResumableDistributedSampler, rank, 2, 8) for rank in range(2)]
    real = sum(int(LENGTHS[i]) for share in grouped for batch in share for i in batch)
    grouped_padding = sum(padded_tokens(share) for share in grouped) - real
    random_padding = sum(padded_tokens(share) for share in random_order) - sum(int(LENGTHS[i]) for share in random_order for b in share for i in b)
    assert grouped_padding < 0.25 * random_padding


def test_ranks_get_disjoint_shares_and_the_same_step_has_similar_lengths():
    shares = [micro_batches(LengthGroupedSampler, rank, 2, 8) for rank in range(2)]
    assert len(shares[0]) == len(shares[1]) == 1000 // 2 // 8
    seen = [i for share in shares for batch in share for i in batch]
    assert len(seen) == len(set(seen))
    for batch0, batch1 in zip(*shares):  # one optimizer step: the two ranks' micro-batches
        longest0, longest1 = max(LENGTHS[batch0]), max(LENGTHS[batch1])
        assert abs(int(longest0) - int(longest1)) <= 0.2 * max(longest0, longest1) + 8


def test_order_is_deterministic_shuffled_and_new_every_epoch():
    first = micro_batches(LengthGroupedSampler, 0, 2, 8)
    assert first == micro_batches(LengthGroupedSampler, 0, 2, 8)
    assert first != micro_batches(LengthGroupedSampler, 0, 2, 8, epoch=1)
    longest = [int(max(LENGTHS[batch])) for batch in first]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)  # not short-to-long


def test_resume_skips_exactly_the_batches_already_seen():
    sampler = LengthGroupedSampler(LENGTHS, 1, 2, seed=3, micro_batch_size=8)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_start(5 * 8)
    sampler.set_epoch(2)  # the trainer's resume sequence: the skip survives the same epoch
    assert list(sampler) == full[40:]
    assert len(full) == sampler.per_rank
