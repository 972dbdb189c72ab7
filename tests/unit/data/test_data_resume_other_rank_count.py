"""A run resumed on another number of ranks trains on the examples the uninterrupted run would have:
the same examples in every optimizer step, none twice and none skipped within the epoch.

Each rank of a run is simulated by its own sampler and SamplerBatches over a dataset whose
items are their own indices, so every step's examples are recorded directly.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from zeropipe.data.sampler import DataPosition, LengthGroupedSampler, ResumableDistributedSampler
from zeropipe.engine.task import sampler_batches

GLOBAL_BATCH = 12
MICRO = 2


def make_sampler(kind: str, examples: int, rank: int, world_size: int):
    if kind == "grouped":
        lengths = [(index * 7919) % 23 + 1 for index in range(examples)]
        return LengthGroupedSampler(lengths, rank, world_size, seed=3, micro_batch_size=MICRO, group_batches=2)
    return ResumableDistributedSampler(examples, rank, world_size, seed=3)


def run_steps(kind: str, examples: int, world_size: int, steps: int, start: DataPosition | None = None):
    """(examples of each optimizer step as a sorted list, epoch of each step, every rank's position after them)."""
    accumulation = GLOBAL_BATCH // (MICRO * world_size)
    ranks = [sampler_batches(make_sampler(kind, examples, rank, world_size), list(range(examples)), list, MICRO, start) for rank in range(world_size)]
    seen, epochs = [], []
    for _ in range(steps):
        step, step_epochs = [], set()
        for _ in range(accumulation):
            for batches in ranks:
                epoch, batch = next(batches)
                step += batch
                step_epochs.add(epoch)
        seen.append(sorted(step))
        epochs.append(max(step_epochs))
    return seen, epochs, [batches.position for batches in ranks]


@pytest.mark.parametrize("kind", ["plain", "grouped"])
@pytest.mark.parametrize("new_world_size", [1, 3, 6])
def test_every_step_after_a_resume_on_another_rank_count_has_the_uninterrupted_runs_examples(kind, new_world_size):
    examples = 120  # 10 steps of 12 per epoch on 1, 2, 3 or 6 ranks: no tail to drop
    reference, _, _ = run_steps(kind, examples, 2, 25)
    before, _, positions = run_steps(kind, examples, 2, 4)
    assert len(set(positions)) == 1, "every rank must agree on where the run stands"
    assert positions[0] == DataPosition(0, 48, 2, MICRO)
    after, _, _ = run_steps(kind, examples, new_world_size, 21, start=positions[0])
    resumed = before + after
    # Within the epoch of the resume every step trains on the same examples. Later epochs are
    # shuffled the same way; length grouping cuts them for the ranks that start them.
    same_until = 25 if kind == "plain" else 10
    assert resumed[:same_until] == reference[:same_until]
    for epoch in range(2):
        trained = Counter(index for step in resumed[epoch * 10 : epoch * 10 + 10] for index in step)
        assert trained == Counter(range(examples)), f"epoch {epoch}: every example exactly once"


@pytest.mark.parametrize("kind", ["plain", "grouped"])
def test_an_uneven_epoch_loses_only_its_last_few_examples_and_repeats_none(kind):
    examples = 100
    before, _, positions = run_steps(kind, examples, 2, 3)  # 36 of the 100 examples of epoch 0
    resumed = sampler_batches(make_sampler(kind, examples, 0, 3), list(range(examples)), list, MICRO, positions[0])
    others = [sampler_batches(make_sampler(kind, examples, rank, 3), list(range(examples)), list, MICRO, positions[0]) for rank in (1, 2)]
    epoch_zero = [index for step in before for index in step]
    for batches in itertools.cycle([resumed, *others]):
        epoch, batch = next(batches)
        if epoch > 0:
            break
        epoch_zero += batch
    counts = Counter(epoch_zero)
    assert max(counts.values()) == 1, "no example twice in one epoch"
    # 64 examples were left for 3 ranks x micro-batch 2 = 6 per micro-step: 10 micro-steps, 4 left over.
    assert len(counts) == 96
    order = make_sampler(kind, examples, 0, 2).epoch_order(0, 2, MICRO)
    assert set(range(examples)) - set(counts) == set(order[96:]), "only the epoch's last examples are dropped"


def test_a_position_counted_from_steps_matches_what_the_batches_report():
    """Checkpoints written before positions were recorded: counted from the step, they land where the run was."""
    _, _, positions = run_steps("plain", 100, 2, 7)  # 7 steps x 3 micro-steps on 2 ranks = 21 micro-steps
    per_epoch = (100 // 2) // MICRO
    assert DataPosition.at_micro_step(7 * 3, per_epoch, 2, MICRO) == positions[0]
