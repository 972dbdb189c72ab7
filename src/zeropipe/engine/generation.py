"""Sampling from the policy inside the training loop, under ZeRO-3 without gathering weights token by token.

Under ZeRO-3 every forward pass gathers each layer's weights from all ranks and frees them after:
``generate`` makes one forward pass per new token, so a round of sampling makes
``max_new_tokens`` x layers all-gathers, and every rank must make the same number of them
(``synced_gpus``: a rank whose completions ended keeps running dummy passes). That is what makes
generation under ZeRO-3 slow or hang (TRL#4100, ms-swift#7986).

:func:`gathered_for_generation` gathers the whole model once per round
(``deepspeed.zero.GatheredParameters``) and takes DeepSpeed's forward hooks off the module while it
generates, as TRL's ``unwrap_model_for_generation`` does: each rank then samples on its own
with full weights and no collective at all, so ranks that stop early wait for nobody and a rank
never waits inside generate. The price is the full model's weights on each rank for the round
(the planner counts them, ``plan.memory``). ``benchmarks/grpo_generation.py`` measures both ways.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator

import torch


def _offload(engine):
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        return None
    return getattr(optimizer, "parameter_offload", optimizer)


def _all_parameters(module) -> list:
    return [p for _, p in itertools.chain(module.named_parameters(recurse=True), *(m.ds_external_parameters() for m in module.modules() if hasattr(m, "ds_external_parameters")))]


def _remove_zero3_hooks(engine) -> None:
    offload = _offload(engine)
    if offload is None or not hasattr(offload, "forward_hooks"):
        return
    for parameter in _all_parameters(offload.module):
        if hasattr(parameter, "ds_active_sub_modules"):
            parameter.ds_active_sub_modules.clear()
    for hook in itertools.chain(offload.forward_hooks, offload.backward_hooks):
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def _restore_zero3_hooks(engine) -> None:
    offload = _offload(engine)
    if offload is None or not hasattr(offload, "forward_hooks"):
        return
    coordinator = getattr(offload, "param_coordinator", None)
    if coordinator is not None and not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()  # the generation passes are not the training step's trace
    offload._register_deepspeed_module(offload.module)


@contextlib.contextmanager
def gathered_for_generation(engine, zero_stage: int) -> Iterator[torch.nn.Module]:
    """The engine's module, in eval mode, with full weights and no ZeRO-3 hooks for the block (a collective on entry and exit)."""
    module = engine.module
    was_training = module.training
    module.eval()
    try:
        if zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                _remove_zero3_hooks(engine)
                try:
                    yield module
                finally:
                    _restore_zero3_hooks(engine)
        else:
            yield module
    finally:
        module.train(was_training)


@contextlib.contextmanager
def gathered_reference(reference: torch.nn.Module, zero_stage: int) -> Iterator[torch.nn.Module]:
    """A frozen reference model built under ``zero.Init`` (no engine, no hooks), whole for the block: one all-gather in, its shards kept out.

    Under ZeRO-3 each rank keeps 1/ranks of the reference; its forward pass needs every weight,
    gathered once for the round like the policy's, not layer by layer (a collective: all ranks enter).
    """
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(reference.parameters())):
            yield reference
    else:
        yield reference


def sample_completions(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    eos_token_id: int,
    pad_token_id: int,
    seed: int,
    synced_gpus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``num_generations`` completions per left-padded prompt, cut after their first EOS.

    Returns (completion ids (prompts x G, length) padded with ``pad_token_id``, completion mask
    (1 through the EOS), truncated (reached ``max_new_tokens`` without EOS)). Sampling draws from
    a generator seeded with ``seed`` (each rank and step its own), so a resumed run samples what
    the uninterrupted one did.
    """
    devices = [prompt_ids.device] if prompt_ids.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        with torch.no_grad():
            output = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_new_tokens=max_new_tokens,
                num_return_sequences=num_generations,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
                use_cache=True,
                synced_gpus=synced_gpus,
            )
    completions = output[:, prompt_ids.shape[1] :]
    is_eos = completions == eos_token_id
    length = completions.shape[1]
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], length, dtype=torch.long))
    positions = torch.arange(length, device=completions.device).unsqueeze(0)
    mask = (positions <= first_eos.unsqueeze(1)).long()
    completions = completions.masked_fill(mask == 0, pad_token_id)
    truncated = ~is_eos.any(1)
    return completions, mask, truncated
