"""Splitting the examples between ranks, in an order that can be resumed mid-epoch, on any number of ranks.

Every epoch has one order of the examples, the same on every rank. Optimizer micro-step k of
a run with W ranks and micro-batch m trains on the k-th slice of m x W examples of that order
(each rank on every W-th of them), so the place a run has reached is one number for the
whole run: how many examples of the epoch's order are behind it (:class:`DataPosition`).
A run resumed on another number of ranks continues from that number: no example of the
epoch is seen twice or skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from zeropipe.errors import DataError


@dataclass(frozen=True)
class DataPosition:
    """Where a run stands in its data, for all ranks together (not per rank).

    ``consumed`` examples (or packed sequences) of epoch ``epoch``'s order have been trained
    on. ``world_size`` and ``micro_batch_size`` are the deal that epoch's order was cut for:
    length grouping cuts it into global batches of micro-batch x ranks, so a run resumed on
    another rank count mid-epoch must keep cutting that epoch the old way.
    """

    epoch: int
    consumed: int
    world_size: int
    micro_batch_size: int

    @classmethod
    def at_micro_step(cls, micro_steps: int, micro_batches_per_epoch: int, world_size: int, micro_batch_size: int) -> DataPosition:
        """The position after ``micro_steps`` micro-steps of a run that never changed its rank count or micro-batch."""
        epoch, position = divmod(micro_steps, micro_batches_per_epoch)
        return cls(epoch, position * micro_batch_size * world_size, world_size, micro_batch_size)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DataPosition:
        return cls(int(values["epoch"]), int(values["consumed"]), int(values["world_size"]), int(values["micro_batch_size"]))

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class ResumableDistributedSampler(Sampler[int]):
    """Each rank's share of a seeded per-epoch permutation, with a way to skip what was already seen.

    Every rank builds the same permutation (seeded with ``seed + epoch``) and takes every
    ``world_size``-th index from its own offset. The tail is dropped so every rank gets
    exactly ``num_examples // world_size`` indices: a rank with one batch more would wait
    forever in a collective the others never enter.
    """

    def __init__(self, num_examples: int, rank: int, world_size: int, seed: int, shuffle: bool = True):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size} ranks")
        if num_examples < world_size:
            raise DataError(
                f"{num_examples} training examples cannot be split over {world_size} ranks: every rank needs "
                "at least one. Add data or run on fewer GPUs."
            )
        self.num_examples = num_examples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start = 0

    @property
    def per_rank(self) -> int:
        """Indices each rank sees in a full epoch."""
        return self.num_examples // self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch``; moving to another epoch forgets :meth:`set_start`."""
        # Only a change of epoch resets the skip, so the usual resume sequence
        # set_start(k) followed by the loop's set_epoch(same epoch) keeps it.
        if epoch != self.epoch:
            self.start = 0
        self.epoch = epoch

    def set_start(self, index: int) -> None:
        """Skip this rank's first ``index`` samples of the current epoch (they were seen before a resume)."""
        if not 0 <= index <= self.per_rank:
            raise ValueError(f"start {index} is outside this epoch's {self.per_rank} samples per rank")
        self.start = index

    def epoch_indices(self) -> list[int]:
        """This rank's full order for the current epoch, before skipping."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_examples, generator=generator)
        else:
            order = torch.arange(self.num_examples)
        order = order[: self.per_rank * self.world_size]
        return order[self.rank :: self.world_size].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices()[self.start :])

    def epoch_order(self, epoch: int, world_size: int, micro_batch_size: int) -> list[int]:
        """Epoch ``epoch``'s order of all examples, for a deal of ``world_size`` ranks x ``micro_batch_size``.

        Micro-step k of that deal trains on ``order[k*m*W : (k+1)*m*W]``, rank r on every W-th
        of them from r: exactly the micro-batches :meth:`epoch_indices` gives each rank.
        """
        if not self.shuffle:
            return list(range(self.num_examples))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_examples, generator=generator).tolist()

    def __len__(self) -> int:
        return self.per_rank - self.start


class LengthGroupedSampler(ResumableDistributedSampler):
    """Like :class:`ResumableDistributedSampler`, but each micro-batch holds examples of similar length.

    Per epoch, the seeded permutation is cut into mega-batches of ``group_batches`` global
    batches (``micro_batch_size x world_size`` examples each); each mega-batch is sorted by
    length and cut into global batches, and the order of all global batches is shuffled, so
    long and short batches alternate at random rather than the epoch running short to long.
    A global batch is dealt round-robin down its sorted order, so the ranks of one step get
    examples of nearly the same lengths and none waits long for another in the all-reduce.

    The rank's list is its micro-batches back to back (``micro_batch_size`` indices each), so
    the trainer's resume arithmetic (skip ``k x micro_batch_size`` indices) is unchanged.
    """

    def __init__(
        self,
        lengths,
        rank: int,
        world_size: int,
        seed: int,
        micro_batch_size: int,
        group_batches: int = 50,
    ):
        super().__init__(len(lengths), rank, world_size, seed, shuffle=True)
        self.lengths = [int(length) for length in lengths]
        self.micro_batch_size = micro_batch_size
        self.group_batches = group_batches

    def epoch_indices(self) -> list[int]:
        global_batch = self.micro_batch_size * self.world_size
        full = (self.per_rank // self.micro_batch_size) * global_batch
        order = self.epoch_order(self.epoch, self.world_size, self.micro_batch_size)
        mine = [index for start in range(0, full, global_batch) for index in order[start : start + global_batch][self.rank :: self.world_size]]
        # What does not fill a micro-batch: kept so every rank's list has per_rank entries,
        # never trained on (the trainer runs whole micro-batches only).
        rest = order[full : self.per_rank * self.world_size]
        return mine + rest[self.rank :: self.world_size]

    def epoch_order(self, epoch: int, world_size: int, micro_batch_size: int) -> list[int]:
        """The global batches of ``world_size`` x ``micro_batch_size`` examples back to back, then the rest."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        order = torch.randperm(self.num_examples, generator=generator).tolist()
        global_batch = micro_batch_size * world_size
        full = (self.num_examples // global_batch) * global_batch
        batches = []
        group = global_batch * self.group_batches
        for start in range(0, full, group):
            chunk = sorted(order[start : min(start + group, full)], key=lambda index: (-self.lengths[index], index))
            batches += [chunk[i : i + global_batch] for i in range(0, len(chunk), global_batch)]
        shuffled = torch.randperm(len(batches), generator=generator).tolist()
        return [index for b in shuffled for index in batches[b]] + order[full:]
