"""Lumina 2 (Lumina-Image 2.0): a 2.6B unified single-stream DiT on the Flux VAE's latents, conditioned on Gemma-2-2B.

``Lumina2Pipeline`` prepends a system prompt (``"You are an assistant designed to generate
superior images ... <Prompt Start> "``) to every caption, pads it to 256 Gemma tokens and takes
the second-to-last hidden states with the attention mask: the mask is cached with the
embedding, and the transformer cuts each caption to its mask's length (a batch's padding is
invisible). Latents are (batch, 16, h, w), not packed (the transformer patchifies 2x2 itself).
As Z-Image's, the transformer's time input runs the other way (``1 - t / 1000``) and it predicts
the flow with the opposite sign: ``predict`` converts, as the pipeline's loop does, so the
objective is the same rectified flow as SD3's. Samples use the pipeline's classifier-free
guidance with its norm-preserving rescale (``cfg_normalization``).

The pipeline fixes its VAE factor at 8 (it does not read the VAE's config), so the tiny preset's
VAE halves three times, as the real one does.

The LoRA is written in diffusers' layout, which ``Lumina2LoraLoaderMixin`` loads; the original
(ComfyUI) layout fuses q/k/v and expects the blocks' adaLN modulation trained too, so it is not
written (``original_lora_layout`` is None).
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import ImageLatents
from zeropipe.families.diffusion.roles import DenoiserCall, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_gemma2, tiny_vae
from zeropipe.families.diffusion.tiny.tokenizers import character_gemma_tokenizer


def text_mask(mask: torch.Tensor) -> torch.Tensor:
    """The caption mask as the transformer counts it (integers: it slices by the mask's sum); the cache holds floats."""
    return mask.round().long()


class Lumina2Prompts(PromptEncoding):
    def tiny_tokenizer(self, tokenizer):
        return character_gemma_tokenizer(self.record.tokenizer_length(tokenizer))

    def encode_prompts(self, pipeline, prompts, device):
        embeds, mask, _, _ = pipeline.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False, device=device, max_sequence_length=256)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}


class Lumina2Call(DenoiserCall):
    def inputs(self, model_input, timesteps, condition, context):
        return {
            "hidden_states": model_input, "timestep": (1 - timesteps.float() / 1000).to(context.dtype), "encoder_hidden_states": condition["prompt_embeds"],
            "encoder_attention_mask": text_mask(condition["prompt_attention_mask"]), "return_dict": False,
        }

    def output(self, out):
        return -out[0]

    def trace_batch(self, config, latent, latent_frames, text_tokens, dtype):
        # The mask is made on the CPU: the transformer reads its sum as Python integers, which a meta tensor cannot give.
        return (
            torch.randn(1, config.in_channels, latent, latent, dtype=dtype), torch.tensor([500.0]),
            {"prompt_embeds": torch.randn(1, text_tokens, config.cap_feat_dim, dtype=dtype), "prompt_attention_mask": torch.ones(1, text_tokens, device="cpu")},
        )


class Lumina2Sampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {
            "prompt_embeds": condition["prompt_embeds"], "prompt_attention_mask": text_mask(condition["prompt_attention_mask"]),
            "negative_prompt_embeds": negative["prompt_embeds"], "negative_prompt_attention_mask": text_mask(negative["prompt_attention_mask"]),
            "guidance_scale": guidance_scale,
        }


ARCHITECTURE = Architecture(
    record=Record(
        name="lumina2",
        pipeline_class="Lumina2Pipeline",
        denoiser="transformer",
        denoiser_class="Lumina2Transformer2DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=2,
        codec=ImageLatents(shifted=True),
        preset_name="tiny-lumina2",
        preset={
            "transformer": {
                "sample_size": 16, "patch_size": 2, "in_channels": 4, "hidden_size": 32, "num_layers": 2, "num_refiner_layers": 1, "num_attention_heads": 2,
                "num_kv_heads": 1, "multiple_of": 16, "axes_dim_rope": [4, 6, 6], "axes_lens": [300, 64, 64], "cap_feat_dim": 32,
            },
            # Three halvings: Lumina2Pipeline takes its VAE factor as 8 whatever the VAE says.
            "vae": tiny_vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
            | {"block_out_channels": [32, 32, 32, 32], "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4},
            "text_encoder": tiny_gemma2(),
            # Lumina-Image 2.0's scheduler: Flux's, shift 6, with the resolution-dependent shift the pipeline computes.
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 6.0, "use_dynamic_shifting": False},
        },
        # Attention and feed-forward of every block (main and both refiners), as diffusion-pipe's and diffusers' Lumina 2 LoRAs train.
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "feed_forward.linear_1", "feed_forward.linear_2", "feed_forward.linear_3"),
        tokenizer_lengths={"tokenizer": 256},  # Lumina2Pipeline's max_sequence_length: every caption is padded to it
        image_processor_patch=2,  # the transformer patchifies 2x2
    ),
    call=Lumina2Call(),
    prompts=Lumina2Prompts(),
    sampling=Lumina2Sampling(),
)
