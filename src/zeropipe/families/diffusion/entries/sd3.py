"""Stable Diffusion 3: an MMDiT transformer with two CLIP encoders and T5, trained by flow matching."""

from __future__ import annotations

from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import ImageLatents
from zeropipe.families.diffusion.roles import DenoiserCall, PromptEncoding
from zeropipe.families.diffusion.tiny.components import clip_text, tiny_t5, tiny_vae


class SD3Prompts(PromptEncoding):
    def encode_prompts(self, pipeline, prompts, device):
        max_length = pipeline.tokenizer_3.model_max_length if pipeline.tokenizer_3 is not None else 77
        embeds, _, pooled, _ = pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=device, do_classifier_free_guidance=False, max_sequence_length=min(max_length, 256)
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


class SD3Call(DenoiserCall):
    def inputs(self, model_input, timesteps, condition, context):
        return {
            "hidden_states": model_input, "timestep": timesteps.to(context.dtype), "encoder_hidden_states": condition["prompt_embeds"],
            "pooled_projections": condition["pooled_prompt_embeds"],
        }

    def output(self, out):
        return out.sample


ARCHITECTURE = Architecture(
    record=Record(
        name="sd3",
        pipeline_class="StableDiffusion3Pipeline",
        related_pipelines=("StableDiffusion3Img2ImgPipeline",),
        denoiser="transformer",
        denoiser_class="SD3Transformer2DModel",
        objective="flow",
        text_encoders=("text_encoder", "text_encoder_2", "text_encoder_3"),
        tokenizers=("tokenizer", "tokenizer_2", "tokenizer_3"),
        tokenizer_lengths={"tokenizer_3": 32},
        patch_factor=2,
        codec=ImageLatents(shifted=True),
        preset_name="tiny-sd3",
        preset={
            "transformer": {
                "sample_size": 32, "patch_size": 2, "in_channels": 4, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
                "num_attention_heads": 4, "caption_projection_dim": 64, "joint_attention_dim": 64, "pooled_projection_dim": 64, "pos_embed_max_size": 32,
            },
            "vae": tiny_vae(scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False),
            "text_encoder": {"class": "CLIPTextModelWithProjection", **clip_text()},
            "text_encoder_2": {"class": "CLIPTextModelWithProjection", **clip_text()},
            "text_encoder_3": tiny_t5(),
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0},
        },
    ),
    call=SD3Call(),
    prompts=SD3Prompts(),
)
