"""Stable Diffusion XL: a UNet with two CLIP text encoders and size/crop conditioning (added time ids)."""

from __future__ import annotations

from dataclasses import dataclass

from zeropipe.families.diffusion.bases.unet import unet_trace_inputs
from zeropipe.families.diffusion.core import DDPM_SCHEDULE, Architecture
from zeropipe.families.diffusion.tiny.components import clip_text, tiny_vae


@dataclass(frozen=True)
class SDXL(Architecture):
    def pipeline_kwargs(self):
        return {"add_watermarker": False}

    def encode_prompts(self, pipeline, prompts, device):
        embeds, _, pooled, _ = pipeline.encode_prompt(prompt=prompts, device=device, num_images_per_prompt=1, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def predict(self, model, model_input, timesteps, condition, context):
        return model(
            model_input, timesteps, encoder_hidden_states=condition["prompt_embeds"],
            added_cond_kwargs={"text_embeds": condition["pooled_prompt_embeds"], "time_ids": condition["time_ids"]},
        ).sample

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        return unet_trace_inputs(config, latent_side, text_tokens, dtype)


ARCHITECTURE = SDXL(
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
)
