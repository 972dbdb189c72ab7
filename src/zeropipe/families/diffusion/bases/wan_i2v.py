"""Wan image-to-video (Wan 2.2 I2V A14B's layout): the clip's first frame conditions the transformer.

The VAE encodes the clip with every frame but the first set to zero; a 4-channel mask marks
the first latent frame; both are concatenated to the noisy latents on the channel axis (16 +
4 + 16 = 36 input channels), as ``WanImageToVideoPipeline`` does. Wan 2.1 I2V also feeds the
first frame's CLIP image embeddings (the penultimate hidden states of its ``image_encoder``)
through added key/value projections (``image_dim``): when the pipeline directory has an image
encoder, they are computed by the pipeline's own ``encode_image`` while caching and cached
with the clip's latents.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from zeropipe.families.diffusion.bases.wan import ARCHITECTURE as WAN_T2V
from zeropipe.families.diffusion.bases.wan import WanCall
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import FirstFrame, FirstFrameEmbeddings


class WanI2VCall(WanCall):
    """Wan's call on the noisy latents, the first-frame mask and the first frame's latents, concatenated on the channel axis."""

    def inputs(self, model_input, timesteps, condition, context):
        # The mask WanImageToVideoPipeline.prepare_latents builds: 1 on the first latent frame (all 4 channels), 0 after.
        batch, _, frames, height, width = model_input.shape
        mask = torch.zeros(batch, self.record.codec.frame_multiple, frames, height, width, device=model_input.device, dtype=model_input.dtype)
        mask[:, :, 0] = 1
        hidden = torch.cat([model_input, mask, condition["first_frame_latents"].to(model_input.dtype)], dim=1)
        return super().inputs(hidden, timesteps, condition, context)

    def trace_batch(self, config, latent_side, latent_frames, text_tokens, dtype):
        # The transformer's input channels are the latents', the mask's and the first frame's latents' (16 + 4 + 16).
        latent = (config.in_channels - self.record.codec.frame_multiple) // 2
        latents, timesteps, condition = super().trace_batch(config, latent_side, latent_frames, text_tokens, dtype)
        first_frame = torch.randn(1, latent, latent_frames, latent_side, latent_side, dtype=dtype)
        return latents[:, :latent], timesteps, {**condition, "first_frame_latents": first_frame}


def _preset() -> dict:
    preset = copy.deepcopy(WAN_T2V.record.preset)
    preset["transformer"]["in_channels"] = 16 + WAN_T2V.record.codec.frame_multiple + 16
    return preset


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        WAN_T2V.record,
        name="wan-i2v",
        pipeline_class="WanImageToVideoPipeline",
        related_pipelines=(),
        # The first frame's latents; Wan 2.1 I2V's CLIP embeddings of it where the pipeline folder has the image encoder.
        conditions=(FirstFrame(), FirstFrameEmbeddings(("image_encoder", "image_processor"))),
        preset_name="tiny-wan-i2v",
        preset=_preset(),
    ),
    call=WanI2VCall(),
    prompts=WAN_T2V.prompts,
    sampling=WAN_T2V.sampling,
    layouts=WAN_T2V.layouts,
)
