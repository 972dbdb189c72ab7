"""HunyuanVideo 1.5 image-to-video: the clip's first frame conditions the transformer by its latents and its SigLIP embeddings.

As ``HunyuanVideo15ImageToVideoPipeline`` builds them: the first frame encoded alone (the
distribution's mode, times the VAE's ``scaling_factor``) fills the condition channels of the
first latent frame (zeros after it), the mask channel is 1 on that frame, and SigLIP's last
hidden states of the image (729 tokens) are the image embeddings. Every latent frame is
denoised and trained (the first one too: the condition is an input, not a replacement).
Both are cached with the clip's latents (the SigLIP embeddings by the pipeline's own
``encode_image``); samples start from a data clip's first frame.
"""

from __future__ import annotations

import dataclasses

import torch

from zeropipe.families.diffusion.bases.hunyuan_video15 import ARCHITECTURE as T2V
from zeropipe.families.diffusion.bases.hunyuan_video15 import HunyuanVideo15Assembly, HunyuanVideo15Call, HunyuanVideo15Sampling, guider
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import FirstFrameAlone, FirstFrameEmbeddings

IMAGE_COMPONENTS = ("image_encoder", "feature_extractor")


@dataclasses.dataclass(frozen=True)
class SiglipFirstFrameEmbeddings(FirstFrameEmbeddings):
    """The first frame's SigLIP embeddings, by ``HunyuanVideo15ImageToVideoPipeline.encode_image``."""

    def embed(self, pipeline, images, device):
        return pipeline.encode_image(images, batch_size=1, device=device, dtype=torch.float32)


class HunyuanVideo15ImageToVideoCall(HunyuanVideo15Call):
    def image_conditioning(self, model_input, condition, image_embed_dim):
        batch, _, frames, height, width = model_input.shape
        first = condition["first_frame_latents"].to(model_input.dtype)  # (batch, channels, 1, h, w)
        latents = torch.cat([first, first.new_zeros(batch, first.shape[1], frames - 1, height, width)], dim=2)
        mask = model_input.new_zeros(batch, 1, frames, height, width)
        mask[:, :, 0] = 1.0
        return torch.cat([latents, mask], dim=1), condition["image_embeds"]


class HunyuanVideo15ImageToVideoSampling(HunyuanVideo15Sampling):
    def draw(self, pipeline, kwargs):
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        # The pipeline sizes the video from the image (its bucket nearest the transformer's target_size) and crops the
        # image with its own processor, which the shared assembly replaced by a plain VideoProcessor: made again as
        # HunyuanVideo15ImageToVideoPipeline.__init__ makes it.
        pipeline.video_processor = HunyuanVideo15ImageProcessor(vae_scale_factor=pipeline.vae_scale_factor_spatial, do_resize=False, do_convert_rgb=True)
        return super().draw(pipeline, {key: value for key, value in kwargs.items() if key not in ("height", "width")})


class HunyuanVideo15ImageToVideoAssembly(HunyuanVideo15Assembly):
    def tiny_component(self, name, fields):
        if name == "image_encoder":
            from transformers import SiglipVisionConfig, SiglipVisionModel

            return SiglipVisionModel(SiglipVisionConfig(**fields))
        if name == "feature_extractor":
            from transformers import SiglipImageProcessor

            return SiglipImageProcessor(**fields)
        return super().tiny_component(name, fields)


def _preset() -> dict:
    preset = {name: dict(fields) for name, fields in T2V.record.preset.items()}
    preset["transformer"]["task_type"] = "i2v"
    image_dim = preset["transformer"]["image_embed_dim"]
    # SigLIP's layout, tiny: 32-pixel images in 8-pixel patches (16 tokens; the real one has 27 x 27).
    preset["image_encoder"] = {"hidden_size": image_dim, "intermediate_size": 2 * image_dim, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
    preset["feature_extractor"] = {"size": {"height": 32, "width": 32}}
    return preset


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        T2V.record,
        name="hunyuan-video-1.5-i2v",
        pipeline_class="HunyuanVideo15ImageToVideoPipeline",
        conditions=(FirstFrameAlone(), SiglipFirstFrameEmbeddings(IMAGE_COMPONENTS)),
        preset_name="tiny-hunyuan-video-1.5-i2v",
        preset=_preset(),
        pipeline_kwargs={"guider": guider()},  # its own guider component, not the text-to-video entry's
    ),
    call=HunyuanVideo15ImageToVideoCall(),
    prompts=T2V.prompts,
    sampling=HunyuanVideo15ImageToVideoSampling(),
    layouts=T2V.layouts,
    assembly=HunyuanVideo15ImageToVideoAssembly(),
)
