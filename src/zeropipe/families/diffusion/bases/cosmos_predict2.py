"""Cosmos-Predict2 text-to-image (NVIDIA): a DiT (``CosmosTransformer3DModel``) on the Wan 2.1 VAE with T5-11B prompts, trained as rectified flow.

``Cosmos2TextToImagePipeline`` writes its sampler in EDM's terms (noise levels sigma from 80 down
to 0.002, latents x0 + sigma noise), but what the transformer sees is rectified flow: with
``t = sigma / (sigma + 1)`` its input is ``latents * (1 - t) = (1 - t) x0 + t noise``, its timestep
is ``t`` (0..1), and the pipeline reads its output as the velocity ``noise - x0`` (the denoised
latents are ``input - t * output``). So it trains with the flow objective (``predict`` hands the
transformer ``t = timesteps / 1000``), as diffusion-pipe's ``cosmos_predict2`` does; NVIDIA's own
trainer weights that loss by ``t**2 + (1 - t)**2``, which diffusion-pipe leaves out, and so do we.
The transformer also takes a padding mask at the image's pixel size, zeros for a whole image.

Latents are the Wan 2.1 VAE's, an image as a one-frame clip, normalised per channel
(``latents_mean`` / ``latents_std``, times the scheduler's ``sigma_data`` of 1), as the pipeline
decodes them. Prompts are T5-11B's last hidden states over 512 tokens, zeros after the prompt's
own (``encode_prompt``).

**NVIDIA's guardrail.** Both Cosmos-Predict2 pipelines refuse to run without NVIDIA's safety
checker (the ``cosmos_guardrail`` package), a condition of the NVIDIA Open Model License: their
constructor builds ``CosmosSafetyChecker()`` when given none (which downloads
nvidia/Cosmos-1.0-Guardrail and Qwen/Qwen3Guard-Gen-0.6B from the Hub, or fails with ImportError
where the package is missing), and ``__call__`` refuses a pipeline whose checker is None.
Training needs none of that: the transformer, the VAE and T5's encodings. What ZeRO-Pipe does (for
Video2World too, ``cosmos_predict2_video2world.py``):

- The pipeline objects it assembles for its own work (prompt encoding for the caches, the
  pipeline around the trained transformer while sampling, the tiny preset) are given
  :class:`GuardrailNotLoaded` as their ``safety_checker``: nothing is downloaded, and such a
  pipeline cannot generate, since its ``__call__`` asks the checker first and is refused with the
  reason. Nothing saved names it: its folder's ``model_index.json`` says ``safety_checker: [null,
  null]``, as diffusers' converter writes the published folders.
- Samples during training are drawn by :func:`draw_latents`, a loop over the pipeline's own
  parts (its ``prepare_latents``, its scheduler's timesteps and ``step``, the pipeline's
  preconditioning arithmetic) held equal to the pipeline's ``__call__`` by
  ``tests/unit/diffusion/test_cosmos_predict2.py``; those samples are not passed through the
  guardrail.
- Every pipeline a user loads is NVIDIA's, guardrail included: an export (merged: a pipeline
  folder; LoRA: the transformer's ``load_lora_adapter``) loaded with
  ``Cosmos2TextToImagePipeline.from_pretrained``, and the UI's Draw page, which loads it so. The licence's guardrail applies to that use (docs/video.md).

diffusers 0.42 has no LoRA loader for this pipeline: the exported LoRA loads with the
transformer's own ``load_lora_adapter``. Its original (ComfyUI, diffusion-pipe) layout is also
written: NVIDIA's module names (``diffusion_model.blocks.0.self_attn.q_proj``), each checked against
diffusers' single-file converter of original Cosmos checkpoints.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from zeropipe.families.diffusion.comfy import comfy_lora_layout
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts.latents import CosmosLatents
from zeropipe.families.diffusion.roles import DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.sampler import denoise
from zeropipe.families.diffusion.tiny.components import tiny_t5
from zeropipe.families.diffusion.tiny.tokenizers import character_t5_tokenizer

PROMPT_TOKENS = 512  # Cosmos2TextToImagePipeline's max_sequence_length
# diffusers module names in a block -> NVIDIA's (the inverse of diffusers' convert_cosmos_transformer_checkpoint_to_diffusers for Cosmos 2).
ORIGINAL_BLOCK_NAMES = {
    "attn1.to_q": "self_attn.q_proj", "attn1.to_k": "self_attn.k_proj", "attn1.to_v": "self_attn.v_proj", "attn1.to_out.0": "self_attn.output_proj",
    "attn2.to_q": "cross_attn.q_proj", "attn2.to_k": "cross_attn.k_proj", "attn2.to_v": "cross_attn.v_proj", "attn2.to_out.0": "cross_attn.output_proj",
    "ff.net.0.proj": "mlp.layer1", "ff.net.2": "mlp.layer2",
}


class GuardrailRequired(RuntimeError):
    """A Cosmos pipeline ZeRO-Pipe assembled for training was asked to generate."""


class GuardrailNotLoaded:
    """The ``safety_checker`` of the Cosmos pipelines ZeRO-Pipe assembles for training: not NVIDIA's guardrail, and no generation.

    The pipeline's constructor would build (download) NVIDIA's ``CosmosSafetyChecker`` where given
    None; training needs the pipeline only for its parts (``encode_prompt``, ``prepare_latents``, the
    scheduler). Its ``__call__`` moves the checker to the device before anything else, so such a
    pipeline refuses to generate, with the reason and the fix. It is not a module and is never saved
    (diffusers writes ``[null, null]`` for it, so a folder loaded later builds NVIDIA's checker).
    """

    def to(self, *args: Any, **kwargs: Any):
        raise GuardrailRequired(
            "this Cosmos-Predict2 pipeline was assembled by ZeRO-Pipe for training, without NVIDIA's guardrail (cosmos_guardrail), "
            "and does not generate: load the pipeline folder or export with Cosmos2TextToImagePipeline.from_pretrained(...) "
            "(Cosmos2VideoToWorldPipeline for Video2World; pip install cosmos_guardrail), which runs the guardrail the NVIDIA Open Model "
            "License requires"
        )

    check_text_safety = check_video_safety = to

    def __repr__(self) -> str:
        return "GuardrailNotLoaded()"


def original_module_name(module: str) -> str:
    """A diffusers CosmosTransformer3DModel module in NVIDIA's layout: transformer_blocks.0.attn1.to_q -> blocks.0.self_attn.q_proj."""
    prefix, index, rest = (module.split(".", 2) + ["", ""])[:3]
    if prefix != "transformer_blocks" or not index.isdigit() or rest not in ORIGINAL_BLOCK_NAMES:
        raise ValueError(f"{module} has no name in Cosmos-Predict2's original layout")
    return f"blocks.{index}.{ORIGINAL_BLOCK_NAMES[rest]}"


@torch.no_grad()
def draw_latents(
    pipeline, prompt_embeds: torch.Tensor, negative_prompt_embeds: torch.Tensor | None, guidance_scale: float, height: int, width: int,
    num_inference_steps: int, generator: torch.Generator | None, output_type: str = "latent", return_dict: bool = False,
) -> torch.Tensor:
    """Latents (batch, channels, 1, h, w) drawn as ``Cosmos2TextToImagePipeline.__call__`` draws them, without its guardrail.

    Written by hand because the pipeline's ``__call__`` cannot run without NVIDIA's guardrail (module
    docstring); every step is the pipeline's own: its ``prepare_latents``, its scheduler's timesteps
    from the same sigmas and its ``step``, the same preconditioning (``c_in``, ``c_skip``, ``c_out``),
    classifier-free guidance as Cosmos writes it (``cond + scale * (cond - uncond)``) and the same
    dtypes. ``tests/unit/diffusion/test_cosmos_predict2.py`` holds it equal to the pipeline's own call.
    """
    from diffusers.pipelines.cosmos.pipeline_cosmos2_text2image import retrieve_timesteps

    if output_type != "latent" or return_dict:
        raise ValueError("draw_latents returns latents only (output_type='latent', return_dict=False): the caller decodes them")
    scheduler, transformer = pipeline.scheduler, pipeline.transformer
    device = pipeline._execution_device
    dtype = transformer.dtype
    guided = guidance_scale > 1.0
    sigmas = torch.linspace(0, 1, num_inference_steps, dtype=torch.float64)  # float64, as the pipeline has them off Apple MPS
    timesteps, _ = retrieve_timesteps(scheduler, device=device, sigmas=sigmas)
    if scheduler.config.get("final_sigmas_type", "zero") == "sigma_min":
        scheduler.sigmas[-1] = scheduler.sigmas[-2]
    latents = pipeline.prepare_latents(prompt_embeds.shape[0], transformer.config.in_channels, height, width, 1, torch.float32, device, generator)
    padding_mask = latents.new_zeros(1, 1, height, width, dtype=dtype)

    def model_output(index, step, latents):
        sigma = scheduler.sigmas[index]
        t = sigma / (sigma + 1)
        timestep = t.expand(latents.shape[0]).to(dtype)
        model_input = (latents * (1 - t)).to(dtype)
        prediction = _denoised(transformer, model_input, timestep, prompt_embeds, padding_mask, latents, t, dtype)
        if guided:
            unconditional = _denoised(transformer, model_input, timestep, negative_prompt_embeds, padding_mask, latents, t, dtype)
            prediction = prediction + guidance_scale * (prediction - unconditional)
        return (latents - prediction) / sigma

    return denoise(scheduler, latents, timesteps, model_output)


def _denoised(transformer, model_input, timestep, embeds, padding_mask, latents, t, dtype) -> torch.Tensor:
    """The pipeline's denoised latents at one step: c_skip * latents + c_out * velocity, with c_skip = 1 - t and c_out = -t."""
    velocity = transformer(hidden_states=model_input, timestep=timestep, encoder_hidden_states=embeds, padding_mask=padding_mask, return_dict=False)[0]
    return ((1 - t) * latents - t * velocity.float()).to(dtype)


def traceable(config) -> bool:
    """Whether the planner can trace this transformer: its forward resizes a concatenated padding mask with torchvision."""
    return not (config.concat_padding_mask and importlib.util.find_spec("torchvision") is None)


class CosmosPrompts(PromptEncoding):
    def encode_prompts(self, pipeline, prompts, device):
        # 512 tokens, zeros after the prompt's own: the transformer attends to all of them (no text mask), as when sampling.
        embeds, _ = pipeline.encode_prompt(prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=PROMPT_TOKENS, device=device)
        return {"prompt_embeds": embeds}

    def tiny_tokenizer(self, tokenizer):
        return character_t5_tokenizer(self.record.tokenizer_length(tokenizer))


class CosmosCall(DenoiserCall):
    def inputs(self, model_input, timesteps, condition, context):
        height, width = model_input.shape[-2:]
        # The padding mask is at the pixel size, one for the batch, zeros for a whole image (as the pipeline passes it).
        padding_mask = model_input.new_zeros(1, 1, height * context.vae_factor, width * context.vae_factor, dtype=context.dtype)
        return {
            "hidden_states": model_input, "timestep": (timesteps / 1000).to(context.dtype), "encoder_hidden_states": condition["prompt_embeds"],
            "padding_mask": padding_mask,
        }

    def predict(self, model, model_input, timesteps, condition, context):
        # As the pipelines call it: its output as a tuple (the planner's trace takes the inputs alone).
        return self.output(model(**self.inputs(model_input, timesteps, condition, context), return_dict=False))

    def trace_batch(self, config, latent_side, latent_frames, text_tokens, dtype):
        if not traceable(config):
            return None  # not traced where torchvision is missing (a run is refused then)
        latents = torch.randn(1, config.in_channels, latent_frames, latent_side, latent_side, dtype=dtype)
        return latents, torch.tensor([500.0]), {"prompt_embeds": torch.randn(1, text_tokens, config.text_embed_dim, dtype=dtype)}


class CosmosSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {"prompt_embeds": condition["prompt_embeds"], "negative_prompt_embeds": negative["prompt_embeds"], "guidance_scale": guidance_scale}

    def draw(self, pipeline, kwargs):
        return draw_latents(pipeline, **kwargs)


class CosmosLayouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight`` / ``lora_B.weight`` / ``.alpha``: diffusion-pipe's and ComfyUI's Cosmos-Predict2 LoRA.

        Each name must convert back to the module it was trained on with diffusers' single-file
        converter of original Cosmos checkpoints (keys under ``net.``), or the export stops.
        """
        from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

        modules = sorted({key.partition(".lora_")[0] for key in layers})
        originals = {module: original_module_name(module) for module in modules}
        converted = convert_cosmos_transformer_checkpoint_to_diffusers({f"net.{original}.weight": torch.empty(0) for original in originals.values()})
        wrong = [module for module in modules if f"{module}.weight" not in converted]
        if wrong:
            raise ValueError(f"the original Cosmos names of {', '.join(wrong[:3])} do not convert back to them with diffusers' converter")
        return comfy_lora_layout(layers, alpha, rename=originals.__getitem__)


# The sampler diffusers' converter saves with Cosmos-Predict2: FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True). The
# pipeline's constructor registers the EDM range on it (sigma_max 80, sigma_min 0.002, sigma_data 1, the last step at sigma_min).
COSMOS_SCHEDULER = {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0, "use_karras_sigmas": True}

ARCHITECTURE = Architecture(
    record=Record(
        name="cosmos-predict2",
        pipeline_class="Cosmos2TextToImagePipeline",
        denoiser="transformer",
        denoiser_class="CosmosTransformer3DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=2,
        codec=CosmosLatents(vae_class="AutoencoderKLWan"),
        preset_name="tiny-cosmos-predict2",
        preset={
            "transformer": {
                "in_channels": 16, "out_channels": 16, "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2, "mlp_ratio": 2.0,
                "text_embed_dim": 64, "adaln_lora_dim": 8, "max_size": [4, 32, 32], "patch_size": [1, 2, 2], "rope_scale": [1.0, 4.0, 4.0],
                # The published checkpoints concatenate a (zero) padding-mask channel, which diffusers resizes with torchvision; the
                # tiny preset does not, so that the tests run without torchvision (CosmosLatents.problems refuses the other without it).
                "concat_padding_mask": False, "extra_pos_embed_type": None,
            },
            "vae": {
                "base_dim": 16, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1, "temperal_downsample": [False, True, True],
                "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16,
            },
            "text_encoder": tiny_t5(),
            "scheduler": COSMOS_SCHEDULER,
        },
        # The blocks' attention (self and cross) and MLP linears; diffusion-pipe adapts every linear layer of the blocks.
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"),
        # T5-11B's tokenizer's length, and what the pipeline pads every prompt to (and so the planner's traced prompt length).
        tokenizer_lengths={"tokenizer": PROMPT_TOKENS},
        pipeline_kwargs={"safety_checker": GuardrailNotLoaded()},  # not NVIDIA's guardrail: such a pipeline does not generate (above)
    ),
    call=CosmosCall(),
    prompts=CosmosPrompts(),
    sampling=CosmosSampling(),
    layouts=CosmosLayouts(),
)
