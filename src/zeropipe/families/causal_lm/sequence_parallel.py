"""Ulysses sequence parallelism for the causal LM, through DeepSpeed's ALST parts (``parallel.sequence_parallel_size``).

Ranks form groups of N consecutive ranks (DeepSpeed's ``parallel_state_sp``: ranks 0..N-1,
N..2N-1, ...). Every rank of a group reads the same micro-batch (the sampler deals the data
over world / N data-parallel ranks) and keeps 1/N of its tokens; DeepSpeed's
``UlyssesSPAttentionHF`` replaces the model's attention function so that, inside attention,
an all-to-all trades the sequence split for a split of the heads and each rank attends over
the whole sequence with 1/N of the heads. ZeRO still partitions over all ranks, and DeepSpeed
averages gradients over world / N (its ``sequence_parallel_size`` in the JSON and the ``mpu``).

The loss: each rank sums the token losses of its shard and divides by the number of labelled
tokens of the whole group's micro-batch, so the group's gradients add up to those of the
micro-batch's mean loss, the loss a data-parallel rank takes of the same micro-batch (times N
under ZeRO-3, whose reduce-scatter divides by all the ranks: see :func:`group_loss`).
"""

from __future__ import annotations

from typing import Any

import torch


def register(model: torch.nn.Module, attn_implementation: str, size: int, micro_batch_size: int):
    """Put DeepSpeed's Ulysses attention in place of ``attn_implementation`` and make the SP groups (a collective).

    Returns:
        DeepSpeed's ``parallel_state_sp`` module: the ``mpu`` deepspeed.initialize takes.
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=attn_implementation,
        sequence_parallel_size=size,
        micro_batch_size=micro_batch_size,
        seq_length_is_variable=True,
        # Held-out evaluation and generation run in eval mode, each rank on whole sequences of its own:
        # the model's own attention then, unsplit (transformers' causal sdpa; right padding only follows real tokens).
        disable_in_eval=True,
    )


def shard_batch(batch: dict[str, torch.Tensor], size: int, rank: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """This rank's 1/``size`` of a padded micro-batch: input_ids, position_ids and the next-token labels.

    The sequence is padded to a multiple of ``size`` (pad tokens, labels -100). Labels are
    shifted before the split (``shift_labels``), so the token that predicts the first token
    of the next rank's shard keeps its label. No attention mask: Ulysses attends causally by
    position, and right padding sits after every real token, so no real token sees a pad.
    """
    input_ids, labels = batch["input_ids"], batch["labels"]
    if "position_ids" in batch:
        position_ids = batch["position_ids"]
    else:
        position_ids = torch.arange(input_ids.shape[1], dtype=torch.long).expand_as(input_ids)
    length = input_ids.shape[1]
    padded = -(-length // size) * size
    if padded != length:
        extra = padded - length
        input_ids = torch.nn.functional.pad(input_ids, (0, extra), value=pad_token_id)
        labels = torch.nn.functional.pad(labels, (0, extra), value=-100)
        last = position_ids[:, -1:]
        position_ids = torch.cat([position_ids, last + torch.arange(1, extra + 1, dtype=position_ids.dtype)], dim=1)
    shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    chunk = padded // size
    part = slice(chunk * rank, chunk * (rank + 1))
    return {"input_ids": input_ids[:, part].contiguous(), "position_ids": position_ids[:, part].contiguous(), "shift_labels": shift_labels[:, part].contiguous()}


def group_loss(engine: Any, shard: dict[str, torch.Tensor], group, device: torch.device, zero_stage: int, tiled: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate on this rank, the group's mean loss for the metrics) of one sharded micro-batch.

    ``tiled``: (LM head, tile tokens, ZeRO-3 or not) for ``parallel.tiled_loss`` (the shard's logits never whole), else None.
    """
    import deepspeed.comm as dist

    shift_labels = shard["shift_labels"].to(device)
    inputs = {"input_ids": shard["input_ids"].to(device), "position_ids": shard["position_ids"].to(device)}
    if tiled is not None:
        from zeropipe.families.causal_lm.tiled_loss import tiled_sum_of_shifted

        head, tile, zero3 = tiled
        token_sum = tiled_sum_of_shifted(engine, head, tile, zero3, shift_labels=shift_labels, **inputs)
    else:
        logits = engine(**inputs, use_cache=False).logits
        token_sum = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100, reduction="sum")
    figures = torch.stack([token_sum.detach().double(), (shift_labels != -100).sum().double()])
    dist.all_reduce(figures, group=group)
    labelled = figures[1].clamp(min=1)
    # ZeRO-3's reduce-scatter of gradients (stage3.py __avg_scatter_grads -> reduce_scatter_coalesced) divides by
    # every rank, not by world / N as its other paths and ZeRO-1/2 do: the group's gradients are N times too
    # small unless the loss carries N (measured: the gradient norm was half the data-parallel one at N=2).
    scale = group.size() if zero_stage == 3 else 1
    return token_sum * scale / labelled.to(token_sum.dtype), figures[0] / labelled
