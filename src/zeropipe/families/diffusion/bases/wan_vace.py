"""Wan VACE (Wan 2.2 VACE-Fun A14B, Wan 2.1 VACE): Wan's transformer with a control branch (``WanVACETransformer3DModel``).

``WanVACEPipeline`` folders (the published diffusers checkpoints of both: ``model_index.json`` names it, Wan 2.2's
with two experts, ``transformer`` and ``transformer_2``, split at ``boundary_ratio`` 0.875 as Wan 2.2 A14B's) hold
a UMT5 text encoder, Wan's VAE and the VACE transformer: Wan 2.1's blocks plus control blocks at ``vace_layers``
that read ``control_hidden_states`` (``parts/vace_context.py`` builds it as diffusers' ``WanVaceEncoderStep`` does).
The prompts, latents, sampler and ComfyUI layout are Wan's; each expert trains alone, as Wan 2.2 A14B's
(``model.diffusion.min_t`` / ``max_t``, docs/video.md).

The denoiser is called as the Wan 2.2 VACE modular pipeline's ``Wan22LoopDenoiser``
(``transformer_cls=WanVACETransformer3DModel``) calls it: Wan's arguments plus ``control_hidden_states`` and its
per-layer scale (``conditioning_scale``, 1 by default); ``tests/unit/diffusion/test_wan_vace.py`` holds the call to
that block and the control input to ``WanVaceEncoderStep``. The modular pipeline (``Wan22VaceModularPipeline``) is
not the entry's pipeline class: the published folders are ``WanVACEPipeline`` folders, whose own call draws the samples.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from zeropipe.families.diffusion.bases.wan import ARCHITECTURE as WAN_T2V
from zeropipe.families.diffusion.bases.wan import WanCall
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts.vace_context import VaceFirstFrame


class WanVaceCall(WanCall):
    """Wan's call with the control branch's input (``condition["vace_context"]``) and its per-layer scale (``condition["vace_scale"]``,
    where given; the transformer takes 1 for every control layer otherwise, as ``conditioning_scale=1.0`` gives)."""

    def inputs(self, model_input, timesteps, condition, context):
        return {
            **super().inputs(model_input, timesteps, condition, context),
            "control_hidden_states": condition["vace_context"].to(model_input.dtype),
            "control_hidden_states_scale": condition.get("vace_scale"),
        }

    def trace_batch(self, config, latent_side, latent_frames, text_tokens, dtype):
        latents, timesteps, condition = super().trace_batch(config, latent_side, latent_frames, text_tokens, dtype)
        context = torch.randn(1, config.vace_in_channels, latent_frames, latent_side, latent_side, dtype=dtype)
        return latents, timesteps, {**condition, "vace_context": context}


def _preset() -> dict:
    preset = copy.deepcopy(WAN_T2V.record.preset)
    # Control blocks at both layers (the first must be one), reading the 96 channels of the control input.
    preset["transformer"].update({"vace_layers": [0, 1], "vace_in_channels": 96})
    return preset


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        WAN_T2V.record,
        name="wan-vace",
        pipeline_class="WanVACEPipeline",
        related_pipelines=(),
        denoiser_class="WanVACETransformer3DModel",
        conditions=(VaceFirstFrame(),),
        preset_name="tiny-wan-vace",
        preset=_preset(),
    ),
    call=WanVaceCall(),
    prompts=WAN_T2V.prompts,
    sampling=WAN_T2V.sampling,
    layouts=WAN_T2V.layouts,
)
