"""Wan VACE (Wan 2.2 VACE-Fun A14B, Wan 2.1 VACE): Wan's transformer with a control branch (``WanVACETransformer3DModel``).

``WanVACEPipeline`` folders (the published diffusers checkpoints of both: ``model_index.json`` names it, Wan 2.2's
with two experts, ``transformer`` and ``transformer_2``, split at ``boundary_ratio`` 0.875 as Wan 2.2 A14B's) hold
a UMT5 text encoder, Wan's VAE and the VACE transformer: Wan 2.1's blocks plus control blocks at ``vace_layers``
that read ``control_hidden_states`` (``parts/vace_context.py`` builds it as diffusers' ``WanVaceEncoderStep`` does, from
each clip's control clip, mask and reference image in ``data.control_path``, else VACE's first-frame task:
``parts/vace_control.py``).
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
from zeropipe.families.diffusion.bases.wan import WanCall, WanSampling
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts.vace_control import VaceControl


class WanVaceCall(WanCall):
    """Wan's call with the control branch's input (``condition["vace_context"]``) and its per-layer scale (``condition["vace_scale"]``,
    where given; the transformer takes 1 for every control layer otherwise, as ``conditioning_scale=1.0`` gives)."""

    def inputs(self, model_input, timesteps, condition, context):
        return {
            **super().inputs(model_input, timesteps, condition, context),
            "control_hidden_states": condition["vace_context"].to(model_input.dtype),
            "control_hidden_states_scale": condition.get("vace_scale"),
        }

    def predict(self, model, model_input, timesteps, condition, context):
        """The velocity of the clip's frames. A control input with reference frames (``parts/vace_control.py``) has more latent
        frames than the clip, first: the pipeline draws noise for those too and drops them after denoising. Training gives each
        slot the reference image's latents (the control input's first 16 channels there: the VAE's normalised mode, as the
        clip's latents) noised at the clip's noise level (flow: (1 - s) x0 + s noise), and leaves them out of the output
        (and so the loss), as Wan Animate 2's reference slot."""
        import hashlib

        references = condition["vace_context"].shape[2] - model_input.shape[2]
        if references <= 0:
            return super().predict(model, model_input, timesteps, condition, context)
        sigma = (timesteps.float() / 1000).view(-1, 1, 1, 1, 1).to(model_input.dtype)
        reference = condition["vace_context"][:, : model_input.shape[1], :references].to(model_input.dtype)
        # The slots' noise is a function of the batch's noise levels: the same batch gets the same prediction (the fixed-batch
        # loss, a resumed run, an export compared with the run), different batches different noise.
        seed = int.from_bytes(hashlib.sha256(timesteps.detach().float().cpu().numpy().tobytes()).digest()[:8], "little")
        noise = torch.randn(reference.shape, generator=torch.Generator().manual_seed(seed)).to(reference.device, reference.dtype)
        slots = (1 - sigma) * reference + sigma * noise
        return super().predict(model, torch.cat([slots, model_input], dim=2), timesteps, condition, context)[:, :, references:]

    def trace_batch(self, config, latent_side, latent_frames, text_tokens, dtype):
        """The clip with one reference image's slot before it, always: a clip whose control files hold a reference image is called
        on one more latent frame (``predict``), and the planner does not read the data, so it counts that frame for every clip
        (an overcount of 1/(latent frames + 1) of the tokens for clips without one; a clip with several references has more)."""
        frames = latent_frames + TRACED_REFERENCE_SLOTS
        latents, timesteps, condition = super().trace_batch(config, latent_side, frames, text_tokens, dtype)
        context = torch.randn(1, config.vace_in_channels, frames, latent_side, latent_side, dtype=dtype)
        return latents, timesteps, {**condition, "vace_context": context}


TRACED_REFERENCE_SLOTS = 1  # the reference image's latent frames the planner's trace counts before each clip (WanVaceCall.trace_batch)


class WanVaceSampling(WanSampling):
    """Wan's sampling; with ``reference_images`` the pipeline returns (``output_type="latent"``) the reference images' latent
    frames first, which its own decoding drops: so do the samples."""

    def draw(self, pipeline, kwargs):
        return super().draw(pipeline, kwargs)[:, :, len(kwargs.get("reference_images") or []) :]


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
        conditions=(VaceControl(),),
        preset_name="tiny-wan-vace",
        preset=_preset(),
    ),
    call=WanVaceCall(),
    prompts=WAN_T2V.prompts,
    sampling=WanVaceSampling(),
    layouts=WAN_T2V.layouts,
)
