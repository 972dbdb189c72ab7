"""FLUX.2 [klein]: FLUX.2's transformer class at 4B/9B, without guidance embedding, conditioned on Qwen3 (4B or 8B).

Everything but the text encoder and the guidance is [dev]'s (``bases/flux2.py``: its record and roles): the same VAE,
patching and batch-norm normalisation, the same token layout and LoRA layouts. Prompts go
through Qwen3's chat template (thinking off), padded to 512 tokens, and hidden layers 9, 18
and 27 of its 36 are stacked (the encoder's quarters, as for [dev]). The base models sample
with real classifier-free guidance against the empty prompt; the step-distilled ones
(``is_distilled`` in model_index.json) without, as ``Flux2KleinPipeline`` decides. Unlike
``Flux2Pipeline``, it denormalises and unpatches its latents with the VAE's statistics even
when asked for latents, so every rank holds the VAE (84M parameters at full size) while
drawing samples (its codec's ``vae_while_sampling``).
"""

from __future__ import annotations

import dataclasses

import torch

from zeropipe.families.diffusion.bases.flux2 import ARCHITECTURE as FLUX2
from zeropipe.families.diffusion.bases.flux2 import Flux2Prompts, Flux2Sampling
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts.latents import Flux2Latents
from zeropipe.families.diffusion.tiny.components import tiny_flux2_transformer, tiny_flux2_vae
from zeropipe.families.diffusion.tiny.tokenizers import character_qwen_tokenizer, QWEN3_CHAT_TEMPLATE as CHAT_TEMPLATE


class Flux2KleinPrompts(Flux2Prompts):
    def tiny_tokenizer(self, tokenizer):
        made = character_qwen_tokenizer(256)
        made.chat_template = CHAT_TEMPLATE
        return made


class Flux2KleinSampling(Flux2Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {"prompt_embeds": condition["prompt_embeds"], "negative_prompt_embeds": negative["prompt_embeds"], "guidance_scale": guidance_scale}

    def unpack_latents(self, pipeline, latents, size, vae_factor):
        # Flux2KleinPipeline returns the VAE's latents even for output_type="latent" (patches undone, batch norm
        # undone): back to the normalised patches, which the shared sampling code denormalises and decodes.
        vae = pipeline.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents)
        return (self.record.codec.from_vae(latents) - mean) / std


# [dev]'s record (its LoRA targets, prompt lengths, patching and the optional reference images: Flux2KleinPipeline appends
# them the same way) with its own pipeline, codec and tiny preset.
ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        FLUX2.record,
        name="flux2-klein",
        pipeline_class="Flux2KleinPipeline",
        # The pipeline denormalises its latents with the VAE's statistics even for output_type="latent".
        codec=Flux2Latents(vae_class="AutoencoderKLFlux2", vae_while_sampling=True),
        preset_name="tiny-flux2-klein",
        preset={
            "transformer": tiny_flux2_transformer(joint_attention_dim=3 * 32, guidance_embeds=False),
            "vae": tiny_flux2_vae(),
            # Qwen3 at 4 layers of 32: FLUX.2's quarter layers 1, 2, 3 exist.
            "text_encoder": {
                "class": "Qwen3ForCausalLM", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 1024, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
            },
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
        },
    ),
    call=FLUX2.call,
    prompts=Flux2KleinPrompts(),
    sampling=Flux2KleinSampling(),
    layouts=FLUX2.layouts,
)
