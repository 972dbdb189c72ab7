"""HunyuanImage 2.1: a 17B dual/single-stream DiT on a 32x VAE's latents, conditioned on Qwen2.5-VL and a glyph ByT5.

``HunyuanImagePipeline`` wraps every prompt in its description template, pads it to 1000 tokens
after the template (cut off by the first 34 tokens) and takes Qwen2.5-VL-7B's third-to-last
hidden states with the mask. Text in quotes in the prompt (the glyphs to draw) is encoded
apart by a ByT5-small trained on glyphs, 128 bytes with its mask, or zeros where the prompt
quotes nothing. All four tensors are cached per caption; the transformer puts the valid
tokens of both first, so padding is invisible.

Latents are (batch, 64, h, w) of the 32x VAE, scaled (no shift), one token per latent pixel.
The time input is the pipeline's timestep (sigma x 1000) and the output is the flow itself.
HunyuanImage-2.1-Distilled is guidance-distilled (``guidance_embeds``: ``model.diffusion.guidance``
x 1000 is fed in training, as the pipeline feeds ``distilled_guidance_scale``) and trained as a
MeanFlow (``use_meanflow``): training takes the instantaneous velocity (the interval's end
equals its start), which is the flow-matching target. Samples use the pipeline's own guider as
its folder has it (adaptive projected guidance for the base model).

diffusers 0.42 has no LoRA loader for this pipeline: the LoRA is read back by the transformer's
own ``load_lora_adapter``. ComfyUI's HunyuanImage LoRA names differ from the original layout
(diffusion-pipe's note), so only diffusers' layout is written.
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import ImageLatents
from zeropipe.families.diffusion.roles import DenoiserCall, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_qwen_encoder
from zeropipe.families.diffusion.tiny.tokenizers import character_qwen_tokenizer

QWEN_TOKENS = 1000  # HunyuanImagePipeline.tokenizer_max_length, after the template's 34 tokens
GLYPH_TOKENS = 128  # tokenizer_2_max_length: ByT5's bytes


def mask(values: torch.Tensor) -> torch.Tensor:
    """A cached mask (floats) as the pipeline returns it (integers)."""
    return values.round().long()


class HunyuanImagePrompts(PromptEncoding):
    def tiny_tokenizer(self, tokenizer):
        if tokenizer == "tokenizer_2":
            from transformers import ByT5Tokenizer

            return ByT5Tokenizer(extra_ids=0)
        return character_qwen_tokenizer(self.record.tokenizer_length(tokenizer))

    def encode_prompts(self, pipeline, prompts, device):
        embeds, embeds_mask, glyphs, glyphs_mask = pipeline.encode_prompt(prompt=list(prompts), device=device, batch_size=len(prompts))
        return {"prompt_embeds": embeds, "prompt_embeds_mask": embeds_mask, "prompt_embeds_2": glyphs, "prompt_embeds_mask_2": glyphs_mask}


class HunyuanImageCall(DenoiserCall):
    """The transformer on the latents and both prompt encodings; its ``predict`` reads the model's config (guidance-distilled,
    MeanFlow or neither), so it is written whole, and its trace leaves out the glyph tokens."""

    def predict(self, model, model_input, timesteps, condition, context):
        module = getattr(model, "module", model)  # the DeepSpeed engine wraps the transformer
        batch = model_input.shape[0]
        guidance = torch.full((batch,), context.guidance * 1000.0, device=context.device, dtype=context.dtype) if module.config.guidance_embeds else None
        # MeanFlow models take the interval's end too: its start (r = t) asks for the instantaneous velocity, the flow-matching target.
        timestep_r = timesteps.to(context.dtype) if module.config.use_meanflow else None
        return model(
            hidden_states=model_input, timestep=timesteps.to(context.dtype), timestep_r=timestep_r, guidance=guidance,
            encoder_hidden_states=condition["prompt_embeds"], encoder_attention_mask=mask(condition["prompt_embeds_mask"]),
            encoder_hidden_states_2=condition["prompt_embeds_2"], encoder_attention_mask_2=mask(condition["prompt_embeds_mask_2"]), return_dict=False,
        )[0]

    def trace_inputs(self, config, latent, latent_frames, text_tokens, dtype):
        # Without the glyph tokens: the transformer sorts them by their mask's values, which the meta device cannot do
        # (128 of 1128 text tokens left out of the trace).
        return {
            "hidden_states": torch.randn(1, config.in_channels, latent, latent, dtype=dtype), "timestep": torch.tensor([500.0], dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, config.text_embed_dim, dtype=dtype),
            "encoder_attention_mask": torch.ones(1, text_tokens, dtype=torch.long),
            "guidance": torch.tensor([3250.0], dtype=dtype) if config.guidance_embeds else None,
            "timestep_r": torch.tensor([400.0], dtype=dtype) if config.use_meanflow else None,
        }


class HunyuanImageSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {
            "prompt_embeds": condition["prompt_embeds"], "prompt_embeds_mask": mask(condition["prompt_embeds_mask"]),
            "prompt_embeds_2": condition["prompt_embeds_2"], "prompt_embeds_mask_2": mask(condition["prompt_embeds_mask_2"]),
            "negative_prompt_embeds": negative["prompt_embeds"], "negative_prompt_embeds_mask": mask(negative["prompt_embeds_mask"]),
            "negative_prompt_embeds_2": negative["prompt_embeds_2"], "negative_prompt_embeds_mask_2": mask(negative["prompt_embeds_mask_2"]),
            "distilled_guidance_scale": guidance,
        }


ARCHITECTURE = Architecture(
    record=Record(
        name="hunyuan-image",
        pipeline_class="HunyuanImagePipeline",
        denoiser="transformer",
        denoiser_class="HunyuanImageTransformer2DModel",
        objective="flow",
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        patch_factor=1,
        codec=ImageLatents(vae_class="AutoencoderKLHunyuanImage"),
        preset_name="tiny-hunyuan-image",
        preset={
            "transformer": {
                "in_channels": 16, "out_channels": 16, "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 1, "num_single_layers": 1,
                "num_refiner_layers": 1, "patch_size": [1, 1], "text_embed_dim": 32, "text_embed_2_dim": 64, "rope_axes_dim": [8, 8],
            },
            # Two halvings (the real VAE: five, 32x): 32-pixel images are 8x8 latents.
            "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [32, 32, 32], "layers_per_block": 1,
                    "spatial_compression_ratio": 4, "sample_size": 32, "scaling_factor": 0.75289},
            "text_encoder": tiny_qwen_encoder(),
            "text_encoder_2": {"class": "T5EncoderModel", "vocab_size": 384, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
                               "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0},
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 4.0, "use_dynamic_shifting": False},
        },
        # The attention projections of both streams, as diffusers' HunyuanImage LoRAs train.
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
        tokenizer_lengths={"tokenizer": QWEN_TOKENS + 34, "tokenizer_2": GLYPH_TOKENS},
        trace_tokens=QWEN_TOKENS,
    ),
    call=HunyuanImageCall(),
    prompts=HunyuanImagePrompts(),
    sampling=HunyuanImageSampling(),
)
