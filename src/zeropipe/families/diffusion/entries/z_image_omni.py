"""Z-Image Omni: Z-Image's transformer in its omni mode (images and SigLIP features as conditions), trained here on text-to-image.

``ZImageOmniPipeline`` calls ``ZImageTransformer2DModel`` (a config with ``siglip_feat_dim``: the SigLIP
embedder and refiner) with *nested* lists: per example, its condition images' latents followed by the
target's, its prompt's segments, its SigLIP features (None without condition images) and a noise mask
(0 for a clean condition image, 1 for the target). Text-to-image is one latent, one prompt segment, no
SigLIP features and a mask ``[1]``: what ``predict`` passes, so the transformer runs its omni path (the
noisy/clean time embeddings, the [caption, image] order) as the pipeline's does. As in Z-Image, the time input
runs the other way (1 - sigma) and the velocity has the opposite sign; ``predict`` converts.

Prompts: ``encode_prompt`` wraps a prompt in Qwen3's user/assistant turn as a plain string (not the tokenizer's
chat template), pads to ``max_sequence_length`` and keeps the second-to-last hidden states at the prompt's own
length; the cache holds them padded with a mask (a batch pads with zeros) and ``predict`` cuts them back.

Not trained here: the omni conditions (reference images through the VAE and SigLIP 2), which need a condition
part for images with SigLIP features; samples are text-to-image. SigLIP 2 is in the folder (the pipeline's
constructor takes it) and is not loaded for text-to-image. Z-Image's own entry is not imported (no entry imports
another): the few lines they share are repeated here.
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.comfy import comfy_lora_layout
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import ImageLatents
from zeropipe.families.diffusion.roles import Assembly, DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_vae
from zeropipe.families.diffusion.tiny.tokenizers import QWEN3_CHAT_TEMPLATE, character_qwen_tokenizer


def captions(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each caption's embedding at its own length, from a padded batch and its mask."""
    return [row[keep.bool()] for row, keep in zip(embeds, mask)]


class ZImageOmniPrompts(PromptEncoding):
    def tiny_tokenizer(self, tokenizer):
        made = character_qwen_tokenizer(self.record.tokenizer_length(tokenizer))
        made.chat_template = QWEN3_CHAT_TEMPLATE
        return made

    def encode_prompts(self, pipeline, prompts, device):
        max_length = min(pipeline.tokenizer.model_max_length, 512)
        embeds, _ = pipeline.encode_prompt(prompt=list(prompts), device=device, do_classifier_free_guidance=False, max_sequence_length=max_length)
        rows = [segments[0] for segments in embeds]  # text-to-image: one segment per prompt
        length = max(row.shape[0] for row in rows)
        padded = torch.stack([torch.nn.functional.pad(row, [0, 0, 0, length - row.shape[0]]) for row in rows])
        mask = torch.stack([torch.arange(length, device=padded.device) < row.shape[0] for row in rows]).long()
        return {"prompt_embeds": padded, "prompt_embeds_mask": mask}


class ZImageOmniCall(DenoiserCall):
    """The transformer's omni path on nested lists, text-to-image: per example no condition image, the target, one prompt segment."""

    def inputs(self, model_input, timesteps, condition, context):
        targets = [[image] for image in model_input.unsqueeze(2).unbind(0)]  # per example: no condition image, the target (C, 1, H, W)
        prompts = [[caption] for caption in captions(condition["prompt_embeds"], condition["prompt_embeds_mask"])]
        return {
            "x": targets, "t": (1000 - timesteps.float()) / 1000, "cap_feats": prompts, "siglip_feats": [None] * len(targets),
            "image_noise_mask": [[1]] * len(targets),
        }

    def predict(self, model, model_input, timesteps, condition, context):
        out = model(**self.inputs(model_input, timesteps, condition, context), return_dict=False)[0]
        return -torch.stack([row.float() for row in out]).squeeze(2).to(model_input.dtype)

    def trace_inputs(self, config, latent, latent_frames, text_tokens, dtype):
        return {
            "x": [[torch.randn(config.in_channels, 1, latent, latent, dtype=dtype)]], "t": torch.tensor([0.5], dtype=dtype),
            "cap_feats": [[torch.randn(text_tokens, config.cap_feat_dim, dtype=dtype)]], "siglip_feats": [None], "image_noise_mask": [[1]],
        }


class ZImageOmniSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        # ZImageOmniPipeline takes prompt embeddings as segments per prompt; its guidance is cond + s (cond - uncond), on for s > 0.
        return {
            "prompt_embeds": [[row] for row in captions(condition["prompt_embeds"], condition["prompt_embeds_mask"])],
            "negative_prompt_embeds": [[row] for row in captions(negative["prompt_embeds"], negative["prompt_embeds_mask"])],
            "guidance_scale": guidance_scale,
        }


class ZImageOmniLayouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.<module>.lora_A.weight`` / ``lora_B.weight`` / ``.alpha``: Z-Image's LoRA layout, which ComfyUI loads."""
        return comfy_lora_layout(layers, alpha)


class ZImageOmniAssembly(Assembly):
    def tiny_component(self, name, fields):
        if name == "siglip":
            from transformers import Siglip2VisionConfig, Siglip2VisionModel

            return Siglip2VisionModel(Siglip2VisionConfig(**fields))
        if name == "siglip_processor":
            # transformers' PIL backend of Siglip2ImageProcessor (what it falls back to without torchvision), saved under its own name.
            from transformers import Siglip2ImageProcessorPil

            return Siglip2ImageProcessorPil(**fields)
        return super().tiny_component(name, fields)


ARCHITECTURE = Architecture(
    record=Record(
        name="z-image-omni",
        pipeline_class="ZImageOmniPipeline",
        denoiser="transformer",
        denoiser_class="ZImageTransformer2DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=2,
        codec=ImageLatents(shifted=True),
        preset_name="tiny-z-image-omni",
        preset={
            "transformer": {
                "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 4, "dim": 32, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 2,
                "n_kv_heads": 2, "cap_feat_dim": 32, "siglip_feat_dim": 16, "axes_dims": [4, 6, 6], "axes_lens": [512, 64, 64],
            },
            "vae": tiny_vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False),
            "text_encoder": {
                "class": "Qwen3Model", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
            },
            # SigLIP 2's layout, tiny: 8-pixel patches, at most 16 of them (Z-Image Omni's is so400m-patch16-naflex).
            "siglip": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "patch_size": 8, "num_patches": 16},
            "siglip_processor": {"patch_size": 8, "max_num_patches": 16},
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
        },
        # The attention projections of every block (main, noise, context and SigLIP refiners) and the feed-forward, as for Z-Image.
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
        tokenizer_lengths={"tokenizer": 128},
        image_processor_patch=2,  # the transformer patchifies 2x2
    ),
    call=ZImageOmniCall(),
    prompts=ZImageOmniPrompts(),
    sampling=ZImageOmniSampling(),
    layouts=ZImageOmniLayouts(),
    assembly=ZImageOmniAssembly(),
)
