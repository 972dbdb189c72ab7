"""Wan 2.2 TI2V-5B: one 5B Wan transformer on the 48-channel Wan 2.2 VAE, text-to-video and image-to-video with the same weights.

The Wan 2.2 VAE folds 2x2 pixels into 12 channels before a Wan-style causal encoder, so it
compresses 16x in space (4x in time) into 48 latent channels, normalised per channel
(``latents_mean`` / ``latents_std`` in its config). With the transformer's 2x2 patches a bucket
side is a multiple of 32 (as diffusion-pipe rounds it); the model was trained at 24 fps.

``WanPipeline`` saved with ``expand_timesteps: true`` (how diffusers' converter writes
Wan-AI/Wan2.2-TI2V-5B-Diffusers) gives the transformer one timestep per token instead of one
per clip. Image-to-video (``WanImageToVideoPipeline`` with ``expand_timesteps``) has no mask
channels and no CLIP: the first latent frame *is* the image's latents (the first frame encoded
alone), told timestep 0, and the pipeline overwrites that frame after every step. Training does
the same: the clean first frame replaces the noisy one, its tokens get timestep 0, and the loss
leaves it out (``loss_region``), as DiffSynth-Studio trains it.

The LoRA's ComfyUI layout is Wan's (see ``wan.py``).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from zeropipe.families.diffusion.bases.wan import ARCHITECTURE as WAN_T2V
from zeropipe.families.diffusion.bases.wan import WAN_SCHEDULER, WanCall
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import PerChannelVideoLatents

LATENT_CHANNELS = 48  # the Wan 2.2 VAE's z_dim


def token_timesteps(timesteps: torch.Tensor, first_frame_mask: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """One timestep per transformer token, as the expand_timesteps pipelines build it: ``mask[:, ::p, ::p] * t`` flattened.

    ``first_frame_mask`` is (frames, height, width) latents, 0 where the latents are given (timestep 0).
    """
    _, patch_h, patch_w = patch
    per_token = first_frame_mask[:, ::patch_h, ::patch_w].flatten()
    return per_token[None, :] * timesteps.float()[:, None]


class WanTI2VCall(WanCall):
    """TI2V-5B's transformer called as the ``expand_timesteps`` pipelines call it: Wan's inputs with one timestep per token.

    The per-token timesteps need the transformer's patch size, read from the model, so ``predict`` sets them.
    """

    def first_frame_mask(self, latents: torch.Tensor) -> torch.Tensor:
        """1 where the latents are noised (every frame for text-to-video)."""
        return torch.ones(latents.shape[2:], device=latents.device, dtype=torch.float32)

    def predict(self, model, model_input, timesteps, condition, context):
        module = getattr(model, "module", model)  # the DeepSpeed engine wraps the transformer
        inputs = self.inputs(model_input, timesteps, condition, context)
        inputs["timestep"] = token_timesteps(timesteps, self.first_frame_mask(model_input), tuple(module.config.patch_size))
        return self.output(model(**inputs, return_dict=False))

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        inputs = super().trace_inputs(config, latent_side, latent_frames, text_tokens, dtype)
        tokens = latent_frames * (latent_side // config.patch_size[1]) * (latent_side // config.patch_size[2])
        return {**inputs, "timestep": torch.full((1, tokens), 500.0)}


class WanTI2VImageToVideoCall(WanTI2VCall):
    """Image-to-video on the same weights: the first latent frame is the image's latents, at timestep 0, left out of the loss."""

    def first_frame_mask(self, latents):
        mask = super().first_frame_mask(latents)
        mask[0] = 0
        return mask

    def predict(self, model, model_input, timesteps, condition, context):
        # WanImageToVideoPipeline: (1 - mask) * condition + mask * latents, the condition one latent frame broadcast over time.
        mask = self.first_frame_mask(model_input).to(model_input.dtype)
        given = condition["first_frame_latents"].to(model_input.dtype)
        hidden = (1 - mask) * given + mask * model_input
        return super().predict(model, hidden, timesteps, condition, context)

    def loss_region(self, prediction, target):
        return prediction[:, :, 1:], target[:, :, 1:]  # the first latent frame is the given image, not denoised


def tiny_preset() -> dict:
    preset = copy.deepcopy(WAN_T2V.record.preset)
    preset["transformer"].update({"in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS})
    # The Wan 2.2 VAE's layout (2x2 pixel patches into 12 channels, residual down blocks, a wider decoder), tiny.
    preset["vae"] = {
        "base_dim": 16, "decoder_base_dim": 16, "z_dim": LATENT_CHANNELS, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
        "temperal_downsample": [False, True, True], "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
        "scale_factor_spatial": 16, "scale_factor_temporal": 4,
        "latents_mean": [0.0] * LATENT_CHANNELS, "latents_std": [1.0] * LATENT_CHANNELS,
    }
    # TI2V-5B's sampler: Wan's UniPC with a flow shift of 5 (diffusers' converter).
    preset["scheduler"] = {**WAN_SCHEDULER, "flow_shift": 5.0}
    return preset


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        WAN_T2V.record,
        name="wan-ti2v",
        trace_frames=121,  # WanPipeline's clip for TI2V-5B in its model card: 5 s at 24 fps
        pipeline_settings=(("expand_timesteps", True),),
        related_pipelines=(),
        codec=PerChannelVideoLatents(vae_class="AutoencoderKLWan", frame_multiple=4, frame_rate=24.0),
        preset_name="tiny-wan-ti2v",
        preset=tiny_preset(),
        # As model_index.json of Wan2.2-TI2V-5B-Diffusers says: a timestep per token (and one transformer).
        pipeline_kwargs={**WAN_T2V.record.pipeline_kwargs, "expand_timesteps": True},
    ),
    call=WanTI2VCall(),
    prompts=WAN_T2V.prompts,
    sampling=WAN_T2V.sampling,
    layouts=WAN_T2V.layouts,
)
