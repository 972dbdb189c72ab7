"""Kandinsky 5.0 Image Lite (T2I): a 6B cross-attention DiT on the Flux VAE's latents, conditioned on Qwen2.5-VL and CLIP.

``Kandinsky5Transformer3DModel`` is the video model's class, given an image as a clip of one
frame with channels last: ``predict`` turns the (batch, 16, h, w) latents into
(batch, 1, h, w, 16) and back, as ``Kandinsky5T2IPipeline`` lays out its latents. The
transformer patchifies 1x2x2 itself and takes the scheduler's timestep (0..1000) as it is,
predicting noise - x0 (the same rectified flow as SD3 and Flux).

The pipeline decodes ``latents / scaling_factor``: no shift, although the Flux VAE's config
has a shift factor. The codec follows the pipeline (``KandinskyLatents``), so that training
and samples see the same latents.

Prompts go through the pipeline's chat template into Qwen2.5-VL (the template's first 40
tokens dropped) and through CLIP-L (its pooled output modulates the time embedding). Its
text blocks attend over every text token without a mask, so a prompt is only itself at its
own length: the cache keeps each caption's embedding with its mask, ``predict`` cuts each
back to its length and calls the transformer once per length in a micro-batch, and samples
are drawn one prompt per pipeline call (a batch of prompts padded together would change them).

The LoRA's original layout is diffusers' module names under ``diffusion_model.``: the
diffusers port keeps Kandinsky's own module names (``visual_transformer_blocks.N.self_attention.to_query``,
as in kandinskylab/kandinsky-5 and musubi-tuner's copy of it).
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.comfy import comfy_lora_layout
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts.latents import KandinskyLatents
from zeropipe.families.diffusion.roles import Assembly, DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.sampler import pipeline_call
from zeropipe.families.diffusion.tiny.components import clip_text, tiny_qwen2_5_vl, tiny_vae
from zeropipe.families.diffusion.tiny.tokenizers import character_qwen_tokenizer, character_tokenizer


def channels_last(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, 1, H, W, C): an image as the one-frame, channels-last clip the pipeline denoises."""
    return latents.permute(0, 2, 3, 1).unsqueeze(1)


def channels_first(latents: torch.Tensor) -> torch.Tensor:
    """(B, 1, H, W, C) -> (B, C, H, W)."""
    return latents[:, 0].permute(0, 3, 1, 2)


def prompt_lengths(mask: torch.Tensor) -> list[int]:
    return [int(length) for length in mask.sum(dim=1).tolist()]


class Kandinsky5Prompts(PromptEncoding):
    """Qwen2.5-VL (through the pipeline's chat template) and CLIP-L prompts by the pipeline's own ``encode_prompt``, each kept with its mask."""

    def encode_prompts(self, pipeline, prompts, device):
        embeds, pooled, cu_seqlens = pipeline.encode_prompt(prompt=list(prompts), device=device, max_sequence_length=512)
        lengths = cu_seqlens.diff().to(embeds.device)
        mask = (torch.arange(embeds.shape[1], device=embeds.device)[None] < lengths[:, None]).long()
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "pooled_prompt_embeds": pooled}

    def tiny_tokenizer(self, tokenizer):
        if tokenizer == "tokenizer_2":
            return character_tokenizer(77)
        return character_qwen_tokenizer(self.record.tokenizer_length(tokenizer))


class Kandinsky5T2ICall(DenoiserCall):
    """The transformer called once per prompt length in a micro-batch (its text blocks have no mask), on a one-frame channels-last clip."""

    def predict(self, model, model_input, timesteps, condition, context):
        batch, _, height, width = model_input.shape
        embeds, pooled, lengths = condition["prompt_embeds"], condition["pooled_prompt_embeds"], prompt_lengths(condition["prompt_embeds_mask"])
        hidden = channels_last(model_input).to(context.dtype)
        visual_rope_pos = [torch.arange(1, device=context.device), torch.arange(height // 2, device=context.device), torch.arange(width // 2, device=context.device)]
        out = torch.empty_like(hidden)
        # The text blocks have no mask: rows of one length go together, each at that length (what the pipeline sees for one prompt).
        for length in sorted(set(lengths)):
            rows = torch.tensor([i for i, own in enumerate(lengths) if own == length], device=hidden.device)
            out[rows] = model(
                hidden_states=hidden[rows], encoder_hidden_states=embeds[rows, :length].to(context.dtype), pooled_projections=pooled[rows].to(context.dtype),
                timestep=timesteps[rows].to(context.dtype), visual_rope_pos=visual_rope_pos, text_rope_pos=torch.arange(length, device=context.device),
                scale_factor=[1.0, 1.0, 1.0], sparse_params=None, return_dict=False,
            )[0].to(out.dtype)
        return channels_first(out)

    def trace_inputs(self, config, latent, latent_frames, text_tokens, dtype):
        return {
            "hidden_states": torch.randn(1, 1, latent, latent, config.in_visual_dim, dtype=dtype), "timestep": torch.tensor([500.0], dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, config.in_text_dim, dtype=dtype),
            "pooled_projections": torch.randn(1, config.in_text_dim2, dtype=dtype),
            "visual_rope_pos": [torch.arange(1), torch.arange(latent // 2), torch.arange(latent // 2)], "text_rope_pos": torch.arange(text_tokens),
        }


class Kandinsky5Sampling(Sampling):
    """The pipeline's own call, one prompt per call; the image entry's at the run's size."""

    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {
            "prompt_embeds_qwen": condition["prompt_embeds"], "prompt_embeds_mask": condition["prompt_embeds_mask"], "prompt_embeds_clip": condition["pooled_prompt_embeds"],
            "negative_prompt_embeds_qwen": negative["prompt_embeds"], "negative_prompt_embeds_mask": negative["prompt_embeds_mask"],
            "negative_prompt_embeds_clip": negative["pooled_prompt_embeds"], "guidance_scale": guidance_scale,
        }

    def draw(self, pipeline, kwargs):
        """One call per prompt, each at its own length; at the run's size (the pipeline would snap other sizes to its list of 1024-pixel ones)."""
        size = (kwargs["width"], kwargs["height"])
        if size not in pipeline.resolutions:
            pipeline.resolutions = [*pipeline.resolutions, size]
        return one_call_per_prompt(pipeline, kwargs)

    def unpack_latents(self, pipeline, latents, size, vae_factor):
        return channels_first(latents)


class Kandinsky5Layouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.<module>.lora_A.weight`` / ``lora_B.weight`` / ``.alpha``: Kandinsky's own module names."""
        return comfy_lora_layout(layers, alpha)


class Kandinsky5Assembly(Assembly):
    def tiny_denoiser(self, model):
        # Kandinsky5Modulation starts at zero (adaLN-zero): every block's output would be gated off and LoRA get no gradient.
        from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Modulation

        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, Kandinsky5Modulation):
                    torch.nn.init.normal_(module.out_layer.weight, std=0.2)


def one_call_per_prompt(pipeline, kwargs):
    """The Kandinsky 5 pipelines drawn one prompt per call, each prompt (and its negative) at its own length: their text blocks have no mask."""
    kwargs = dict(kwargs)
    masks = {"": kwargs.pop("prompt_embeds_mask"), "negative_": kwargs.pop("negative_prompt_embeds_mask")}
    drawn = []
    for row in range(kwargs["prompt_embeds_qwen"].shape[0]):
        one = dict(kwargs)
        for prefix, mask in masks.items():
            length = prompt_lengths(mask[row : row + 1])[0]
            one[f"{prefix}prompt_embeds_qwen"] = kwargs[f"{prefix}prompt_embeds_qwen"][row : row + 1, :length]
            one[f"{prefix}prompt_embeds_clip"] = kwargs[f"{prefix}prompt_embeds_clip"][row : row + 1]
            one[f"{prefix}prompt_cu_seqlens"] = torch.tensor([0, length], dtype=torch.int32)
        drawn.append(pipeline_call(pipeline, one)[0])
    return torch.cat(drawn)


# Qwen2.5-VL's 512 prompt tokens (encode_prompt's max_sequence_length), CLIP's 77.
KANDINSKY_TOKENIZER_LENGTHS = {"tokenizer": 512, "tokenizer_2": 77}
# The attention projections of the text and visual blocks (self- and cross-attention). A regular expression: the suffix
# "out_layer" alone would also hit the feed-forward, the modulations and the time embedding.
KANDINSKY_LORA_TARGETS = r".*_transformer_blocks\.\d+\.(self_attention|cross_attention)\.(to_query|to_key|to_value|out_layer)$"

ARCHITECTURE = Architecture(
    record=Record(
        name="kandinsky5-t2i",
        pipeline_class="Kandinsky5T2IPipeline",
        denoiser="transformer",
        denoiser_class="Kandinsky5Transformer3DModel",
        objective="flow",
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        patch_factor=2,
        codec=KandinskyLatents(),
        preset_name="tiny-kandinsky5-t2i",
        preset={
            "transformer": {
                "in_visual_dim": 4, "out_visual_dim": 4, "in_text_dim": 32, "in_text_dim2": 32, "time_dim": 32, "patch_size": [1, 2, 2],
                "model_dim": 32, "ff_dim": 64, "num_text_blocks": 1, "num_visual_blocks": 2, "axes_dims": [4, 6, 6],
            },
            "vae": tiny_vae(latent_channels=4, scaling_factor=0.3611, use_quant_conv=False, use_post_quant_conv=False),
            "text_encoder": tiny_qwen2_5_vl(),
            "text_encoder_2": {"class": "CLIPTextModel", **clip_text(hidden=32)},
            # Kandinsky 5.0 T2I Lite samples with a fixed shift (the tiny one with a smaller one).
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False},
        },
        lora_targets=KANDINSKY_LORA_TARGETS,
        tokenizer_lengths=KANDINSKY_TOKENIZER_LENGTHS,
        trace_tokens=256,  # a long caption; the pipeline keeps each prompt at its own length (up to 512)
        image_processor_patch=2,  # the transformer patchifies 2x2
    ),
    call=Kandinsky5T2ICall(),
    prompts=Kandinsky5Prompts(),
    sampling=Kandinsky5Sampling(),
    layouts=Kandinsky5Layouts(),
    assembly=Kandinsky5Assembly(),
)
