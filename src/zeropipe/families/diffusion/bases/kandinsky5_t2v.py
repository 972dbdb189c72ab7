"""Kandinsky 5.0 Video (T2V): cross-attention DiTs on HunyuanVideo's VAE, Lite (2B) and Pro (19B), conditioned on Qwen2.5-VL and CLIP.

``Kandinsky5T2VPipeline`` denoises channels-last latents (batch, frames, h, w, 16) with the
image entry's transformer class (``Kandinsky5Transformer3DModel``) saved with ``visual_cond:
true``: the transformer takes 33 channels, the 16 noisy ones, 16 of a visual condition and a
mask, which text-to-video leaves at zero. ``predict`` lays the (batch, 16, frames, h, w)
latents out so, adds the zero channels and gives each prompt its own length (the text blocks
have no mask, see ``kandinsky5_t2i.py``), one call per length in a micro-batch.

Two arguments of the transformer's call depend on the clip's size, and ``predict`` takes both
from the pipeline itself: the RoPE ``scale_factor`` (``_get_scale_factor``: (1, 2, 2) when both
sides are between 480 and 854 pixels, else (1, 3.16, 3.16)) and, for a transformer configured
with ``attention_type: nabla`` (the 10 s models), the sparse-attention parameters
(``get_sparse_params``); the 5 s models use full attention (``sparse_params`` None).

The VAE is HunyuanVideo's (4x in time, 8x in space, 16 channels); the pipeline decodes
``latents / scaling_factor``, which ``VideoLatents`` trains with. Clips are 4k+1 frames at 24 fps.
Objective and timesteps are Kandinsky's rectified flow, as for the image model (the scheduler's
0..1000 timestep, predicting noise - x0); the 5 s models sample with a flow shift of 5.

The LoRA's original layout is the image entry's: diffusers keeps Kandinsky's module names, under
``diffusion_model.`` (musubi-tuner's Kandinsky 5 LoRAs, ComfyUI's loader).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from zeropipe.families.diffusion.bases.kandinsky5_t2i import ARCHITECTURE as T2I
from zeropipe.families.diffusion.bases.kandinsky5_t2i import KANDINSKY_LORA_TARGETS, Kandinsky5Prompts, Kandinsky5Sampling, one_call_per_prompt, prompt_lengths
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import VideoLatents
from zeropipe.families.diffusion.roles import DenoiserCall
from zeropipe.families.diffusion.tiny.components import tiny_hunyuan_video_vae, clip_text, tiny_qwen2_5_vl
from zeropipe.families.diffusion.tiny.tokenizers import template_qwen_tokenizer

LATENT_CHANNELS = 16  # HunyuanVideo's VAE


def channels_last(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, F, H, W) -> (B, F, H, W, C), the layout the Kandinsky 5 video pipelines denoise."""
    return latents.permute(0, 2, 3, 4, 1)


def channels_first(latents: torch.Tensor) -> torch.Tensor:
    """(B, F, H, W, C) -> (B, C, F, H, W)."""
    return latents.permute(0, 4, 1, 2, 3)


def sparse_attention(module, hidden: torch.Tensor, device: torch.device):
    """The pipeline's sparse-attention arguments for this transformer and clip (None for full attention), from the pipeline's own method."""
    from diffusers import Kandinsky5T2VPipeline

    # get_sparse_params reads only the transformer's config and its static fast_sta_nabla: no pipeline needs to exist.
    holder = SimpleNamespace(transformer=module, fast_sta_nabla=Kandinsky5T2VPipeline.fast_sta_nabla)
    return Kandinsky5T2VPipeline.get_sparse_params(holder, hidden, device)


def rope_scale(height: int, width: int) -> tuple:
    """The pipeline's RoPE scale for a clip of this size in pixels."""
    from diffusers import Kandinsky5T2VPipeline

    return Kandinsky5T2VPipeline._get_scale_factor(None, height, width)


class Kandinsky5T2VPrompts(Kandinsky5Prompts):
    def tiny_tokenizer(self, tokenizer):
        if tokenizer == "tokenizer_2":
            return super().tiny_tokenizer(tokenizer)
        return template_qwen_tokenizer(self.record.pipeline_class, 128 + self.record.tokenizer_length(tokenizer))


class Kandinsky5T2VCall(DenoiserCall):
    """The transformer called once per prompt length on channels-last latents, with the pipeline's RoPE scale and sparse attention."""

    def visual_condition(self, latents: torch.Tensor, condition: dict[str, torch.Tensor]) -> torch.Tensor:
        """The channels-last input with the visual condition and its mask appended (zeros: nothing is given in text-to-video)."""
        zeros = torch.zeros_like(latents)
        return torch.cat([latents, zeros, zeros[..., :1]], dim=-1)

    def predict(self, model, model_input, timesteps, condition, context):
        module = getattr(model, "module", model)  # the DeepSpeed engine wraps the transformer
        _, _, frames, height, width = model_input.shape
        hidden = channels_last(model_input).to(context.dtype)
        if module.config.visual_cond:
            hidden = self.visual_condition(hidden, condition)
        embeds, pooled, lengths = condition["prompt_embeds"], condition["pooled_prompt_embeds"], prompt_lengths(condition["prompt_embeds_mask"])
        device = context.device
        visual_rope_pos = [torch.arange(frames, device=device), torch.arange(height // 2, device=device), torch.arange(width // 2, device=device)]
        scale_factor = rope_scale(height * context.vae_factor, width * context.vae_factor)
        sparse_params = sparse_attention(module, hidden, device)
        out = torch.empty(*hidden.shape[:-1], module.config.out_visual_dim, device=hidden.device, dtype=hidden.dtype)
        # The text blocks have no mask: rows of one length go together, each at that length (what the pipeline sees for one prompt).
        for length in sorted(set(lengths)):
            rows = torch.tensor([i for i, own in enumerate(lengths) if own == length], device=hidden.device)
            out[rows] = model(
                hidden_states=hidden[rows], encoder_hidden_states=embeds[rows, :length].to(context.dtype), pooled_projections=pooled[rows].to(context.dtype),
                timestep=timesteps[rows].to(context.dtype), visual_rope_pos=visual_rope_pos, text_rope_pos=torch.arange(length, device=device),
                scale_factor=scale_factor, sparse_params=sparse_params, return_dict=False,
            )[0].to(out.dtype)
        return channels_first(out)

    def trace_inputs(self, config, latent, latent_frames, text_tokens, dtype):
        channels = 2 * config.in_visual_dim + 1 if config.visual_cond else config.in_visual_dim
        return {
            "hidden_states": torch.randn(1, latent_frames, latent, latent, channels, dtype=dtype), "timestep": torch.tensor([500.0], dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, config.in_text_dim, dtype=dtype),
            "pooled_projections": torch.randn(1, config.in_text_dim2, dtype=dtype),
            "visual_rope_pos": [torch.arange(latent_frames), torch.arange(latent // 2), torch.arange(latent // 2)], "text_rope_pos": torch.arange(text_tokens),
            "scale_factor": (1, 2, 2),
        }


class Kandinsky5T2VSampling(Kandinsky5Sampling):
    def draw(self, pipeline, kwargs):
        return one_call_per_prompt(pipeline, kwargs)

    def unpack_latents(self, pipeline, latents, size, vae_factor):
        return channels_first(latents)


def tiny_preset() -> dict:
    qwen = tiny_qwen2_5_vl()
    return {
        "transformer": {
            "in_visual_dim": LATENT_CHANNELS, "out_visual_dim": LATENT_CHANNELS, "in_text_dim": 32, "in_text_dim2": 32, "time_dim": 32,
            "patch_size": [1, 2, 2], "model_dim": 32, "ff_dim": 64, "num_text_blocks": 1, "num_visual_blocks": 2, "axes_dims": [4, 6, 6],
            "visual_cond": True,
        },
        "vae": tiny_hunyuan_video_vae(),
        # Its tokenizer holds the video template's words (template_qwen_tokenizer): 215 tokens.
        "text_encoder": {**qwen, "text_config": {**qwen["text_config"], "vocab_size": 256}},
        "text_encoder_2": {"class": "CLIPTextModel", **clip_text(hidden=32)},
        # The 5 s models' sampler: Euler on flow sigmas with a shift of 5 (kandinsky-5's scheduler_scale).
        "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 5.0, "use_dynamic_shifting": False},
    }


ARCHITECTURE = Architecture(
    record=Record(
        name="kandinsky5-t2v",
        trace_frames=121,  # the pipelines' example: 5 s at 24 fps, 512 x 768
        pipeline_class="Kandinsky5T2VPipeline",
        denoiser="transformer",
        denoiser_class="Kandinsky5Transformer3DModel",
        objective="flow",
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        patch_factor=2,
        codec=VideoLatents(vae_class="AutoencoderKLHunyuanVideo", frame_multiple=4, frame_rate=24.0),
        preset_name="tiny-kandinsky5-t2v",
        preset=tiny_preset(),
        lora_targets=KANDINSKY_LORA_TARGETS,
        tokenizer_lengths=T2I.record.tokenizer_lengths,
        trace_tokens=T2I.record.trace_tokens,
        image_processor_patch=T2I.record.image_processor_patch,
    ),
    call=Kandinsky5T2VCall(),
    prompts=Kandinsky5T2VPrompts(),
    sampling=Kandinsky5T2VSampling(),
    layouts=T2I.layouts,
    assembly=T2I.assembly,
)
