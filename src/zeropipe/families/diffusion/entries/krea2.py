"""Krea 2: a 12.9B single-stream DiT on 2x2-packed latents of the Qwen-Image VAE, conditioned on twelve layers of Qwen3-VL.

``Krea2Pipeline`` encodes a prompt as a fixed-length block (the chat template's prefix, the
prompt, padding, then the assistant suffix: padding in the middle, with positions counting
real tokens only) and stacks the hidden states of twelve Qwen3-VL layers per token
((batch, 512, 12, 2560) for the real model); the transformer fuses them itself. The cache
keeps that stack and its mask for each caption (about 63 MB per caption in fp32 at the real
size: every caption is 512 tokens). The transformer takes the flow time in [0, 1] and
predicts noise - x0, on the latents packed 2x2 as Qwen-Image's; text and image tokens share
one sequence, with rotary ids (0, h, w) for the image.

The VAE is Qwen-Image's (Wan's layout): images go in as one-frame clips and latents are
normalised per channel, as for Qwen-Image (the same codec). Samples follow Krea 2's
guidance convention: ``cond + guidance_scale * (cond - uncond)``, on whenever the scale is
above 0 (the usual CFG scale minus one); the distilled (Turbo) checkpoints sample with 0.

The LoRA's original layout is Krea's reference module names under ``diffusion_model.``
(``blocks.0.attn.wq``, ``blocks.0.mlp.gate``), which diffusers' converter of Krea 2 LoRAs
reads back; the strength is folded into ``lora_B`` (that converter takes no alpha keys).
"""

from __future__ import annotations

import re

import torch

from zeropipe.families.diffusion.comfy import COMFY_PREFIX
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts.latents import QwenImageLatents
from zeropipe.families.diffusion.roles import DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_qwen3_vl
from zeropipe.families.diffusion.tiny.tokenizers import character_qwen_tokenizer

PATCH = 2  # Krea2Pipeline's patch_size: latents packed 2x2 into tokens
ORIGINAL_ATTENTION = {"to_q": "wq", "to_k": "wk", "to_v": "wv", "to_out.0": "wo", "to_gate": "gate"}
ORIGINAL_TOP_LEVEL = {
    "img_in": "first", "final_layer.linear": "last.linear", "time_embed.linear_1": "tmlp.0", "time_embed.linear_2": "tmlp.2",
    "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1", "txt_in.linear_2": "txtmlp.3", "text_fusion.projector": "txtfusion.projector",
}


def original_module_name(module: str) -> str:
    """A diffusers Krea2Transformer2DModel module in Krea's reference names: transformer_blocks.0.attn.to_q -> blocks.0.attn.wq.

    Raises:
        ValueError: the module has no name there.
    """
    found = re.fullmatch(r"(transformer_blocks|text_fusion\.(?:layerwise_blocks|refiner_blocks))\.(\d+)\.(attn\.(.+)|ff\.(gate|up|down))", module)
    if found:
        blocks, index, _, attention, mlp = found.groups()
        prefix = "blocks" if blocks == "transformer_blocks" else blocks.replace("text_fusion", "txtfusion")
        if attention in ORIGINAL_ATTENTION:
            return f"{prefix}.{index}.attn.{ORIGINAL_ATTENTION[attention]}"
        if mlp:
            return f"{prefix}.{index}.mlp.{mlp}"
    if module in ORIGINAL_TOP_LEVEL:
        return ORIGINAL_TOP_LEVEL[module]
    raise ValueError(f"{module} has no name in Krea 2's original layout")


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 x W/2, 4C), as Krea2Pipeline._pack_latents at patch size 2 (Qwen-Image's packing)."""
    from diffusers import QwenImagePipeline

    batch, channels, height, width = latents.shape
    return QwenImagePipeline._pack_latents(latents, batch, channels, height, width)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, H/2 x W/2, 4C) -> (B, C, 1, H, W) for latent height and width, as Krea2Pipeline._unpack_latents."""
    batch, _, channels = tokens.shape
    tokens = tokens.view(batch, height // PATCH, width // PATCH, channels // PATCH**2, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
    return tokens.reshape(batch, channels // PATCH**2, 1, height, width)


class Krea2Prompts(PromptEncoding):
    def tiny_tokenizer(self, tokenizer):
        return character_qwen_tokenizer(self.record.tokenizer_length(tokenizer))

    def encode_prompts(self, pipeline, prompts, device):
        length = min(512, int(pipeline.tokenizer.model_max_length))  # the pipeline's block of 512 tokens
        embeds, mask = pipeline.encode_prompt(prompt=list(prompts), device=device, max_sequence_length=length)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask.long()}


class Krea2Call(DenoiserCall):
    """The transformer on the 2x2-packed latent tokens after the prompt's block; ``predict`` unpacks its output to latents."""

    def inputs(self, model_input, timesteps, condition, context):
        from diffusers import Krea2Pipeline

        _, _, _, height, width = model_input.shape  # one latent frame
        embeds = condition["prompt_embeds"].to(context.dtype)
        position_ids = Krea2Pipeline.prepare_position_ids(embeds.shape[1], height // PATCH, width // PATCH, context.device)
        return {
            "hidden_states": pack(model_input[:, :, 0]).to(context.dtype), "encoder_hidden_states": embeds, "timestep": (timesteps / 1000).to(context.dtype),
            "position_ids": position_ids, "encoder_attention_mask": condition["prompt_embeds_mask"].bool(),
        }

    def predict(self, model, model_input, timesteps, condition, context):
        _, _, _, height, width = model_input.shape
        out = model(**self.inputs(model_input, timesteps, condition, context), return_dict=False)[0]
        return unpack(out, height, width)

    def trace_inputs(self, config, latent, latent_frames, text_tokens, dtype):
        tokens = (latent // PATCH) ** 2
        return {
            "hidden_states": torch.randn(1, tokens, config.in_channels, dtype=dtype), "timestep": torch.tensor([0.5], dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, config.num_text_layers, config.text_hidden_dim, dtype=dtype),
            "position_ids": torch.zeros(text_tokens + tokens, 3),
        }


class Krea2Sampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {
            "prompt_embeds": condition["prompt_embeds"], "prompt_embeds_mask": condition["prompt_embeds_mask"].bool(),
            "negative_prompt_embeds": negative["prompt_embeds"], "negative_prompt_embeds_mask": negative["prompt_embeds_mask"].bool(),
            "guidance_scale": guidance_scale,
        }

    def unpack_latents(self, pipeline, latents, size, vae_factor):
        side = size // vae_factor
        return unpack(latents, side, side)


class Krea2Layouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.blocks.0.attn.wq.lora_A.weight`` / ``lora_B.weight`` (times alpha / r): Krea's names, as its reference trainer and ComfyUI write them."""
        out: dict[str, torch.Tensor] = {}
        for module in sorted({key.partition(".lora_")[0] for key in layers}):
            down, up = layers[f"{module}.lora_A.weight"], layers[f"{module}.lora_B.weight"]
            name = COMFY_PREFIX + original_module_name(module)
            out[f"{name}.lora_A.weight"] = down.contiguous()
            out[f"{name}.lora_B.weight"] = (up * (alpha / down.shape[0])).contiguous()
        return out


# The attention (with its output gate) and the SwiGLU of every main block, as diffusion-pipe and ai-toolkit adapt Krea 2's blocks;
# not the text-fusion blocks. A regular expression: "gate" alone would hit the attention's to_gate and the feed-forward's gate alike.
KREA2_LORA_TARGETS = r".*transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_gate|to_out\.0)|ff\.(gate|up|down))"

ARCHITECTURE = Architecture(
    record=Record(
        name="krea2",
        pipeline_class="Krea2Pipeline",
        denoiser="transformer",
        denoiser_class="Krea2Transformer2DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=PATCH,
        codec=QwenImageLatents(vae_class="AutoencoderKLQwenImage"),
        preset_name="tiny-krea2",
        preset={
            "transformer": {
                "in_channels": 64, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
                "timestep_embed_dim": 32, "text_hidden_dim": 16, "num_text_layers": 12, "text_num_attention_heads": 2, "text_num_key_value_heads": 2,
                "text_intermediate_size": 32, "num_layerwise_text_blocks": 1, "num_refiner_text_blocks": 1, "axes_dims_rope": [4, 6, 6],
            },
            # Qwen-Image's VAE at two spatial halvings (the real one has three): 32-pixel images are 8x8 latents, 16 tokens.
            "vae": {
                "base_dim": 16, "z_dim": 16, "dim_mult": [1, 1, 1], "num_res_blocks": 1, "temperal_downsample": [False, True],
                "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16,
            },
            "text_encoder": tiny_qwen3_vl(),
            # Krea 2 shifts with the resolution (mu from the image's tokens); the pipeline computes it from this scheduler's settings.
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True},
        },
        lora_targets=KREA2_LORA_TARGETS,
        # A tiny preset's prompts are blocks of 256 tokens (its characters hold the template and a caption); a real tokenizer's limit is far above 512.
        tokenizer_lengths={"tokenizer": 256},
        trace_tokens=512,  # every prompt is a block of 512 tokens
        image_processor_patch=PATCH,
    ),
    call=Krea2Call(),
    prompts=Krea2Prompts(),
    sampling=Krea2Sampling(),
    layouts=Krea2Layouts(),
)
