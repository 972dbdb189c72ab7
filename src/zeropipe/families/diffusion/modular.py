"""The door for diffusers' modular pipelines (``ModularPipeline``: blocks and components, no ``DiffusionPipeline`` half).

diffusers 0.42.1 ships MiniMax-H3, FLUX.3 (+ distilled) and LTX-2.5 only this way. An entry whose record names a
modular pipeline class goes through the same three places as any other, each of which knows the modular layout:

- the folder reader (``config/pipeline_index.py``) reads ``modular_model_index.json`` (each component
  ``[library, class, loading spec]``, the spec's ``subfolder`` saying where its files are);
- a tiny preset is written by the modular pipeline's own ``update_components`` + ``save_pretrained``
  (``pipelines.build_tiny_pipeline``), which ``ModularPipeline.from_pretrained`` loads back;
- the pipeline an entry is handed (``pipelines._assemble``) is the modular pipeline of the folder with the loaded
  components put in by ``update_components``; samples go through the shared sampler (``sampler.denoise``) driven
  by the entry's denoiser call, never through the pipeline's ``__call__``.

``run_block`` and ``run_loop_block`` call one of the pipeline's blocks on given inputs, as the pipeline's own run
calls it: the text-encoder block fills the text cache where an entry's prompts are the block's output, and the
denoiser block (a loop sub-block) is the reference a unit test holds the entry's denoiser call to.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


@torch.no_grad()
def run_block(pipeline, block, outputs: Iterable[str], groups: dict[str, dict[str, Any]] | None = None, **inputs: Any) -> dict[str, Any]:
    """Run one block of a modular pipeline (its text-encoder step...) on these inputs; its ``outputs`` by name.

    The block reads the pipeline's components (``update_components`` put them there) and the inputs from a fresh
    ``PipelineState``; an input not given takes the block's declared default, as in the pipeline's own run.
    ``groups``: inputs a block reads as one keyword group (``{"denoiser_input_fields": {"token_tags": ...}}``), as the
    blocks that made them put them in the state.
    """
    from diffusers.modular_pipelines.modular_pipeline import PipelineState

    state = PipelineState()
    for name, value in inputs.items():
        state.set(name, value)
    for group, values in (groups or {}).items():
        for name, value in values.items():
            state.set(name, value, kwargs_type=group)
    _, state = block(pipeline, state)
    return {name: state.get(name) for name in outputs}


@torch.no_grad()
def run_loop_block(pipeline, blocks, step: int, timestep: torch.Tensor, **values: Any):
    """Run sub-blocks of a denoising loop (its before-denoiser and denoiser steps...) once, at one step and timestep.

    A loop's sub-blocks share a ``BlockState`` (the values the loop's wrapper gathered): given here as ``values``.
    Returns that state after the blocks ran (the denoiser block sets ``noise_pred``...).
    """
    from diffusers.modular_pipelines.modular_pipeline import BlockState

    state = BlockState(**values)
    for block in blocks if isinstance(blocks, (list, tuple)) else [blocks]:
        pipeline, state = block(pipeline, state, i=step, t=timestep)
    return state





from dataclasses import dataclass, field  # noqa: E402

from zeropipe.families.diffusion.roles import PromptEncoding, Sampling  # noqa: E402


@dataclass(eq=False)
class TextEncoderBlock(PromptEncoding):
    """Prompt encoding that is a modular pipeline's own text-encoder block, declared: the block's name among the pipeline's
    sub-blocks, its outputs and the name the text cache keeps each under, its inputs besides the prompts.

    ``per_prompt``: the block takes one prompt string per call (MiniMax-H3's, FLUX.3's): it is run once per prompt and
    each output's rows (1, L, D), of each prompt's own length, are padded into one batch with a mask
    (``<name>_mask``, 1 on a prompt's own rows) that the entry's call cuts them back with. ``cached`` turns the
    outputs into the cache's tensors (default: as they are); an entry whose block returns one tensor per prompt of its
    own length (Z-Image's list of captions) pads them with a mask there.
    """

    block: str = "text_encoder"
    returns: dict[str, str] = field(default_factory=lambda: {"prompt_embeds": "prompt_embeds"})
    arguments: dict[str, Any] = field(default_factory=dict)
    per_prompt: bool = False

    def encode_prompts(self, pipeline, prompts, device):
        block = pipeline.blocks.sub_blocks[self.block]
        if not self.per_prompt:
            out = run_block(pipeline, block, self.returns, prompt=list(prompts), **self.arguments)
            return self.cached({self.returns[name]: value for name, value in out.items()})
        runs = [run_block(pipeline, block, self.returns, prompt=prompt, **self.arguments) for prompt in prompts]
        out: dict[str, torch.Tensor] = {}
        for name, kept in self.returns.items():
            rows = [run[name][0] for run in runs]
            length = max(row.shape[0] for row in rows)
            out[kept] = torch.stack([torch.nn.functional.pad(row, [0, 0] * (row.dim() - 1) + [0, length - row.shape[0]]) for row in rows])
            out[f"{kept}_mask"] = torch.stack([torch.arange(length, device=row.device) < row.shape[0] for row in rows]).long()
        return self.cached(out)

    def cached(self, out: dict[str, Any]) -> dict[str, torch.Tensor]:
        return out


class DenoiserSampling(Sampling):
    """Image samples of a modular pipeline's entry through the shared sampler (``sampler.denoise``): noise at the sample's
    latent size, the scheduler's timesteps for the steps asked, and at each step the entry's denoiser call with
    classifier-free guidance against the empty prompt (``generate.guidance_scale``; one call per step at 1 or below).

    The pipeline is ``pipelines._assemble``'s (``zeropipe_vae_factor``: the folder's VAE factor, which a modular
    pipeline without its VAE would not know). ``timesteps`` sets the scheduler's timesteps (an entry whose scheduler
    shifts by the token count passes its ``mu`` there).
    """

    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {"condition": condition, "negative": negative, "guidance_scale": guidance_scale, "guidance": guidance}

    def timesteps(self, scheduler, steps: int, tokens: int, device: torch.device):
        scheduler.set_timesteps(steps, device=device)
        return scheduler.timesteps

    def latent_shape(self, config, batch: int, height: int, width: int, factor: int) -> tuple[int, ...]:
        """The latents' shape for samples of this size (default: the denoiser's input channels at 1/factor of the pixels)."""
        return (batch, config.in_channels, height // factor, width // factor)

    def draw(self, pipeline, kwargs):
        from zeropipe.families.diffusion.core import PredictContext
        from zeropipe.families.diffusion.sampler import denoise

        model = getattr(pipeline, self.record.denoiser)
        module = getattr(model, "module", model)
        condition, negative = kwargs["condition"], kwargs["negative"]
        factor = pipeline.zeropipe_vae_factor
        device = next(module.parameters()).device
        context = PredictContext(device, next(module.parameters()).dtype, factor, float(kwargs["guidance"]))
        batch = next(iter(condition.values())).shape[0]
        shape = self.latent_shape(module.config, batch, kwargs["height"], kwargs["width"], factor)
        latents = torch.randn(shape, generator=kwargs["generator"]).to(device)
        scale = float(kwargs["guidance_scale"])
        scheduler = pipeline.scheduler
        steps = self.timesteps(scheduler, int(kwargs["num_inference_steps"]), shape[-1] * shape[-2], device)

        def model_output(index, t, current):
            times = t.expand(batch).to(device)
            velocity = self.entry.call.predict(model, current.to(context.dtype), times, condition, context).float()
            if scale > 1:
                unconditional = self.entry.call.predict(model, current.to(context.dtype), times, negative, context).float()
                velocity = unconditional + scale * (velocity - unconditional)
            return velocity

        return denoise(scheduler, latents, steps, model_output)


__all__ = ["DenoiserSampling", "TextEncoderBlock", "run_block", "run_loop_block"]
