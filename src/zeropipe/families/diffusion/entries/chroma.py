"""Chroma: Flux.1's rectified-flow transformer without CLIP and guidance, conditioned on masked T5 embeddings.

Chroma (lodestones/Chroma1-HD, 8.9B) keeps Flux.1's double and single blocks on 2x2-packed
latents of the Flux VAE, replaces the per-block modulation layers by one small network
(the "distilled guidance layer") and feeds T5 embeddings with an attention mask: every pad
token but the first is masked out, in the text encoder and in the transformer. The mask is
part of the cached conditioning. Samples use real classifier-free guidance (a negative
prompt), as ``ChromaPipeline`` does.

The LoRA of a Chroma run is also written in the original (Flux/BFL) key layout with the
kohya names ComfyUI loads (``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``).
There q, k and v are one fused linear layer (and in single blocks q, k, v and the MLP's
input): the adapters of the parts are stacked into one of their summed rank, block
diagonal, which changes the fused weight exactly as the parts change theirs.
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.core import Architecture, Record, original_layout_name
from zeropipe.families.diffusion.parts import ImageLatents
from zeropipe.families.diffusion.roles import DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_vae
from zeropipe.families.diffusion.tiny.tokenizers import character_t5_tokenizer

# diffusers ChromaTransformer2DModel module -> (original module, index of the part in a fused layer or None).
# The parts' order in a fused layer is the one diffusers' single-file converter splits them in (q, k, v, mlp).
DOUBLE_BLOCK_NAMES = {
    "attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2), "attn.to_out.0": ("img_attn.proj", None),
    "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1), "attn.add_v_proj": ("txt_attn.qkv", 2), "attn.to_add_out": ("txt_attn.proj", None),
    "ff.net.0.proj": ("img_mlp.0", None), "ff.net.2": ("img_mlp.2", None), "ff_context.net.0.proj": ("txt_mlp.0", None), "ff_context.net.2": ("txt_mlp.2", None),
}
SINGLE_BLOCK_NAMES = {
    "attn.to_q": ("linear1", 0), "attn.to_k": ("linear1", 1), "attn.to_v": ("linear1", 2), "proj_mlp": ("linear1", 3), "proj_out": ("linear2", None),
}
TOP_LEVEL_NAMES = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear"}
KOHYA_PREFIX = "lora_unet_"


def original_module_name(module: str) -> tuple[str, int | None]:
    """A diffusers Chroma module name in the original layout, and its part of a fused layer: transformer_blocks.0.attn.to_k -> (double_blocks.0.img_attn.qkv, 1)."""
    return original_layout_name(
        module, (("transformer_blocks.", "double_blocks.", DOUBLE_BLOCK_NAMES), ("single_transformer_blocks.", "single_blocks.", SINGLE_BLOCK_NAMES)),
        TOP_LEVEL_NAMES, "Chroma",
    )


def fused_part_sizes(original: str, inner: int, mlp_hidden: int) -> tuple[int, ...]:
    """Output rows of each part of a fused original layer: q, k, v (and the single blocks' MLP input)."""
    return (inner, inner, inner, mlp_hidden) if original.endswith("linear1") else (inner, inner, inner)


def fuse_lora(layers: dict[str, torch.Tensor], alpha: float, inner: int, mlp_hidden: int, prefix: str = KOHYA_PREFIX) -> dict[str, torch.Tensor]:
    """A diffusers-layout LoRA (``module.lora_A.weight`` / ``lora_B.weight``) in the original layout's kohya names.

    A fused layer's parts (rank r each) become one adapter of rank r x parts: ``lora_down``
    stacks their A matrices, ``lora_up`` holds each B in its part's rows and its own columns
    (zeros elsewhere, and rows of parts that were not trained stay zero), and ``alpha`` grows
    with the rank so that alpha / rank, the strength, is unchanged.
    """
    modules = sorted({key.partition(".lora_")[0] for key in layers})
    groups: dict[str, dict[int | None, str]] = {}
    for module in modules:
        original, part = original_module_name(module)
        groups.setdefault(original, {})[part] = module
    out: dict[str, torch.Tensor] = {}
    for original, parts in groups.items():
        name = prefix + original.replace(".", "_")
        if None in parts:
            module = parts[None]
            down, up = layers[f"{module}.lora_A.weight"], layers[f"{module}.lora_B.weight"]
            fused_alpha = alpha
        else:
            sizes = fused_part_sizes(original, inner, mlp_hidden)
            order = sorted(parts)
            downs = [layers[f"{parts[part]}.lora_A.weight"] for part in order]
            ups = [layers[f"{parts[part]}.lora_B.weight"] for part in order]
            down = torch.cat(downs)
            up = down.new_zeros(sum(sizes), down.shape[0])
            column = 0
            for part, part_up in zip(order, ups):
                row = sum(sizes[:part])
                up[row : row + part_up.shape[0], column : column + part_up.shape[1]] = part_up
                column += part_up.shape[1]
            fused_alpha = alpha * down.shape[0] / downs[0].shape[0]
        out[f"{name}.lora_down.weight"] = down.contiguous()
        out[f"{name}.lora_up.weight"] = up.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(fused_alpha))
    return out


class ChromaPrompts(PromptEncoding):
    def tiny_tokenizer(self, tokenizer):
        return character_t5_tokenizer(self.record.tokenizer_length(tokenizer))

    def encode_prompts(self, pipeline, prompts, device):
        max_length = min(pipeline.tokenizer.model_max_length, 512)
        embeds, _, mask, *_ = pipeline.encode_prompt(prompt=prompts, device=device, do_classifier_free_guidance=False, max_sequence_length=max_length)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}


class ChromaCall(DenoiserCall):
    """The transformer on 2x2-packed latent tokens; ``predict`` unpacks its output back to latents."""

    def inputs(self, model_input, timesteps, condition, context):
        from diffusers import ChromaPipeline

        batch, channels, height, width = model_input.shape
        packed = ChromaPipeline._pack_latents(model_input, batch, channels, height, width)
        image_ids = ChromaPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, context.device, context.dtype)
        embeds = condition["prompt_embeds"]
        text_ids = torch.zeros(embeds.shape[1], 3, device=context.device, dtype=context.dtype)
        # The text mask extended by the image tokens (always attended), as ChromaPipeline._prepare_attention_mask builds it.
        mask = torch.cat([condition["prompt_attention_mask"], torch.ones(batch, packed.shape[1], device=context.device, dtype=embeds.dtype)], dim=1)
        return {
            "hidden_states": packed, "timestep": (timesteps / 1000).to(context.dtype), "encoder_hidden_states": embeds,
            "txt_ids": text_ids, "img_ids": image_ids, "attention_mask": mask,
        }

    def predict(self, model, model_input, timesteps, condition, context):
        from diffusers import ChromaPipeline

        _, _, height, width = model_input.shape
        out = model(**self.inputs(model_input, timesteps, condition, context), return_dict=False)[0]
        return ChromaPipeline._unpack_latents(out, height * context.vae_factor, width * context.vae_factor, context.vae_factor)

    def trace_inputs(self, config, latent, latent_frames, text_tokens, dtype):
        tokens = (latent // 2) ** 2  # 2x2 latent patches
        return {
            "hidden_states": torch.randn(1, tokens, config.in_channels, dtype=dtype), "timestep": torch.tensor([0.5], dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, config.joint_attention_dim, dtype=dtype),
            "img_ids": torch.zeros(tokens, 3, dtype=dtype), "txt_ids": torch.zeros(text_tokens, 3, dtype=dtype),
            "attention_mask": torch.ones(1, text_tokens + tokens, dtype=dtype),
        }


class ChromaSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {
            "prompt_embeds": condition["prompt_embeds"], "prompt_attention_mask": condition["prompt_attention_mask"],
            "negative_prompt_embeds": negative["prompt_embeds"], "negative_prompt_attention_mask": negative["prompt_attention_mask"],
            "guidance_scale": guidance_scale,
        }

    def unpack_latents(self, pipeline, latents, size, vae_factor):
        return pipeline._unpack_latents(latents, size, size, vae_factor)


class ChromaLayouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``lora_unet_<original module>.lora_down.weight`` / ``lora_up.weight`` / ``.alpha``: the kohya names ComfyUI loads for Chroma (and Flux)."""
        inner, mlp_hidden = adapter_widths(layers)
        return fuse_lora(layers, alpha, inner, mlp_hidden)


def adapter_widths(layers: dict[str, torch.Tensor]) -> tuple[int, int]:
    """The transformer's inner width and MLP width, read off the adapters (B of to_q: inner rows; of proj_mlp: MLP rows)."""
    inner = next((t.shape[0] for k, t in layers.items() if k.endswith(("attn.to_q.lora_B.weight", "attn.to_k.lora_B.weight", "attn.to_v.lora_B.weight"))), None)
    if inner is None:
        inner = next((t.shape[1] for k, t in layers.items() if k.endswith("lora_A.weight")), 0)
    mlp = next((t.shape[0] for k, t in layers.items() if k.endswith("proj_mlp.lora_B.weight")), 4 * inner)
    return int(inner), int(mlp)


ARCHITECTURE = Architecture(
    record=Record(
        name="chroma",
        pipeline_class="ChromaPipeline",
        related_pipelines=("ChromaImg2ImgPipeline",),
        denoiser="transformer",
        denoiser_class="ChromaTransformer2DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=2,
        codec=ImageLatents(shifted=True),
        preset_name="tiny-chroma",
        preset={
            "transformer": {
                "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                "joint_attention_dim": 64, "axes_dims_rope": [4, 4, 8], "approximator_num_channels": 16, "approximator_hidden_dim": 32, "approximator_layers": 1,
            },
            "vae": tiny_vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False),
            "text_encoder": {"class": "T5EncoderModel", "vocab_size": 128, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
                             "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0},
            # Chroma1-HD's scheduler is Flux's; the tiny one samples without the resolution-dependent shift.
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
        },
        # The attention projections of both streams (image and text), as diffusers' Flux LoRA scripts train.
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        tokenizer_lengths={"tokenizer": 64},
        image_processor_patch=2,  # latents are packed 2x2 into tokens
    ),
    call=ChromaCall(),
    prompts=ChromaPrompts(),
    sampling=ChromaSampling(),
    layouts=ChromaLayouts(),
)
