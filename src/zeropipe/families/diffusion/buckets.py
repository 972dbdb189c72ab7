"""Aspect-ratio buckets and the micro-batches each rank gets per epoch (diffusion training's batching).

An image is read and fitted to its bucket by ``data/images.py``; here: which buckets there are, which
one an image goes to, and how an epoch's images are dealt to ranks as one-bucket micro-batches.
"""

from __future__ import annotations

import math
import random
from collections import Counter


# ---------------------------------------------------------------------------------------------
# Aspect-ratio buckets


def make_buckets(resolution: int, step: int = 64, max_aspect: float = 2.0) -> list[tuple[int, int]]:
    """Aspect-ratio buckets ``(width, height)`` of about ``resolution**2`` pixels, as kohya and SDXL use.

    For each width that is a multiple of ``step``, the largest multiple-of-``step`` height
    with ``width * height <= resolution**2``, and the transpose; only aspect ratios within
    ``[1 / max_aspect, max_aspect]`` are kept. Sorted by width.

    Raises:
        ValueError: ``step`` larger than ``resolution``, or a non-positive argument.
    """
    if step < 1 or resolution < step:
        raise ValueError(f"bucket step {step} must be between 1 and the resolution {resolution}: lower the step (64 suits 512-1024 px, 8 tiny tests)")
    if max_aspect < 1:
        raise ValueError(f"max_aspect {max_aspect} must be at least 1 (2.0 allows 1:2 to 2:1)")
    max_area = resolution * resolution
    buckets = set()
    # width * height <= area and width / height <= max_aspect give width <= resolution * sqrt(max_aspect).
    widest = int(resolution * math.sqrt(max_aspect)) + step
    for width in range(step, widest + 1, step):
        height = (max_area // width) // step * step
        if height < step:
            break
        if 1 / max_aspect <= width / height <= max_aspect:
            buckets.add((width, height))
            buckets.add((height, width))
    return sorted(buckets)


def assign_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest to the image's (on a log scale, so 2:1 and 1:2 are as far from 1:1)."""
    if not buckets:
        raise ValueError("no buckets to choose from: build them with make_buckets")
    if width <= 0 or height <= 0:
        raise ValueError(f"image size {width}x{height} is not positive")
    image_log_aspect = math.log(width / height)
    # Ties go to the larger bucket: less upscaling, more detail kept.
    return min(buckets, key=lambda bucket: (abs(math.log(bucket[0] / bucket[1]) - image_log_aspect), -bucket[0] * bucket[1]))


# ---------------------------------------------------------------------------------------------
# Micro-batches per rank


def _check_batching(buckets_of_items, repeats, micro_batch_size: int, world_size: int) -> None:
    if len(buckets_of_items) != len(repeats):
        raise ValueError(f"{len(buckets_of_items)} buckets but {len(repeats)} repeat counts: give one of each per image")
    if micro_batch_size < 1 or world_size < 1:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) and world_size ({world_size}) must be at least 1")
    if any(count < 0 for count in repeats):
        raise ValueError("repeat counts cannot be negative")


def epoch_micro_batches(
    buckets_of_items: list[tuple[int, int]],
    repeats: list[int],
    micro_batch_size: int,
    world_size: int,
    seed: int,
    epoch: int,
) -> list[list[list[int]]]:
    """Every rank's micro-batches for ``epoch``: ``result[rank]`` is a list of lists of image indices.

    Each image index appears ``repeats[index]`` times per epoch (so it may appear twice in one
    micro-batch, as in kohya). Each micro-batch holds one bucket only, since its images are
    stacked into one tensor. Every rank calls this on its own and gets the same answer: the
    order comes only from ``seed`` and ``epoch``. Leftovers are dropped (each bucket's last
    partial micro-batch, then the micro-batches that cannot be dealt evenly) so that every
    rank gets exactly :func:`micro_batches_per_rank` micro-batches: a rank with one more
    would wait forever in a collective the others never enter.
    """
    _check_batching(buckets_of_items, repeats, micro_batch_size, world_size)
    rng = random.Random(seed * 1000003 + epoch)
    indices_by_bucket: dict[tuple[int, int], list[int]] = {}
    for index, (bucket, count) in enumerate(zip(buckets_of_items, repeats)):
        indices_by_bucket.setdefault(tuple(bucket), []).extend([index] * count)
    micro_batches = []
    # Sorted so the random stream is consumed in the same order whatever order the images came in.
    for bucket in sorted(indices_by_bucket):
        indices = indices_by_bucket[bucket]
        rng.shuffle(indices)
        full = len(indices) // micro_batch_size * micro_batch_size
        micro_batches += [indices[start : start + micro_batch_size] for start in range(0, full, micro_batch_size)]
    rng.shuffle(micro_batches)
    per_rank = len(micro_batches) // world_size
    dealt = micro_batches[: per_rank * world_size]
    return [dealt[rank::world_size] for rank in range(world_size)]


def micro_batches_per_rank(buckets_of_items: list[tuple[int, int]], repeats: list[int], micro_batch_size: int, world_size: int) -> int:
    """How many micro-batches each rank gets per epoch; the same for every epoch (the shuffle does not change the counts)."""
    _check_batching(buckets_of_items, repeats, micro_batch_size, world_size)
    images_per_bucket: Counter[tuple[int, int]] = Counter()
    for bucket, count in zip(buckets_of_items, repeats):
        images_per_bucket[tuple(bucket)] += count
    return sum(count // micro_batch_size for count in images_per_bucket.values()) // world_size
