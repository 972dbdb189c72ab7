"""AuraFlow (fal's AuraFlow v0.3, and Pony V7 on it): a 6.8B MMDiT on SDXL's VAE latents, conditioned on Pile-T5-XL (UMT5).

``AuraFlowPipeline`` pads every prompt to 256 T5 tokens (768 for Pony V7: diffusion-pipe's
``max_sequence_length``) and zeroes the hidden states after the text; the transformer gets
no mask and attends to those zeros, so the cached embedding is the whole padded sequence.
Latents are SDXL's (4 channels, scaled, not shifted), not packed: the transformer patchifies
2x2 itself, with a learned position table it crops to the image. The time input is
``t / 1000`` and the output is the flow itself (no sign change), as in SD3.

diffusion-pipe writes AuraFlow LoRAs in diffusers' layout, which ComfyUI loads: the LoRA is
not written in another layout.
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import ImageLatents
from zeropipe.families.diffusion.roles import DenoiserCall, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_vae
from zeropipe.families.diffusion.tiny.tokenizers import character_t5_tokenizer

TEXT_TOKENS = 256  # AuraFlowPipeline's max_sequence_length


def text_mask(embeds: torch.Tensor) -> torch.Tensor:
    """A mask of ones for cached embeddings: the pipeline wants one beside prompt_embeds, and the transformer never reads it."""
    return torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)


class AuraFlowPrompts(PromptEncoding):
    def tiny_tokenizer(self, tokenizer):
        return character_t5_tokenizer(TEXT_TOKENS)

    def encode_prompts(self, pipeline, prompts, device):
        embeds, _, _, _ = pipeline.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False, device=device, max_sequence_length=TEXT_TOKENS)
        return {"prompt_embeds": embeds}


class AuraFlowCall(DenoiserCall):
    def inputs(self, model_input, timesteps, condition, context):
        return {
            "hidden_states": model_input, "encoder_hidden_states": condition["prompt_embeds"], "timestep": (timesteps.float() / 1000).to(context.dtype),
            "return_dict": False,
        }

    def trace_batch(self, config, latent, latent_frames, text_tokens, dtype):
        return (
            torch.randn(1, config.in_channels, latent, latent, dtype=dtype), torch.tensor([500.0]),
            {"prompt_embeds": torch.randn(1, text_tokens, config.joint_attention_dim, dtype=dtype)},
        )


class AuraFlowSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {
            "prompt_embeds": condition["prompt_embeds"], "prompt_attention_mask": text_mask(condition["prompt_embeds"]),
            "negative_prompt_embeds": negative["prompt_embeds"], "negative_prompt_attention_mask": text_mask(negative["prompt_embeds"]),
            "guidance_scale": guidance_scale, "max_sequence_length": TEXT_TOKENS,
        }


ARCHITECTURE = Architecture(
    record=Record(
        name="auraflow",
        pipeline_class="AuraFlowPipeline",
        denoiser="transformer",
        denoiser_class="AuraFlowTransformer2DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=2,
        codec=ImageLatents(),
        preset_name="tiny-auraflow",
        preset={
            # A 16 x 16 position table: up to 32 x 32 latents (64 px with the tiny VAE).
            "transformer": {
                "sample_size": 16, "patch_size": 2, "in_channels": 4, "out_channels": 4, "num_mmdit_layers": 1, "num_single_dit_layers": 1,
                "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 64, "caption_projection_dim": 32, "pos_embed_max_size": 256,
            },
            "vae": tiny_vae(latent_channels=4, scaling_factor=0.13025),
            "text_encoder": {"class": "UMT5EncoderModel", "vocab_size": 128, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
                             "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0, "feed_forward_proj": "gated-silu"},
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.73, "use_dynamic_shifting": False},
        },
        # The attention projections of both streams, as diffusers' and diffusion-pipe's AuraFlow LoRAs train.
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        tokenizer_lengths={"tokenizer": TEXT_TOKENS},
        image_processor_patch=2,  # the transformer patchifies 2x2
    ),
    call=AuraFlowCall(),
    prompts=AuraFlowPrompts(),
    sampling=AuraFlowSampling(),
)
