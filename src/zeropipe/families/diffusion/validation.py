"""The validation loss of a diffusion run: the denoiser's loss on held-out items at fixed timesteps and fixed noise.

A diffusion model's training loss jumps with the timesteps drawn for each batch, so two runs'
curves, or two points of one curve, cannot be compared. diffusion-pipe's answer, which
ai-toolkit and SimpleTuner follow, is used here: every held-out item (``data.eval_path``, or
``data.eval_fraction`` of ``data.path``) is noised at each of nine fixed quantiles of the
timestep distribution the run trains on (0.1 to 0.9, so min_t/max_t, the shift and
logit-normal sampling are respected), and ``eval_loss`` is the mean over the quantiles of the
mean over the items; each quantile's mean is kept too (``eval_loss_by_quantile``).

Unlike diffusion-pipe, whose eval noise is seeded by rank, the latent sample and the noise of
an item come from a seed of that item (``run.seed`` and its place among the held-out items),
and each item is one forward pass of its own: the figure is the same on any number of ranks,
every time it is computed, and equals what ``zeropipe eval`` computes in-process from the
checkpoint (:mod:`zeropipe.families.diffusion.evaluation`). Its draws never touch the training's random streams.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

EVAL_KIND = "eval"  # the "kind" of eval rows in metrics.jsonl, as the language models' (causal_lm.evaluation)
EVAL_QUANTILES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # diffusion-pipe's TIMESTEP_QUANTILES_FOR_EVAL


def item_seed(run_seed: int, position: int) -> int:
    """The seed of the held-out item at ``position``: its latent sample and noise, whichever rank evaluates it."""
    return (run_seed * 1_000_003 + 7_919 * (position + 1)) % 2**63


def rank_positions(count: int, rank: int, world_size: int) -> tuple[list[int], int]:
    """(this rank's held-out positions, the number of items every rank passes over).

    Under ZeRO-3 each forward pass is a collective, so a rank with fewer items repeats one
    (uncounted) until all have made the same number of passes.
    """
    return list(range(rank, count, world_size)), max(1, math.ceil(count / world_size))


@torch.no_grad()
def item_losses(task: Any, index: int, position: int) -> list[float]:
    """The loss of one held-out item at each of :data:`EVAL_QUANTILES`, each a forward pass of its own.

    ``task`` is a :class:`~zeropipe.families.diffusion.task.DiffusionTask` (in a rank, or built
    in-process by :func:`evaluate_diffusion_checkpoint`). The global random streams are seeded
    for the item and restored after, so training draws exactly what it would have without it.
    """
    seed = item_seed(task.config.run.seed, position)
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        latents, condition = task.assemble([index], augment=False)  # no flip, no caption dropout; the latent sample from the item's seed
        generator = torch.Generator().manual_seed(seed)
        losses = []
        for quantile in EVAL_QUANTILES:
            noised = task.objective.noise(latents, generator=generator, quantiles=torch.tensor([quantile], dtype=torch.float64))
            losses.append(float(task.arch.call.loss(task.engine, noised, condition, task.predict_context).float()))
    random.setstate(python_state)
    return losses


def eval_record(step: int, per_item: torch.Tensor, seconds: float) -> dict[str, Any]:
    """The metrics.jsonl row of one evaluation, from the (items, quantiles) losses."""
    by_quantile = per_item.double().mean(dim=0)
    return {
        "kind": EVAL_KIND,
        "step": step,
        "eval_loss": float(by_quantile.mean()),
        "eval_loss_by_quantile": {f"{q:.1f}": float(loss) for q, loss in zip(EVAL_QUANTILES, by_quantile)},
        "eval_examples": int(per_item.shape[0]),
        "eval_time_s": seconds,
    }


def evaluate_in_ranks(task: Any) -> torch.Tensor:
    """Every rank's share of the held-out items, gathered: the (items, quantiles) losses on every rank. A collective."""
    import deepspeed.comm as dist

    items = task.data.eval_items
    # Shared by data-parallel rank: under sequence parallelism the ranks of a group split one item's
    # tokens, so they pass over the same items, and one rank of the group writes each row.
    trainer = getattr(task, "trainer", None)
    data_rank = getattr(trainer, "data_rank", task.rank)
    data_world = getattr(trainer, "data_world", task.world_size)
    writes = getattr(trainer, "sp_rank", 0) == 0
    mine, passes = rank_positions(len(items), data_rank, data_world)
    table = torch.zeros((len(items), len(EVAL_QUANTILES)), dtype=torch.float64)
    for number in range(passes):
        position = mine[number] if number < len(mine) else (mine or [0])[-1]
        losses = item_losses(task, items[position], position)  # run even when not counted: under ZeRO-3 the other ranks wait for it
        if number < len(mine) and writes:
            table[position] = torch.tensor(losses, dtype=torch.float64)
    # Each row is written by one rank and zero on the others: the sum is exact, whatever the rank count.
    total = table.to(task.device)
    dist.all_reduce(total)
    return total.cpu()
