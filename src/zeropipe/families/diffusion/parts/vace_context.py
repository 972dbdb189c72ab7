"""The VACE context condition (Wan VACE, ``WanVACETransformer3DModel``): what the transformer's control branch sees.

diffusers' ``WanVaceEncoderStep`` (the ``vace_encoder`` block of ``Wan22VaceBlocks``) and ``WanVACEPipeline`` build the
control branch's input (``control_hidden_states``, 96 channels) from three inputs:

- the control video (grey where the user gives none) and its mask (1: generate, 0: keep), binarised at 0.5;
  the VAE encodes ``video * (1 - mask)`` (what is kept) and ``video * mask`` (what is reworked), each as the
  distribution's mode and normalised per channel, 16 + 16 channels;
- the mask itself, folded 8x8 into 64 channels and resampled to the latent frames (nearest-exact);
- reference images, each encoded alone as one latent frame (with 16 zero channels, and a zero mask) and
  put before the clip's frames, the last given first (the block prepends them one by one).

``control_hidden_states`` is that function (held to the block by ``tests/unit/diffusion/test_wan_vace.py``).
``VaceFirstFrame`` is the VACE task training takes from the clips alone: the clip's first frame kept and the
rest generated (the control video is the first frame then grey frames, the mask 0 on the first frame and 1
after), as VACE's image-to-video is called; cached per clip as the control branch's input
(``condition["vace_context"]``). Samples call ``WanVACEPipeline`` with a data clip's first frame so laid out as
its ``video`` and ``mask``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zeropipe.data.images import first_frame_image
from zeropipe.families.diffusion.parts.base import Encoding, Inputs, SampleInputs, Sampling
from zeropipe.families.diffusion.parts.first_frame import FirstFrame


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


def first_frame_task(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(video, mask) of VACE's first-frame task for clips (batch, 3, frames, H, W) in [-1, 1]: the first frame then grey (0), kept then generated."""
    video = torch.zeros_like(pixels)
    video[:, :, :1] = pixels[:, :, :1]
    mask = torch.ones_like(pixels)
    mask[:, :, :1] = 0
    return video, mask


@dataclass(frozen=True)
class VaceFirstFrame(FirstFrame):
    """VACE's first-frame task: the control branch's input of each clip (its first frame kept, the rest generated), cached."""

    entry = "vace"
    key_suffix = "-vace-first-frame"

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        pixels = encoding.pixels.to(encoding.vae.dtype)
        video, mask = first_frame_task(pixels)
        return [control_hidden_states(encoding.vae, video[i : i + 1], mask[i : i + 1], [])[0] for i in range(len(pixels))]

    def inputs(self, values: list[torch.Tensor], batch: Inputs) -> dict[str, torch.Tensor]:
        return {"vace_context": torch.stack(values).to(batch.device, batch.dtype)}

    def sample_inputs(self, sampling: Sampling, kwargs: dict[str, Any]) -> SampleInputs:
        """The first frame of the data's first video clip (else its first image), centre-cropped to the sample size, then grey frames;
        the mask black (kept) on it and white (generated) after: WanVACEPipeline's ``video`` and ``mask``."""
        from PIL import Image

        items = sampling.plan.items
        videos = [index for index, item in enumerate(items) if item.get("frames", 1) > 1]
        index = videos[0] if videos else 0
        first = first_frame_image(sampling.load_pixels(index, sampling.bucket, crop="center", flip=False).pixels)
        frames = int(kwargs.get("num_frames") or sampling.plan.sample_frames)
        grey, black, white = (Image.new("RGB", first.size, (value,) * 3) for value in (128, 0, 255))
        video, mask = [first] + [grey] * (frames - 1), [black] + [white] * (frames - 1)
        return SampleInputs(kwargs={"video": video, "mask": mask}, rows=[{"first_frame": items[index]["path"]}] * len(sampling.prompts))
