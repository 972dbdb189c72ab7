"""Qwen-Image: a 20B MMDiT on 2x2-packed latents of a Wan-style video VAE, conditioned on Qwen2.5-VL's last hidden states.

The VAE (``AutoencoderKLQwenImage``) is causal 3D, as Wan's: an image is a clip of one
frame, so pixels go in as (batch, 3, 1, height, width) and latents stay (batch, 16, 1, h, w),
normalised per channel (``latents_mean`` / ``latents_std``) as ``QwenImagePipeline`` decodes
them. Prompts are wrapped in the pipeline's chat template and encoded by Qwen2.5-VL; the
template's first 34 tokens are dropped and the rest keeps the prompt's own length, with a
mask (cached per caption; a batch pads with zeros). Samples use the pipeline's true
classifier-free guidance (``true_cfg_scale`` with the empty prompt as negative).

The LoRA's original layout is diffusers' own module names under ``diffusion_model.``
(Qwen-Image's reference code and ComfyUI name the layers as diffusers does), which
diffusers' converter of such LoRAs reads back.

Qwen-Image-Edit (a control image per target: its latents appended to the image tokens and
the image given to Qwen2.5-VL with the prompt) is its own entry, ``qwen_image_edit.py``.
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.comfy import comfy_lora_layout
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts.latents import QwenImageLatents
from zeropipe.families.diffusion.roles import DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_qwen2_5_vl
from zeropipe.families.diffusion.tiny.tokenizers import character_qwen_tokenizer


def prompt_mask(embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The text mask a pipeline's encode_prompt returned, or all ones where it returned None (it does when no token is padding)."""
    return mask if mask is not None else torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, 1, H, W) latents -> (B, H/2 x W/2, 4C) tokens, as QwenImagePipeline._pack_latents."""
    from diffusers import QwenImagePipeline

    batch, channels, _, height, width = latents.shape
    return QwenImagePipeline._pack_latents(latents, batch, channels, height, width)


class QwenImagePrompts(PromptEncoding):
    def tiny_tokenizer(self, tokenizer):
        return character_qwen_tokenizer(self.record.tokenizer_length(tokenizer))

    def encode_prompts(self, pipeline, prompts, device):
        embeds, mask = pipeline.encode_prompt(prompt=prompts, device=device, max_sequence_length=1024)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": prompt_mask(embeds, mask)}


class QwenImageCall(DenoiserCall):
    """The transformer on the target's 2x2-packed latent tokens, followed by the images a condition appends (none here: ``images``).

    ``inputs`` is the one builder, for training and the planner's trace; ``predict`` reads the target's tokens of the output
    and unpacks them to latents.
    """

    def images(self, condition: dict[str, torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """The latents (B, C, 1, H, W) of the images appended after the target's tokens, in order (the edit entries' control or references)."""
        return []

    def inputs(self, model_input, timesteps, condition, context):
        batch, _, _, height, width = model_input.shape  # one latent frame; every appended image has the same grid (the target's bucket)
        grid = (1, height // 2, width // 2)
        tokens = [pack(latents) for latents in (model_input, *self.images(condition, model_input.dtype))]
        # No text mask in the planner's trace: a prompt without padding (the pipeline passes None then too), which the meta device can run.
        return {
            "hidden_states": torch.cat(tokens, dim=1) if len(tokens) > 1 else tokens[0], "timestep": (timesteps / 1000).to(context.dtype),
            "encoder_hidden_states": condition["prompt_embeds"], "encoder_hidden_states_mask": condition.get("prompt_embeds_mask"),
            "img_shapes": [[grid] * len(tokens)] * batch,
        }

    def predict(self, model, model_input, timesteps, condition, context):
        from diffusers import QwenImagePipeline

        _, _, _, height, width = model_input.shape
        out = model(**self.inputs(model_input, timesteps, condition, context), return_dict=False)[0]
        target = (height // 2) * (width // 2)  # the target's tokens come first
        return QwenImagePipeline._unpack_latents(out[:, :target], height * context.vae_factor, width * context.vae_factor, context.vae_factor)

    def trace_batch(self, config, latent, latent_frames, text_tokens, dtype):
        return (
            torch.randn(1, config.in_channels // 4, 1, latent, latent, dtype=dtype), torch.tensor([500.0], dtype=dtype),
            {"prompt_embeds": torch.randn(1, text_tokens, config.joint_attention_dim, dtype=dtype), **self.trace_images(config, latent, dtype)},
        )

    def trace_images(self, config, latent: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The conditions ``images`` reads, for the planner's trace at the target's size (none here)."""
        return {}


class QwenImageSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {
            "prompt_embeds": condition["prompt_embeds"], "prompt_embeds_mask": condition["prompt_embeds_mask"],
            "negative_prompt_embeds": negative["prompt_embeds"], "negative_prompt_embeds_mask": negative["prompt_embeds_mask"],
            "true_cfg_scale": guidance_scale,
        }

    def unpack_latents(self, pipeline, latents, size, vae_factor):
        return pipeline._unpack_latents(latents, size, size, vae_factor)


class QwenImageLayouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.<module>.lora_A.weight`` / ``lora_B.weight`` / ``.alpha``: what ComfyUI loads for Qwen-Image."""
        return comfy_lora_layout(layers, alpha)


ARCHITECTURE = Architecture(
    record=Record(
        name="qwen-image",
        pipeline_class="QwenImagePipeline",
        related_pipelines=("QwenImageImg2ImgPipeline",),
        denoiser="transformer",
        denoiser_class="QwenImageTransformer2DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=2,
        codec=QwenImageLatents(vae_class="AutoencoderKLQwenImage"),
        preset_name="tiny-qwen-image",
        preset={
            "transformer": {
                "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                "joint_attention_dim": 32, "axes_dims_rope": [4, 6, 6],
            },
            # Two spatial halvings (Qwen-Image's has three): 32-pixel images are 8x8 latents, 16 tokens.
            "vae": {
                "base_dim": 16, "z_dim": 16, "dim_mult": [1, 1, 1], "num_res_blocks": 1, "temperal_downsample": [False, True],
                "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16,
            },
            "text_encoder": tiny_qwen2_5_vl(),
            # Qwen-Image's scheduler shifts with the resolution (use_dynamic_shifting); the tiny one samples with a fixed shift.
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False},
        },
        # Every linear layer of the blocks' attention (image and text streams), as diffusers' and diffusion-pipe's Qwen-Image LoRAs train.
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        tokenizer_lengths={"tokenizer": 256},
        image_processor_patch=2,  # latents are packed 2x2 into tokens
    ),
    call=QwenImageCall(),
    prompts=QwenImagePrompts(),
    sampling=QwenImageSampling(),
    layouts=QwenImageLayouts(),
)
