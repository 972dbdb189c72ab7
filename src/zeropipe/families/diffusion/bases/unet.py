"""What the UNet entries (SD 1.5, SDXL) share: the denoiser call of a ``UNet2DConditionModel``, for training and the planner's trace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zeropipe.families.diffusion.roles import DenoiserCall


@dataclass(eq=False)
class UNetCall(DenoiserCall):
    """A ``UNet2DConditionModel`` called as the Stable Diffusion pipelines call it; ``added_conditions``: with SDXL's pooled text and size ids."""

    added_conditions: bool = False

    def inputs(self, model_input, timesteps, condition, context):
        inputs = {"sample": model_input, "timestep": timesteps, "encoder_hidden_states": condition["prompt_embeds"]}
        if self.added_conditions:
            inputs["added_cond_kwargs"] = {"text_embeds": condition["pooled_prompt_embeds"], "time_ids": condition["time_ids"]}
        return inputs

    def output(self, out):
        return out.sample

    def trace_batch(self, config: Any, latent_side: int, latent_frames: int, text_tokens: int, dtype: torch.dtype):
        condition = {"prompt_embeds": torch.randn(1, text_tokens, config.cross_attention_dim, dtype=dtype)}
        if getattr(config, "addition_embed_type", None) == "text_time":
            pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            condition.update(pooled_prompt_embeds=torch.randn(1, pooled, dtype=dtype), time_ids=torch.randn(1, 6, dtype=dtype))
        return torch.randn(1, config.in_channels, latent_side, latent_side, dtype=dtype), torch.tensor([500]), condition

