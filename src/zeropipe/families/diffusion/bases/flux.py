"""Flux.1: a rectified-flow transformer on 2x2-packed latents, with CLIP and T5 and optional guidance embedding."""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import ImageLatents
from zeropipe.families.diffusion.roles import DenoiserCall, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import clip_text, tiny_t5, tiny_vae


class FluxPrompts(PromptEncoding):
    def encode_prompts(self, pipeline, prompts, device):
        max_length = min(pipeline.tokenizer_2.model_max_length, 512)
        embeds, pooled, _ = pipeline.encode_prompt(prompt=prompts, prompt_2=None, device=device, max_sequence_length=max_length)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


class FluxCall(DenoiserCall):
    """Flux.1's transformer on 2x2-packed latents; its ``predict`` reads the model's config (guidance-distilled or not), so it is written whole."""

    def predict(self, model, model_input, timesteps, condition, context):
        from diffusers import FluxPipeline

        batch, channels, height, width = model_input.shape
        packed = FluxPipeline._pack_latents(model_input, batch, channels, height, width)
        image_ids = FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, context.device, context.dtype)
        text_ids = torch.zeros(condition["prompt_embeds"].shape[1], 3, device=context.device, dtype=context.dtype)
        guidance = self.guidance_input(model, batch, context)
        out = model(
            hidden_states=packed, timestep=(timesteps / 1000).to(context.dtype), guidance=guidance,
            pooled_projections=condition["pooled_prompt_embeds"], encoder_hidden_states=condition["prompt_embeds"],
            txt_ids=text_ids, img_ids=image_ids,
        ).sample
        return FluxPipeline._unpack_latents(out, height * context.vae_factor, width * context.vae_factor, context.vae_factor)

    @staticmethod
    def guidance_input(model, batch: int, context) -> torch.Tensor | None:
        """The guidance value per example for guidance-distilled transformers (Flux.1 dev), None for the others."""
        module = getattr(model, "module", model)  # the DeepSpeed engine wraps the transformer
        if not getattr(module.config, "guidance_embeds", False):
            return None
        return torch.full((batch,), context.guidance, device=context.device, dtype=torch.float32)

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        tokens = (latent_side // 2) ** 2  # 2x2 latent patches
        return {
            "hidden_states": torch.randn(1, tokens, config.in_channels, dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, config.joint_attention_dim, dtype=dtype),
            "pooled_projections": torch.randn(1, config.pooled_projection_dim, dtype=dtype),
            "timestep": torch.tensor([0.5], dtype=dtype),
            "img_ids": torch.zeros(tokens, 3, dtype=dtype),
            "txt_ids": torch.zeros(text_tokens, 3, dtype=dtype),
            "guidance": torch.tensor([3.5], dtype=dtype) if config.guidance_embeds else None,
        }


class FluxSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        # Flux.1 dev is guidance-distilled: the guidance goes into the model, no negative prompt.
        return {"prompt_embeds": condition["prompt_embeds"], "pooled_prompt_embeds": condition["pooled_prompt_embeds"], "guidance_scale": guidance}

    def unpack_latents(self, pipeline, latents, size, vae_factor):
        return pipeline._unpack_latents(latents, size, size, vae_factor)


ARCHITECTURE = Architecture(
    record=Record(
        name="flux",
        pipeline_class="FluxPipeline",
        related_pipelines=("FluxImg2ImgPipeline",),
        denoiser="transformer",
        denoiser_class="FluxTransformer2DModel",
        objective="flow",
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        patch_factor=2,
        codec=ImageLatents(shifted=True),
        preset_name="tiny-flux",
        preset={
            "transformer": {
                "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                "num_attention_heads": 2, "joint_attention_dim": 64, "pooled_projection_dim": 32, "axes_dims_rope": [4, 4, 8], "guidance_embeds": False,
            },
            "vae": tiny_vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False),
            "text_encoder": {"class": "CLIPTextModel", **clip_text()},
            "text_encoder_2": tiny_t5(),
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
        },
        image_processor_patch=2,  # latents are packed 2x2 into tokens
        trace_tokens=512,  # T5's full length, as Flux.1's pipeline pads prompts (a tiny tokenizer says fewer)
    ),
    call=FluxCall(),
    prompts=FluxPrompts(),
    sampling=FluxSampling(),
)
