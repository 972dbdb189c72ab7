"""ERNIE-Image: Baidu's 8B single-stream DiT on FLUX.2's patched latents, conditioned on Ministral 3's second-to-last hidden states.

The VAE is FLUX.2's (``AutoencoderKLFlux2``): ``ErnieImagePipeline`` folds each 2x2 latent patch
into channels (128) and normalises them by the batch-norm statistics the VAE keeps as weights,
as FLUX.2 does but with eps 1e-5 (the pipeline's own constant; the hub config says otherwise),
so the codec is FLUX.2's with that eps. The transformer sees the patched latents as they are
(patch 1), image tokens first then the text's, with one shared adaLN modulation; it takes the
scheduler's timestep (0..1000) and predicts noise - x0.

Prompts are encoded one by one at their own length (no padding, the tokenizer's BOS first) and
the transformer is told each length (``text_lens``): it masks the rest and places the image
after the text in its rotary ids. The cache keeps each caption's embedding with its mask; a
batch pads with zeros, which the lengths leave out. The pipeline's prompt enhancer (``pe``) is
a sampling-time rewrite and is never loaded: captions train as they are.

The LoRA's original layout is diffusers' module names under ``diffusion_model.`` (the names
ai-toolkit writes and ErnieImagePipeline's loader reads), the strength folded into ``lora_B``.
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.comfy import COMFY_PREFIX
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts.latents import ErnieImageLatents
from zeropipe.families.diffusion.roles import Assembly, DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_flux2_vae, tiny_mistral3_model
from zeropipe.families.diffusion.tiny.tokenizers import character_mistral_tokenizer


def prompt_lengths(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(dim=1).long()


class ErniePrompts(PromptEncoding):
    def tiny_tokenizer(self, tokenizer):
        return character_mistral_tokenizer(self.record.tokenizer_length(tokenizer))

    def encode_prompts(self, pipeline, prompts, device):
        rows = pipeline.encode_prompt(list(prompts), device)
        embeds, lengths = pipeline._pad_text(rows, device, rows[0].dtype, rows[0].shape[-1])
        mask = (torch.arange(embeds.shape[1], device=embeds.device)[None] < lengths[:, None]).long()
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


class ErnieCall(DenoiserCall):
    """One call of the transformer on the patched latents and each caption at its own length (``text_lens``).

    Not traced (no ``trace_batch``): ErnieImageTransformer2DModel's rotary embedding opens torch.autocast on its inputs'
    device, which torch refuses for the meta device the planner traces on ("unsupported scalarType"). Its plans have no
    activation term.
    """

    def inputs(self, model_input, timesteps, condition, context):
        return {
            "hidden_states": model_input.to(context.dtype), "timestep": timesteps.to(context.dtype), "text_bth": condition["prompt_embeds"].to(context.dtype),
            "text_lens": prompt_lengths(condition["prompt_embeds_mask"]),
        }

    def predict(self, model, model_input, timesteps, condition, context):
        return model(**self.inputs(model_input, timesteps, condition, context), return_dict=False)[0]


class ErnieSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        def rows(encoded):
            return [row[:length] for row, length in zip(encoded["prompt_embeds"], prompt_lengths(encoded["prompt_embeds_mask"]).tolist())]

        return {"prompt_embeds": rows(condition), "negative_prompt_embeds": rows(negative), "guidance_scale": guidance_scale, "use_pe": False}

    def draw(self, pipeline, kwargs):
        # ErnieImagePipeline's vae_scale_factor is pixels per *patched* latent (2 ** VAE blocks); the shared assembly sets the VAE's own,
        # and its image processor the patched one (image_processor_patch).
        pipeline.vae_scale_factor = pipeline.image_processor.config.vae_scale_factor
        return pipeline(**kwargs)[0]


class ErnieLayouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.layers.0.self_attention.to_q.lora_A.weight`` / ``lora_B.weight`` (times alpha / r): what ErnieImagePipeline's loader and ComfyUI read."""
        out: dict[str, torch.Tensor] = {}
        for module in sorted({key.partition(".lora_")[0] for key in layers}):
            down, up = layers[f"{module}.lora_A.weight"], layers[f"{module}.lora_B.weight"]
            out[f"{COMFY_PREFIX}{module}.lora_A.weight"] = down.contiguous()
            out[f"{COMFY_PREFIX}{module}.lora_B.weight"] = (up * (alpha / down.shape[0])).contiguous()
        return out


class ErnieAssembly(Assembly):
    def tiny_denoiser(self, model):
        # The shared adaLN modulation and the output layer start at zero: every gate would be zero and LoRA get no gradient.
        with torch.no_grad():
            torch.nn.init.normal_(model.adaLN_modulation[-1].weight, std=0.2)
            torch.nn.init.normal_(model.final_linear.weight, std=0.2)


ARCHITECTURE = Architecture(
    record=Record(
        name="ernie-image",
        pipeline_class="ErnieImagePipeline",
        denoiser="transformer",
        denoiser_class="ErnieImageTransformer2DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=2,
        codec=ErnieImageLatents(vae_class="AutoencoderKLFlux2"),
        preset_name="tiny-ernie-image",
        preset={
            "transformer": {
                "hidden_size": 32, "num_attention_heads": 2, "num_layers": 2, "ffn_hidden_size": 64, "in_channels": 16, "out_channels": 16,
                "patch_size": 1, "text_in_dim": 16, "rope_axes_dim": [4, 6, 6],
            },
            "vae": tiny_flux2_vae(),
            "text_encoder": tiny_mistral3_model(),
            # ERNIE-Image samples with a fixed shift (its scheduler config); the tiny one with 3.
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
        },
        # The attention and the GeGLU feed-forward of every block, as ai-toolkit trains ERNIE-Image.
        lora_targets=("self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0", "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2"),
        tokenizer_lengths={"tokenizer": 512},
        trace_tokens=256,  # a long caption; each prompt keeps its own length
        image_processor_patch=2,  # latents are patched 2x2
    ),
    call=ErnieCall(),
    prompts=ErniePrompts(),
    sampling=ErnieSampling(),
    layouts=ErnieLayouts(),
    assembly=ErnieAssembly(),
)
