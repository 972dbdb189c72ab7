"""LTX-Video: a video transformer on tokens of a strongly compressing 3D VAE (T5 text), trained with flow matching.

The VAE compresses 32x32 pixels and 8 frames into one latent of 128 channels, so clips are
8k+1 frames (an image is one frame) at 25 fps and bucket sides multiples of 32. The
transformer sees the latents flattened into a sequence of tokens (``LTXPipeline._pack_latents``,
patch size 1) with the latent grid's size and RoPE's interpolation scale (the VAE's
compression over the frame rate) beside them, as LTXPipeline calls it. Latents are normalised
per channel by statistics the VAE holds as weights (``latents_mean`` / ``latents_std``
buffers, not config), times ``scaling_factor``.

The sampler is FlowMatchEuler with a shift that grows with the number of tokens
(``use_dynamic_shifting``); training uses ``model.diffusion.shift`` (``auto``: the scheduler's
static ``shift``, 1.0 in LTX-Video's config). LTX-Video's original module names are diffusers'
own, so its ComfyUI LoRA layout is the diffusers one under ``diffusion_model.``; diffusers'
converter of such LoRAs (``load_lora_weights``) reads it back.
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.comfy import comfy_lora_layout
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts.latents import LTXVideoLatents
from zeropipe.families.diffusion.roles import DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_t5
from zeropipe.families.diffusion.tiny.tokenizers import character_t5_tokenizer

PROMPT_TOKENS = 128  # LTXPipeline's max_sequence_length


class LTXPrompts(PromptEncoding):
    def tiny_tokenizer(self, tokenizer):
        return character_t5_tokenizer(self.record.tokenizer_length(tokenizer))

    def encode_prompts(self, pipeline, prompts, device):
        embeds, mask, _, _ = pipeline.encode_prompt(
            prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=self.record.tokenizer_length("tokenizer"), device=device
        )
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask.float()}


class LTXCall(DenoiserCall):
    """LTX-Video's transformer on packed latent tokens; its ``predict`` reads the patch sizes from the model's config, so it is written whole."""

    def predict(self, model, model_input, timesteps, condition, context):
        from diffusers import LTXPipeline

        module = getattr(model, "module", model)  # the DeepSpeed engine wraps the transformer
        patch, patch_t = module.config.patch_size, module.config.patch_size_t
        batch, _, frames, height, width = model_input.shape
        packed = LTXPipeline._pack_latents(model_input, patch, patch_t)
        temporal = self.record.codec.frame_multiple
        out = model(
            hidden_states=packed, encoder_hidden_states=condition["prompt_embeds"], timestep=timesteps.to(context.dtype),
            encoder_attention_mask=condition["prompt_attention_mask"], num_frames=frames // patch_t, height=height // patch, width=width // patch,
            # As LTXPipeline passes it at its default frame rate (which is the one clips are taken at).
            rope_interpolation_scale=(temporal / self.record.codec.frame_rate, context.vae_factor, context.vae_factor), return_dict=False,
        )[0]
        return LTXPipeline._unpack_latents(out, frames // patch_t, height // patch, width // patch, patch, patch_t)

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        frames, side = latent_frames // config.patch_size_t, latent_side // config.patch_size
        codec = self.record.codec
        return {
            "hidden_states": torch.randn(1, frames * side * side, config.in_channels * config.patch_size_t * config.patch_size**2, dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, config.caption_channels, dtype=dtype),
            "timestep": torch.tensor([500.0], dtype=dtype),
            "encoder_attention_mask": torch.ones(1, text_tokens, dtype=dtype),
            "num_frames": frames, "height": side, "width": side, "rope_interpolation_scale": (codec.frame_multiple / codec.frame_rate, 32, 32),
        }


class LTXSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {
            "prompt_embeds": condition["prompt_embeds"], "prompt_attention_mask": condition["prompt_attention_mask"],
            "negative_prompt_embeds": negative["prompt_embeds"], "negative_prompt_attention_mask": negative["prompt_attention_mask"],
            "guidance_scale": guidance_scale,
        }

    def unpack_latents(self, pipeline, latents, size, vae_factor):
        # LTXPipeline returns its token sequence with output_type="latent"; samples are square, so the frames follow from its length.
        side = size // vae_factor
        patch, patch_t = pipeline.transformer_spatial_patch_size, pipeline.transformer_temporal_patch_size
        frames = latents.shape[1] * patch * patch // (side * side)
        return pipeline._unpack_latents(latents, frames, side // patch, side // patch, patch, patch_t)


class LTXLayouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight`` ...: LTX-Video's original names are diffusers' own.

        The strength ``alpha / r`` is folded into ``lora_B`` and no ``.alpha`` keys are written, as
        diffusion-pipe writes LTX-Video LoRAs: diffusers' converter of such LoRAs refuses keys
        without ``lora`` in them, and ComfyUI applies a LoRA without alpha at strength 1.
        """
        return comfy_lora_layout(layers, alpha, fold_alpha=True)


ARCHITECTURE = Architecture(
    record=Record(
        name="ltx-video",
        pipeline_class="LTXPipeline",
        denoiser="transformer",
        denoiser_class="LTXVideoTransformer3DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        tokenizer_lengths={"tokenizer": PROMPT_TOKENS},
        patch_factor=1,
        codec=LTXVideoLatents(vae_class="AutoencoderKLLTXVideo", frame_multiple=8, frame_rate=25.0),
        preset_name="tiny-ltx-video",
        preset={
            "transformer": {
                "in_channels": 8, "out_channels": 8, "num_attention_heads": 2, "attention_head_dim": 16, "cross_attention_dim": 32, "num_layers": 2,
                "caption_channels": 64,
            },
            # patch_size 1 (LTX-Video's is 4): 8x spatial compression, so a 32-pixel tiny clip still has 4x4 latents; 8x in time as the real one.
            "vae": {
                "latent_channels": 8, "block_out_channels": [16, 16, 16, 16], "decoder_block_out_channels": [16, 16, 16, 16],
                "layers_per_block": [1, 1, 1, 1, 1], "decoder_layers_per_block": [1, 1, 1, 1, 1], "patch_size": 1, "patch_size_t": 1,
            },
            "text_encoder": tiny_t5(),
            # LTX-Video's sampler: Euler with a shift that grows with the number of tokens.
            "scheduler": {
                "class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True,
                "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024, "max_image_seq_len": 4096,
            },
        },
        # Every linear layer of the blocks' attention and feed-forward, as diffusion-pipe trains LTX-Video LoRAs.
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"),
    ),
    call=LTXCall(),
    prompts=LTXPrompts(),
    sampling=LTXSampling(),
    layouts=LTXLayouts(),
)
