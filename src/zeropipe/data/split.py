"""Holding out a fraction of the training records for evaluation (``data.eval_fraction``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

import numpy as np

Record = TypeVar("Record")


@dataclass(frozen=True)
class RecordSplit:
    """Which records go to training and which are held out, drawn with a seed.

    The split is by record, before tokenization, so a long text cut into several chunks
    never has chunks on both sides. The same records, fraction and seed give the same split
    (the launcher uses run.seed), and at least one record stays on each side.
    """

    fraction: float
    seed: int
    held_out: bool  # True: select the evaluation records; False: the training ones

    def held_out_positions(self, count: int) -> set[int]:
        if count < 2:
            return set()
        size = min(count - 1, max(1, round(self.fraction * count)))
        order = np.random.default_rng(self.seed).permutation(count)
        return set(order[:size].tolist())

    def select(self, records: Sequence[Record]) -> list[Record]:
        held = self.held_out_positions(len(records))
        return [record for position, record in enumerate(records) if (position in held) == self.held_out]
