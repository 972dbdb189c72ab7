"""SkyReels-V2 image-to-video: Wan 2.1 I2V's conditioning on SkyReels' transformer (``SkyReelsV2ImageToVideoPipeline``).

The VAE encodes the clip with every frame but the first set to zero; a 4-channel mask marks the
first latent frame; both are concatenated to the noisy latents (16 + 4 + 16 = 36 channels), and
the first frame's CLIP ViT-H embeddings (the penultimate hidden states, by the pipeline's own
``encode_image``) reach the added key/value projections, as in Wan 2.1 I2V.
"""

from __future__ import annotations

import dataclasses

from zeropipe.families.diffusion.bases.skyreels_v2 import ARCHITECTURE as T2V
from zeropipe.families.diffusion.bases.skyreels_v2 import tiny_preset
from zeropipe.families.diffusion.bases.wan_i2v import ARCHITECTURE as WAN_I2V
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import FirstFrame, FirstFrameEmbeddings
from zeropipe.families.diffusion.roles import Assembly


class SkyReelsV2ImageToVideoAssembly(Assembly):
    """The tiny preset's CLIP image encoder and its processor (transformers' classes), besides the denoiser."""

    def tiny_component(self, name, fields):
        if name == "image_encoder":
            from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

            return CLIPVisionModelWithProjection(CLIPVisionConfig(**fields))
        if name == "image_processor":
            from transformers import CLIPImageProcessor

            return CLIPImageProcessor(**fields)
        return super().tiny_component(name, fields)


def _preset() -> dict:
    preset = tiny_preset(5.0)
    latent = preset["transformer"]["in_channels"]
    preset["transformer"].update({"in_channels": latent + T2V.record.codec.frame_multiple + latent, "image_dim": 32, "added_kv_proj_dim": 32})
    # CLIP ViT-H's layout, tiny: 32-pixel images in 8-pixel patches.
    preset["image_encoder"] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 32, "patch_size": 8, "projection_dim": 32}
    preset["image_processor"] = {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}
    return preset


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        T2V.record,
        name="skyreels-v2-i2v",
        trace_frames=97,
        pipeline_class="SkyReelsV2ImageToVideoPipeline",
        conditions=(FirstFrame(), FirstFrameEmbeddings(("image_encoder", "image_processor"))),
        preset_name="tiny-skyreels-v2-i2v",
        preset=_preset(),
    ),
    call=WAN_I2V.call,  # Wan 2.1 I2V's call: latents, mask and first frame concatenated, CLIP embeddings to the added projections
    prompts=T2V.prompts,
    sampling=T2V.sampling,
    layouts=T2V.layouts,
    assembly=SkyReelsV2ImageToVideoAssembly(),
)
