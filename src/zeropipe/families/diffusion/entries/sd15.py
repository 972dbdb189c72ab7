"""Stable Diffusion 1.x: a UNet with one CLIP text encoder."""

from __future__ import annotations

from zeropipe.families.diffusion.bases.unet import UNetCall
from zeropipe.families.diffusion.core import DDPM_SCHEDULE, Architecture, Record
from zeropipe.families.diffusion.roles import EncodePrompt
from zeropipe.families.diffusion.tiny.components import clip_text, tiny_vae


ARCHITECTURE = Architecture(
    record=Record(
        name="sd15",
        pipeline_class="StableDiffusionPipeline",
        related_pipelines=("StableDiffusionImg2ImgPipeline",),
        denoiser="unet",
        denoiser_class="UNet2DConditionModel",
        objective="ddpm",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        preset_name="tiny-sd15",
        preset={
            "unet": {
                "block_out_channels": [32, 64], "layers_per_block": 1, "in_channels": 4, "out_channels": 4,
                "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
                "attention_head_dim": 4, "cross_attention_dim": 32, "norm_num_groups": 8, "sample_size": 32,
            },
            "vae": tiny_vae(scaling_factor=0.18215),
            "text_encoder": {"class": "CLIPTextModel", **clip_text()},
            "scheduler": {"class": "DDIMScheduler", **DDPM_SCHEDULE, "clip_sample": False, "set_alpha_to_one": False},
        },
        pipeline_kwargs={"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False},
    ),
    call=UNetCall(),
    prompts=EncodePrompt(returns=("prompt_embeds",), arguments={"num_images_per_prompt": 1, "do_classifier_free_guidance": False}),
)
