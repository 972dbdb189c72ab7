"""What the UNet entries (SD 1.5, SDXL) share: the planner's trace inputs of a ``UNet2DConditionModel``."""

from __future__ import annotations

from typing import Any

import torch


def unet_trace_inputs(config: Any, latent_side: int, text_tokens: int, dtype: torch.dtype) -> dict[str, Any]:
    """A ``UNet2DConditionModel``'s inputs for one example (SD 1.x and SDXL): with SDXL's pooled text and size ids where its config adds them."""
    added = None
    if getattr(config, "addition_embed_type", None) == "text_time":
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        added = {"text_embeds": torch.randn(1, pooled, dtype=dtype), "time_ids": torch.randn(1, 6, dtype=dtype)}
    return {
        "sample": torch.randn(1, config.in_channels, latent_side, latent_side, dtype=dtype),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, text_tokens, config.cross_attention_dim, dtype=dtype),
        "added_cond_kwargs": added,
    }
