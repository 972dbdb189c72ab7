"""What every model family's rank code shares: dtypes by name, parameter counts, the ZeRO-3 context for transformers."""

from __future__ import annotations

import logging
from typing import Any

import torch

from zeropipe.diffusion.architectures.base import DIFFUSERS_LORA_TARGETS  # noqa: F401 - one name for both libraries' defaults

log = logging.getLogger("zeropipe")

# LoRA's usual targets (model.lora.target_modules: auto): the attention projections, as each library names them.
TRANSFORMERS_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

# deepspeed.precision (and --dtype) names to torch dtypes.
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; works on ZeRO-3 partitioned parameters too."""
    trainable = total = 0
    for param in model.parameters():
        numel = getattr(param, "ds_numel", None) or param.numel()
        total += numel
        if param.requires_grad:
            trainable += numel
    return trainable, total


def hf_zero3_config(ds_config: dict[str, Any], zero_stage: int):
    """An HfDeepSpeedConfig under ZeRO-3 (None otherwise); the caller keeps it alive for the whole run.

    transformers holds only a weak reference to it: while it lives, from_pretrained and
    from_config build models inside ``deepspeed.zero.Init``, and generate() knows to keep the
    ranks in step.
    """
    if zero_stage != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def log_partitioning(model) -> None:
    """Say whether construction was partitioned: under ZeRO-3 no rank may hold the full model."""
    params = list(model.parameters())
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    local = sum(p.ds_tensor.numel() for p in partitioned if getattr(p, "ds_tensor", None) is not None)
    full = sum(p.ds_numel for p in partitioned)
    log.info(
        "ZeRO-3: %d of %d parameter tensors partitioned at construction; this rank holds %s of %s elements",
        len(partitioned), len(params), f"{local:,}", f"{full:,}",
    )


def resolve_lora_targets(lora, defaults: tuple[str, ...]) -> list[str] | str:
    """The target_modules argument of peft's LoraConfig: model.lora.target_modules, with "auto" meaning the family's defaults."""
    if lora.target_modules == "auto":
        # A string is a regular expression peft matches against whole module names.
        return defaults if isinstance(defaults, str) else list(defaults)
    if lora.target_modules == "all-linear":
        return "all-linear"
    return list(lora.target_modules)
