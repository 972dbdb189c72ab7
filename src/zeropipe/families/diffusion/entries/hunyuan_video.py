"""HunyuanVideo: a dual-stream/single-stream video transformer (Llama and CLIP text) on a causal 3D VAE, with flow matching.

Latents are (batch, 16, frames, height, width) with 4x temporal and 8x spatial compression,
so clips are 4k+1 frames (an image is one frame) at 24 fps; the VAE's latents are scaled by
``scaling_factor`` (0.476986). Prompts go through a Llama encoder (the hidden states of its
third-last layer, after a chat template whose first ``crop_start`` tokens are cut off) and
CLIP's pooled output, both computed by ``HunyuanVideoPipeline.encode_prompt``.

HunyuanVideo is guidance-distilled: the transformer is told a guidance value (times 1000)
instead of running classifier-free guidance. Training tells it ``model.diffusion.guidance``
(1.0, as diffusion-pipe and musubi-tuner train it); samples use ``generate.guidance_scale``
as the pipeline's embedded guidance (6.0 is HunyuanVideo's default), without a negative prompt.

The LoRA of a run is also written in the original key layout that ComfyUI and diffusion-pipe
use (``diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight``). The original model fuses
q, k and v (and, in single blocks, the MLP's input) into one linear layer, so the adapters of
the separate diffusers layers are joined into one of rank ``n * r``: the ``lora_A`` matrices
stacked, the ``lora_B`` matrices on a block diagonal. That product is exactly the sum of the
separate updates; diffusers' own converter of such LoRAs (``load_lora_weights``) splits it
back (checked in tests at the real model's width, 3072).
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.comfy import COMFY_PREFIX
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import VideoLatents
from zeropipe.families.diffusion.roles import DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_hunyuan_video_vae, clip_text, tiny_hunyuan_llama as tiny_llama
from zeropipe.families.diffusion.tiny.tokenizers import template_tokenizer


# Diffusers module names of a transformer block -> the original HunyuanVideo names (inverse of
# diffusers' _convert_hunyuan_video_lora_to_diffusers); q/k/v are fused in the original (FUSED below).
DOUBLE_BLOCK_NAMES = {
    "attn.to_out.0": "img_attn_proj", "attn.to_add_out": "txt_attn_proj",
    "ff.net.0.proj": "img_mlp.fc1", "ff.net.2": "img_mlp.fc2", "ff_context.net.0.proj": "txt_mlp.fc1", "ff_context.net.2": "txt_mlp.fc2",
    "norm1.linear": "img_mod.linear", "norm1_context.linear": "txt_mod.linear",
}
SINGLE_BLOCK_NAMES = {"proj_out": "linear2", "norm.linear": "modulation.linear"}
# Fused original layers and the diffusers layers they hold, in the order of their output rows.
FUSED = {
    ("transformer_blocks", "img_attn_qkv"): ("attn.to_q", "attn.to_k", "attn.to_v"),
    ("transformer_blocks", "txt_attn_qkv"): ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    ("single_transformer_blocks", "linear1"): ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
}
ORIGINAL_BLOCKS = {"transformer_blocks": "double_blocks", "single_transformer_blocks": "single_blocks"}


def original_lora_layers(layers: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """A diffusers-layout HunyuanVideo LoRA (``transformer_blocks.0.attn.to_q.lora_A.weight`` ...) in the original layout.

    The strength ``alpha / r`` is folded into ``lora_B``, and no ``.alpha`` keys are written:
    diffusers' converter of original HunyuanVideo LoRAs cannot read them, and ComfyUI then
    applies the update at strength 1, which is what the folded matrices need.

    Raises:
        ValueError: a module outside the blocks, or a fused layer whose parts were not all trained
            (its original layer would update the missing parts too).
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in layers.items():
        module, _, part = key.partition(".lora_")
        pairs.setdefault(module, {})[part.split(".")[0]] = tensor
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for module in sorted(pairs):
        if module in done:
            continue
        blocks, _, rest = module.partition(".")
        index, _, inner = rest.partition(".")
        if blocks not in ORIGINAL_BLOCKS or not index.isdigit():
            raise ValueError(f"{module} is outside the transformer blocks, which the original HunyuanVideo LoRA layout does not cover")
        prefix = f"{COMFY_PREFIX}{ORIGINAL_BLOCKS[blocks]}.{index}."
        fused = next(((name, parts) for (kind, name), parts in FUSED.items() if kind == blocks and inner in parts), None)
        if fused is not None:
            name, parts = fused
            members = [f"{blocks}.{index}.{part}" for part in parts]
            missing = [member for member in members if member not in pairs]
            if missing:
                raise ValueError(f"{missing[0]} is not trained but {module} is: the original layout fuses them into {name}; train all of {', '.join(parts)} or none")
            downs = [pairs[member]["A"] for member in members]
            ups = [pairs[member]["B"] * (alpha / pairs[member]["A"].shape[0]) for member in members]
            out[f"{prefix}{name}.lora_A.weight"] = torch.cat(downs, dim=0).contiguous()
            out[f"{prefix}{name}.lora_B.weight"] = torch.block_diag(*ups).contiguous()
            done.update(members)
            continue
        names = DOUBLE_BLOCK_NAMES if blocks == "transformer_blocks" else SINGLE_BLOCK_NAMES
        if inner not in names:
            raise ValueError(f"{module} has no name in the original HunyuanVideo layout")
        out[f"{prefix}{names[inner]}.lora_A.weight"] = pairs[module]["A"].contiguous()
        out[f"{prefix}{names[inner]}.lora_B.weight"] = (pairs[module]["B"] * (alpha / pairs[module]["A"].shape[0])).contiguous()
        done.add(module)
    return out


class HunyuanVideoPrompts(PromptEncoding):
    """Llama and CLIP prompts through ``HunyuanVideoPipeline.encode_prompt``; a tiny preset's template-aware Llama tokenizer."""

    def encode_prompts(self, pipeline, prompts, device):
        # The pipeline's defaults: the prompt template, 256 Llama tokens kept, CLIP's pooled output.
        embeds, pooled, mask = pipeline.encode_prompt(prompt=prompts, device=device, dtype=torch.float32)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "prompt_attention_mask": mask.float()}

    def tiny_tokenizer(self, tokenizer):
        if tokenizer == "tokenizer_2":
            return super().tiny_tokenizer(tokenizer)
        return template_tokenizer(self.record.tokenizer_length(tokenizer))


class HunyuanVideoCall(DenoiserCall):
    """The transformer called as ``HunyuanVideoPipeline`` calls it, told the guidance where it embeds one.

    ``predict`` rather than ``inputs``: whether the guidance is given depends on the transformer's config
    (``guidance_embeds``), which only the call sees.
    """

    def predict(self, model, model_input, timesteps, condition, context):
        module = getattr(model, "module", model)  # the DeepSpeed engine wraps the transformer
        guidance = None
        if getattr(module.config, "guidance_embeds", False):
            # As HunyuanVideoPipeline passes it: the guidance value times 1000.
            guidance = torch.full((model_input.shape[0],), context.guidance * 1000.0, device=context.device, dtype=context.dtype)
        return model(
            hidden_states=model_input, timestep=timesteps.to(context.dtype), encoder_hidden_states=condition["prompt_embeds"],
            encoder_attention_mask=condition["prompt_attention_mask"], pooled_projections=condition["pooled_prompt_embeds"],
            guidance=guidance, return_dict=False,
        )[0]

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        return {
            "hidden_states": torch.randn(1, config.in_channels, latent_frames, latent_side, latent_side, dtype=dtype),
            "timestep": torch.tensor([500.0], dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, config.text_embed_dim, dtype=dtype),
            "encoder_attention_mask": torch.ones(1, text_tokens, dtype=dtype),
            "pooled_projections": torch.randn(1, config.pooled_projection_dim, dtype=dtype),
            "guidance": torch.tensor([1000.0], dtype=dtype) if config.guidance_embeds else None,
        }


class HunyuanVideoSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        # guidance_scale is HunyuanVideoPipeline's embedded guidance; no negative prompt (true_cfg_scale stays 1).
        return {
            "prompt_embeds": condition["prompt_embeds"], "pooled_prompt_embeds": condition["pooled_prompt_embeds"],
            "prompt_attention_mask": condition["prompt_attention_mask"], "guidance_scale": guidance_scale,
        }


class HunyuanVideoLayouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight`` ...: what ComfyUI and diffusion-pipe load for HunyuanVideo."""
        return original_lora_layers(layers, alpha)


ARCHITECTURE = Architecture(
    record=Record(
        name="hunyuan-video",
        pipeline_class="HunyuanVideoPipeline",
        denoiser="transformer",
        denoiser_class="HunyuanVideoTransformer3DModel",
        objective="flow",
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        patch_factor=2,
        codec=VideoLatents(vae_class="AutoencoderKLHunyuanVideo", frame_multiple=4, frame_rate=24.0),
        preset_name="tiny-hunyuan-video",
        preset={
            "transformer": {
                "in_channels": 16, "out_channels": 16, "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 1, "num_single_layers": 1,
                "num_refiner_layers": 1, "mlp_ratio": 2.0, "patch_size": 2, "patch_size_t": 1, "guidance_embeds": True, "text_embed_dim": 32,
                "pooled_projection_dim": 32, "rope_axes_dim": [4, 6, 6],
            },
            "vae": tiny_hunyuan_video_vae(),
            "text_encoder": tiny_llama(),
            "text_encoder_2": {"class": "CLIPTextModel", **clip_text()},
            # HunyuanVideo's own sampler: Euler on flow sigmas with a shift of 7.
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 7.0},
        },
        # Every linear layer of the double- and single-stream blocks' attention and MLPs, as diffusion-pipe trains HunyuanVideo LoRAs.
        # A regular expression: the bare name proj_out would also match the final projection outside the blocks.
        lora_targets=(
            r"(transformer_blocks|single_transformer_blocks)\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
            r"|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2)|proj_mlp|proj_out)"
        ),
        tokenizer_lengths={"tokenizer": 256},  # the Llama tokens HunyuanVideoPipeline keeps after the template's cut
    ),
    call=HunyuanVideoCall(),
    prompts=HunyuanVideoPrompts(),
    sampling=HunyuanVideoSampling(),
    layouts=HunyuanVideoLayouts(),
)
