"""How examples are split between ranks and how a resumed epoch continues."""

from __future__ import annotations

import pytest

from zeropipe.data.sampler import ResumableDistributedSampler
from zeropipe.errors import DataError


def rank_indices(num_examples: int, world_size: int, epoch: int = 0, seed: int = 7) -> list[list[int]]:
    samplers = [ResumableDistributedSampler(num_examples, rank, world_size, seed) for rank in range(world_size)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


def test_ranks_get_disjoint_equal_shares_of_one_permutation():
    shares = rank_indices(num_examples=103, world_size=4)
    assert [len(share) for share in shares] == [25, 25, 25, 25]
    seen = [index for share in shares for index in share]
    assert len(set(seen)) == 100  # disjoint
    assert set(seen) <= set(range(103))
    # Every rank cut the same permutation: interleaving the shares gives it back.
    interleaved = [shares[rank][step] for step in range(25) for rank in range(4)]
    full = list(ResumableDistributedSampler(103, 0, 1, seed=7))[:100]
    assert interleaved == full


def test_order_is_shuffled_and_changes_every_epoch():
    epoch0, epoch1 = rank_indices(50, 2, epoch=0), rank_indices(50, 2, epoch=1)
    assert epoch0 != epoch1
    assert epoch0 == rank_indices(50, 2, epoch=0)  # reproducible
    assert epoch0[0] != sorted(epoch0[0])


def test_without_shuffle_ranks_stride_through_the_examples():
    sampler = ResumableDistributedSampler(10, rank=1, world_size=3, seed=0, shuffle=False)
    assert list(sampler) == [1, 4, 7]


def test_set_start_resumes_exactly_the_rest_of_the_epoch():
    sampler = ResumableDistributedSampler(40, rank=1, world_size=2, seed=3)
    sampler.set_epoch(5)
    full_epoch = list(sampler)

    resumed = ResumableDistributedSampler(40, rank=1, world_size=2, seed=3)
    resumed.set_epoch(5)
    resumed.set_start(7)
    resumed.set_epoch(5)  # the training loop sets the epoch again; the skip must survive that
    assert len(resumed) == 13
    assert resumed.per_rank == 20
    assert list(resumed) == full_epoch[7:]

    # The skip belongs to the resumed epoch only, whichever epoch was current when it was set.
    resumed.set_epoch(6)
    sampler.set_epoch(6)
    assert len(resumed) == 20
    assert list(resumed) == list(sampler)


def test_a_start_set_before_moving_to_another_epoch_is_forgotten():
    sampler = ResumableDistributedSampler(40, rank=0, world_size=2, seed=3)
    sampler.set_start(7)
    sampler.set_epoch(1)
    assert len(sampler) == 20


def test_start_outside_the_epoch_is_refused():
    sampler = ResumableDistributedSampler(10, rank=0, world_size=2, seed=0)
    sampler.set_start(5)
    assert list(sampler) == []
    with pytest.raises(ValueError):
        sampler.set_start(6)


def test_fewer_examples_than_ranks_is_a_data_error():
    with pytest.raises(DataError, match="3 training examples cannot be split over 4 ranks"):
        ResumableDistributedSampler(3, rank=0, world_size=4, seed=0)
    with pytest.raises(ValueError):
        ResumableDistributedSampler(10, rank=2, world_size=2, seed=0)
