"""Wan VACE (Wan 2.1 VACE, Wan 2.2 VACE-Fun A14B): Wan's transformer with a control branch (``WanVACETransformer3DModel``).

Not registered as an entry yet: what is here is held to diffusers' own blocks
(``tests/unit/diffusion/test_wan_vace.py``), what is missing is said in docs/video.md
("Wan 2.2 VACE: not yet an entry").

The control branch sees ``control_hidden_states``, which diffusers' ``WanVaceEncoderStep`` (the
``vace_encoder`` block of ``Wan22VaceBlocks``) and ``WanVACEPipeline`` build from three inputs:

- the control video (grey where the user gives none) and its mask (1: generate, 0: keep), binarised at 0.5;
  the VAE encodes ``video * (1 - mask)`` (what is kept) and ``video * mask`` (what is reworked), each as the
  distribution's mode and normalised per channel, 16 + 16 channels;
- the mask itself, folded 8x8 into 64 channels and resampled to the latent frames (nearest-exact);
- reference images, each encoded alone as one latent frame (with 16 zero channels, and a zero mask) and
  put before the clip's frames, the last given first (the block prepends them one by one); the noisy
  latents then carry as many more frames, which the pipeline trims after denoising.

The denoiser is called as ``Wan22LoopDenoiser`` (``transformer_cls=WanVACETransformer3DModel``) calls it:
Wan's arguments plus ``control_hidden_states`` and its per-layer scale (``conditioning_scale``, 1 by default).
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.bases.wan import WanCall


def _normalized_mode(vae, pixels: torch.Tensor, mean: torch.Tensor, inverse_std: torch.Tensor) -> torch.Tensor:
    """The VAE's latents of these pixels (the distribution's mode), normalised per channel as the pipeline does."""
    latents = vae.encode(pixels).latent_dist.mode()
    return ((latents.float() - mean) * inverse_std).to(pixels.dtype)


def folded_mask(mask: torch.Tensor, vae_factor: int, temporal_factor: int, patch: int, references: int) -> torch.Tensor:
    """A (frames, height, width) mask in [0, 1] as the control branch reads it: 8x8 pixels folded into 64 channels,
    resampled to the latent frames, and a zero frame per reference image before them."""
    frames, height, width = mask.shape
    latent_frames = (frames + temporal_factor - 1) // temporal_factor
    latent_height = height // (vae_factor * patch) * patch
    latent_width = width // (vae_factor * patch) * patch
    folded = mask.view(frames, latent_height, vae_factor, latent_width, vae_factor).permute(2, 4, 0, 1, 3).flatten(0, 1)
    folded = torch.nn.functional.interpolate(folded[None], size=(latent_frames, latent_height, latent_width), mode="nearest-exact")[0]
    if references:
        folded = torch.cat([torch.zeros_like(folded[:, :references]), folded], dim=1)
    return folded


@torch.no_grad()
def control_hidden_states(vae, video: torch.Tensor, mask: torch.Tensor, references: list[torch.Tensor], patch: int = 2) -> torch.Tensor:
    """The control branch's input for one clip: (1, 96, references + latent frames, h, w).

    ``video``: (1, 3, frames, H, W) in [-1, 1]; ``mask``: (1, 3, frames, H, W) in [0, 1] (1: generate); ``references``:
    (3, H, W) images in [-1, 1], already fitted to the clip's size (the pipeline letterboxes them on white).
    """
    config = vae.config
    mean = torch.tensor(config.latents_mean, device=video.device, dtype=torch.float32).view(1, config.z_dim, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(config.latents_std, device=video.device, dtype=torch.float32).view(1, config.z_dim, 1, 1, 1)
    binary = torch.where(mask > 0.5, 1.0, 0.0).to(video.dtype)
    latents = torch.cat([_normalized_mode(vae, video * (1 - binary), mean, inverse_std), _normalized_mode(vae, video * binary, mean, inverse_std)], dim=1)[0]
    for reference in references:
        reference = _normalized_mode(vae, reference[None, :, None].to(video.dtype), mean, inverse_std)[0]
        latents = torch.cat([torch.cat([reference, torch.zeros_like(reference)], dim=0), latents], dim=1)
    vae_factor = 2 ** len(config.temperal_downsample)
    temporal_factor = 2 ** sum(config.temperal_downsample)
    # The mask is folded as given (the pipeline binarises only what the VAE encodes).
    folded = folded_mask(mask[0, 0].to(video.dtype), vae_factor, temporal_factor, patch, len(references))
    return torch.cat([latents, folded.to(latents.dtype)], dim=0)[None]


class WanVaceCall(WanCall):
    """Wan's call with the control branch's input (``condition["vace_context"]``) and its per-layer scale (``condition["vace_scale"]``,
    where given; the transformer takes 1 for every control layer otherwise, as ``conditioning_scale=1.0`` gives)."""

    def inputs(self, model_input, timesteps, condition, context):
        return {
            **super().inputs(model_input, timesteps, condition, context),
            "control_hidden_states": condition["vace_context"].to(model_input.dtype),
            "control_hidden_states_scale": condition.get("vace_scale"),
        }
