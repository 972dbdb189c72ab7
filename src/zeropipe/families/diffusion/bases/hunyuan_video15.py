"""HunyuanVideo 1.5: an 8.3B single-stream video transformer (Qwen2.5-VL and ByT5 text) on a 16x-compressing 3D VAE, with flow matching.

Latents are (batch, 32, frames, height, width), 4x in time and 16x in space, scaled by the
VAE's ``scaling_factor``; clips are 4k+1 frames at 24 fps. The transformer takes 65 input
channels: the noisy latents, 32 channels of condition latents and a 1-channel mask, both zero
for text-to-video, as ``HunyuanVideo15Pipeline.prepare_cond_latents_and_mask`` builds them;
and 729 tokens of image embeddings, zero for text-to-video (the transformer then masks them
out). Prompts go through Qwen2.5-VL's language model (the hidden states of its third-last
layer after a system prompt, whose first 108 tokens are cut off, 1000 kept) and ByT5 for the
text in quotes ("glyph" text: zeros when the prompt quotes none), by
``HunyuanVideo15Pipeline.encode_prompt``.

Samples use the pipeline's classifier-free guidance (a ``ClassifierFreeGuidance`` guider
component) at ``generate.guidance_scale``, with the empty prompt as the negative.

diffusers 0.42 has no LoRA loader for this pipeline: the exported LoRA loads with the
transformer's own ``load_lora_adapter`` (docs/video.md). Its original (ComfyUI) key layout is
not written: no converter for it exists in diffusers to check it against.
"""

from __future__ import annotations

from typing import Any

import torch

from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts.latents import HunyuanVideo15Latents
from zeropipe.families.diffusion.roles import Assembly, DenoiserCall, PromptEncoding, Sampling
from zeropipe.families.diffusion.sampler import pipeline_call
from zeropipe.families.diffusion.tiny.components import tiny_byt5, tiny_qwen_text
from zeropipe.families.diffusion.tiny.tokenizers import character_tokenizer

SEMANTIC_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens: SigLIP's 27 x 27 patches
TEMPLATE_START = 108  # HunyuanVideo15Pipeline.prompt_template_encode_start_idx
PROMPT_TOKENS = 1000  # HunyuanVideo15Pipeline.tokenizer_max_length
GLYPH_TOKENS = 256  # HunyuanVideo15Pipeline.tokenizer_2_max_length

# Qwen2.5's chat template, as HunyuanVideo15Pipeline's format_text_input messages use it (a system and a user turn).
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def text_to_video_inputs(latents: torch.Tensor, semantic_dim: int) -> dict[str, torch.Tensor]:
    """What text-to-video gives the transformer besides the latents: zero condition latents and mask (channels), zero image embeddings."""
    batch, channels, frames, height, width = latents.shape
    zeros = latents.new_zeros(batch, channels + 1, frames, height, width)
    return {"channels": zeros, "image_embeds": latents.new_zeros(batch, SEMANTIC_TOKENS, semantic_dim)}


class HunyuanVideo15Prompts(PromptEncoding):
    """Qwen2.5-VL and ByT5 prompts through ``HunyuanVideo15Pipeline.encode_prompt``; a tiny preset's character and byte tokenizers."""

    def encode_prompts(self, pipeline, prompts, device):
        embeds, mask, glyph, glyph_mask = pipeline.encode_prompt(prompt=prompts, device=device, dtype=torch.float32, batch_size=len(prompts))
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "prompt_embeds_2": glyph, "prompt_embeds_mask_2": glyph_mask}

    def tiny_tokenizer(self, tokenizer):
        if tokenizer == "tokenizer_2":
            from transformers import ByT5Tokenizer

            return ByT5Tokenizer()  # bytes: it needs no vocabulary file
        # Characters: the system prompt alone is longer than the 108 tokens the pipeline cuts off, so the prompt stays whole.
        tokenizer = character_tokenizer(self.record.tokenizer_length(tokenizer))
        tokenizer.chat_template = QWEN_CHAT_TEMPLATE
        return tokenizer


class HunyuanVideo15Call(DenoiserCall):
    """The transformer called as ``HunyuanVideo15Pipeline`` calls it: the latents with the condition channels, the image embeddings, both prompts.

    Not traced for the planner (``trace_batch`` stays None): the transformer's forward branches on its inputs'
    values (whether the image embeddings are all zero) and gathers the valid text tokens by boolean masks,
    which the meta device cannot run.
    """

    def image_conditioning(self, model_input: torch.Tensor, condition: dict[str, torch.Tensor], image_embed_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the condition latents and mask channels, the image embeddings): zeros for text-to-video."""
        inputs = text_to_video_inputs(model_input, image_embed_dim)
        return inputs["channels"], inputs["image_embeds"]

    def predict(self, model, model_input, timesteps, condition, context):
        module = getattr(model, "module", model)  # the DeepSpeed engine wraps the transformer
        channels, image_embeds = self.image_conditioning(model_input, condition, module.config.image_embed_dim)
        hidden = torch.cat([model_input, channels.to(model_input.dtype)], dim=1)
        dtype = model_input.dtype
        return model(
            hidden_states=hidden, image_embeds=image_embeds.to(dtype), timestep=timesteps.to(dtype),
            encoder_hidden_states=condition["prompt_embeds"], encoder_attention_mask=condition["prompt_embeds_mask"].to(dtype),
            encoder_hidden_states_2=condition["prompt_embeds_2"], encoder_attention_mask_2=condition["prompt_embeds_mask_2"].to(dtype),
            return_dict=False,
        )[0]


class HunyuanVideo15Sampling(Sampling):
    """The pipeline's own call, its classifier-free guidance set on its guider component."""

    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        kwargs: dict[str, Any] = {"guidance_scale": guidance_scale}
        for name in ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2"):
            kwargs[name] = condition[name]
            kwargs[f"negative_{name}"] = negative[name]
        return kwargs

    def draw(self, pipeline, kwargs):
        from diffusers import ClassifierFreeGuidance

        kwargs = dict(kwargs)
        # The pipeline's guidance lives in its guider component, not in a call argument.
        pipeline.guider = ClassifierFreeGuidance(guidance_scale=float(kwargs.pop("guidance_scale")))
        return pipeline_call(pipeline, kwargs)[0]


class HunyuanVideo15Assembly(Assembly):
    def construct_pipeline(self, cls, kwargs, folder):
        if kwargs.get("vae") is not None:
            return cls(**kwargs)
        import diffusers

        # HunyuanVideo15Pipeline.__init__ reads vae.config.latent_channels even when the VAE is None (a text
        # pipeline, or one that samples latents): it is built with the VAE's config on the meta device (no
        # weights), then the VAE is taken out again, so that nothing runs on it and the device is the others'.
        with torch.device("meta"):
            vae = getattr(diffusers, self.record.codec.vae_class).from_config(folder.component_config("vae"))
        pipeline = cls(**{**kwargs, "vae": vae})
        pipeline.register_modules(vae=None)
        return pipeline


def guider() -> Any:
    """The pipeline's guider component, which a pipeline built here is given (samples set its scale: ``HunyuanVideo15Sampling.draw``)."""
    from diffusers import ClassifierFreeGuidance

    return ClassifierFreeGuidance(guidance_scale=6.0)


ARCHITECTURE = Architecture(
    record=Record(
        name="hunyuan-video-1.5",
        trace_frames=121,  # HunyuanVideo15Pipeline's default clip: 5 s at 24 fps
        pipeline_class="HunyuanVideo15Pipeline",
        denoiser="transformer",
        denoiser_class="HunyuanVideo15Transformer3DModel",
        objective="flow",
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        patch_factor=1,
        codec=HunyuanVideo15Latents(vae_class="AutoencoderKLHunyuanVideo15", frame_multiple=4, frame_rate=24.0),
        preset_name="tiny-hunyuan-video-1.5",
        preset={
            "transformer": {
                "in_channels": 8 + 8 + 1, "out_channels": 8, "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2, "num_refiner_layers": 1,
                "mlp_ratio": 2.0, "text_embed_dim": 32, "text_embed_2_dim": 32, "image_embed_dim": 16, "rope_axes_dim": [4, 6, 6], "target_size": 64,
                "task_type": "t2v",
            },
            "vae": {
                "latent_channels": 8, "block_out_channels": [16, 16, 16, 16, 16], "layers_per_block": 1, "spatial_compression_ratio": 16,
                "temporal_compression_ratio": 4, "scaling_factor": 1.0,
            },
            "text_encoder": tiny_qwen_text(),
            "text_encoder_2": tiny_byt5(),
            # HunyuanVideo 1.5 480p text-to-video's sampler: Euler on flow sigmas with a shift of 5 (diffusers' converter).
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 5.0},
        },
        # Every linear layer of the blocks' attention and MLPs (diffusion-pipe's hunyuan_video_15 adapts the blocks' linear layers).
        lora_targets=r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2))",
        tokenizer_lengths={"tokenizer": PROMPT_TOKENS + TEMPLATE_START, "tokenizer_2": GLYPH_TOKENS},
        trace_tokens=PROMPT_TOKENS,
        pipeline_kwargs={"guider": guider()},
    ),
    call=HunyuanVideo15Call(),
    prompts=HunyuanVideo15Prompts(),
    sampling=HunyuanVideo15Sampling(),
    assembly=HunyuanVideo15Assembly(),
)
