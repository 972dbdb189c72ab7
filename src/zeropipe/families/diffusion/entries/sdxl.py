"""Stable Diffusion XL: a UNet with two CLIP text encoders and size/crop conditioning (added time ids)."""

from __future__ import annotations

from zeropipe.families.diffusion.bases.unet import UNetCall
from zeropipe.families.diffusion.core import DDPM_SCHEDULE, Architecture, Record
from zeropipe.families.diffusion.roles import EncodePrompt
from zeropipe.families.diffusion.tiny.components import clip_text, tiny_vae


ARCHITECTURE = Architecture(
    record=Record(
        name="sdxl",
        pipeline_class="StableDiffusionXLPipeline",
        related_pipelines=("StableDiffusionXLImg2ImgPipeline",),
        denoiser="unet",
        denoiser_class="UNet2DConditionModel",
        objective="ddpm",
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        preset_name="tiny-sdxl",
        preset={
            "unet": {
                "block_out_channels": [32, 64], "layers_per_block": 1, "in_channels": 4, "out_channels": 4,
                "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
                "attention_head_dim": [2, 4], "use_linear_projection": True, "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
                "transformer_layers_per_block": [1, 1], "projection_class_embeddings_input_dim": 80, "cross_attention_dim": 64,
                "norm_num_groups": 8, "sample_size": 32,
            },
            "vae": tiny_vae(scaling_factor=0.13025),
            "text_encoder": {"class": "CLIPTextModel", **clip_text()},
            "text_encoder_2": {"class": "CLIPTextModelWithProjection", **clip_text()},
            "scheduler": {"class": "EulerDiscreteScheduler", **DDPM_SCHEDULE, "timestep_spacing": "leading"},
        },
        pipeline_kwargs={"add_watermarker": False},
    ),
    call=UNetCall(added_conditions=True),
    prompts=EncodePrompt(returns=("prompt_embeds", None, "pooled_prompt_embeds"), arguments={"num_images_per_prompt": 1, "do_classifier_free_guidance": False}),
)
