"""Z-Image: a 6B single-stream DiT on the Flux VAE's latents, conditioned on Qwen3's second-to-last hidden states.

``ZImageTransformer2DModel`` takes lists (one latent (C, 1, H, W) and one caption (L, D) per
image, each caption as long as its prompt), its time input runs the other way (1 - sigma)
and it predicts the flow with the opposite sign: ``predict`` converts, as ``ZImagePipeline``
does, so the objective is the same rectified flow as for SD3 and Flux. Prompts are wrapped
in Qwen3's chat template; a caption's embedding is cached with its mask (a batch pads with
zeros) and the mask cuts it back to its own length before the transformer sees it.

The LoRA's original layout is diffusers' module names under ``diffusion_model.``, which
diffusers' converter of non-diffusers Z-Image LoRAs reads back (the names ai-toolkit and
musubi-tuner write, and ComfyUI loads).
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.comfy import COMFY_PREFIX, comfy_lora_layout
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import ImageLatents
from zeropipe.families.diffusion.roles import DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_vae
from zeropipe.families.diffusion.tiny.tokenizers import character_qwen_tokenizer, QWEN3_CHAT_TEMPLATE as CHAT_TEMPLATE


def captions(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each caption's embedding at its own length (what ZImagePipeline passes), from a padded batch and its mask."""
    return [row[keep.bool()] for row, keep in zip(embeds, mask)]


class ZImagePrompts(PromptEncoding):
    def tiny_tokenizer(self, tokenizer):
        made = character_qwen_tokenizer(self.record.tokenizer_length(tokenizer))
        made.chat_template = CHAT_TEMPLATE
        return made

    def encode_prompts(self, pipeline, prompts, device):
        max_length = min(pipeline.tokenizer.model_max_length, 512)
        embeds, _ = pipeline.encode_prompt(prompt=list(prompts), device=device, do_classifier_free_guidance=False, max_sequence_length=max_length)
        length = max(row.shape[0] for row in embeds)
        padded = torch.stack([torch.nn.functional.pad(row, [0, 0, 0, length - row.shape[0]]) for row in embeds])
        mask = torch.stack([torch.arange(length, device=padded.device) < row.shape[0] for row in embeds]).long()
        return {"prompt_embeds": padded, "prompt_embeds_mask": mask}


class ZImageCall(DenoiserCall):
    def inputs(self, model_input, timesteps, condition, context):
        images = list(model_input.unsqueeze(2).unbind(0))  # (C, 1, H, W) each
        return {"x": images, "t": (1000 - timesteps.float()) / 1000, "cap_feats": captions(condition["prompt_embeds"], condition["prompt_embeds_mask"]), "return_dict": False}

    def output(self, out):
        return -torch.stack(out[0]).squeeze(2)

    def trace_inputs(self, config, latent, latent_frames, text_tokens, dtype):
        return {
            "x": [torch.randn(config.in_channels, 1, latent, latent, dtype=dtype)], "t": torch.tensor([0.5], dtype=dtype),
            "cap_feats": [torch.randn(text_tokens, config.cap_feat_dim, dtype=dtype)],
        }


class ZImageSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {
            "prompt_embeds": captions(condition["prompt_embeds"], condition["prompt_embeds_mask"]),
            "negative_prompt_embeds": captions(negative["prompt_embeds"], negative["prompt_embeds_mask"]),
            "guidance_scale": guidance_scale,
        }


class ZImageLayouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.<module>.lora_A.weight`` / ``lora_B.weight`` / ``.alpha``: the Z-Image LoRA layout ComfyUI loads."""
        return comfy_lora_layout(layers, alpha)

    def original_lokr_layout(self, layers, scaling):
        """``diffusion_model.<module>.lokr_w1`` ...: ai-toolkit's Z-Image LoKr layout, which diffusers' Z-Image loader converts and ComfyUI reads."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in layers.items():
            module, _, part = key.rpartition(".lokr_")
            first = f"{module}.lokr_w1" if f"{module}.lokr_w1" in layers else f"{module}.lokr_w1_a"
            out[f"{COMFY_PREFIX}{key}"] = (tensor * scaling if key == first else tensor).contiguous()
        return out


ARCHITECTURE = Architecture(
    record=Record(
        name="z-image",
        pipeline_class="ZImagePipeline",
        related_pipelines=("ZImageImg2ImgPipeline",),
        denoiser="transformer",
        denoiser_class="ZImageTransformer2DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=2,
        codec=ImageLatents(shifted=True),
        preset_name="tiny-z-image",
        preset={
            "transformer": {
                "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 4, "dim": 32, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 2,
                "n_kv_heads": 2, "cap_feat_dim": 32, "axes_dims": [4, 6, 6], "axes_lens": [512, 64, 64],
            },
            "vae": tiny_vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False),
            "text_encoder": {
                "class": "Qwen3Model", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
            },
            # Z-Image-Turbo's scheduler: a fixed shift of 3.
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
        },
        # The attention projections of every block (main, noise and context refiners) and the feed-forward, as ai-toolkit trains Z-Image.
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
        tokenizer_lengths={"tokenizer": 128},
        image_processor_patch=2,  # the transformer patchifies 2x2
    ),
    call=ZImageCall(),
    prompts=ZImagePrompts(),
    sampling=ZImageSampling(),
    layouts=ZImageLayouts(),
)
