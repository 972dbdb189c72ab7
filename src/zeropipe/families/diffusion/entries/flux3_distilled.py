"""FLUX.3 [distilled] (``Flux3DistilledModularPipeline``, diffusers 0.42.1: modular only): the step-distilled FLUX.3, 16 steps, no guidance.

The same transformer class as FLUX.3 (``Flux3Transformer2DModel``) built with ``flow_map=True``: a flow map, whose call also
takes the timestep the step jumps to (``target_timestep``; ``Flux3DistilledLoopDenoiser`` passes the next scheduler
timestep, 0 after the last, and no guider runs). The call is ``bases/flux3.Flux3DistilledCall`` (held to
``Flux3DistilledLoopDenoiser`` in ``tests/unit/diffusion/test_flux3_distilled.py``); prompts, latents and LoRA targets are
the FLUX.3 entry's (``entries/flux3.py``), its text-encoder block ``Flux3DistilledTextEncoderStep`` (the same encoding,
no negative prompt).

Training keeps the step distillation with the flow-map objective (``parts/flow_map.py``): flow matching on the map's
diagonal plus the self-consistency of its jumps (one jump = two half jumps of the model itself). Not the
guidance-preserving objective (``parts/guidance.py``): that one reads the model's output as a velocity guided at a known
scale, and FLUX.3 [distilled] gives neither a guidance input nor a scale (the diffusers code has no guider for it), while
what a plain LoRA would train away, the jumps, is what its transformer's second time is for.

Samples are drawn as ``Flux3DistilledDenoiseStep`` draws: ``Flux3SetTimestepsStep``'s sigmas, one call per step with the
next timestep as the target, no classifier-free guidance (``generate.guidance_scale`` above 1 is reported once and not
applied: the pipeline has no guider). The LoRA exports in diffusers' layout only (no original FLUX.3 layout or converter
ships with diffusers 0.42.1, as for FLUX.3).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from zeropipe.families.diffusion.bases.flux3 import FLUX3, TARGET, TINY_PRESET, Flux3DistilledCall, Flux3Prompts, Flux3Sampling, trace_inputs
from zeropipe.families.diffusion.core import Architecture

SAMPLE_STEPS = 16  # Flux3DistilledCoreDenoiseStep's Flux3SetTimestepsStep(num_inference_steps=16)
logger = logging.getLogger(__name__)


class Flux3DistilledTrace(Flux3DistilledCall):
    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        return trace_inputs(config, latent_side, text_tokens, dtype)  # with target_timestep: the config is a flow map's


@functools.lru_cache(maxsize=None)
def unguided_once(scale: float) -> None:
    """Said once per process and scale, not at every sample (generate.guidance_scale defaults to 5.0)."""
    logger.warning("generate.guidance_scale %s is not applied: FLUX.3 [distilled] samples without classifier-free guidance (Flux3DistilledLoopDenoiser)", scale)


class Flux3DistilledSampling(Flux3Sampling):
    """``Flux3DistilledDenoiseStep``'s loop on the shared sampler: each step's call jumps to the next timestep (0 after the last)."""

    def draw(self, pipeline, kwargs):
        from zeropipe.families.diffusion.core import PredictContext
        from zeropipe.families.diffusion.sampler import denoise

        model = getattr(pipeline, self.record.denoiser)
        module = getattr(model, "module", model)
        condition = kwargs["condition"]
        if float(kwargs["guidance_scale"]) > 1:
            unguided_once(float(kwargs["guidance_scale"]))
        factor = pipeline.zeropipe_vae_factor
        device = next(module.parameters()).device
        context = PredictContext(device, next(module.parameters()).dtype, factor, float(kwargs["guidance"]))
        batch = next(iter(condition.values())).shape[0]
        shape = self.latent_shape(module.config, batch, kwargs["height"], kwargs["width"], factor)
        latents = torch.randn(shape, generator=kwargs["generator"]).to(device)
        steps = self.timesteps(pipeline.scheduler, int(kwargs["num_inference_steps"]), shape[-1] * shape[-2], device)

        def model_output(index, t, current):
            following = steps[index + 1] if index + 1 < len(steps) else torch.zeros_like(t)
            jump = {**condition, TARGET: following.expand(batch).to(device)}
            return self.entry.call.predict(model, current.to(context.dtype), t.expand(batch).to(device), jump, context).float()

        return denoise(pipeline.scheduler, latents, steps, model_output)


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        FLUX3,
        name="flux3-distilled",
        pipeline_class="Flux3DistilledModularPipeline",
        preset_name="tiny-flux3-distilled",
        preset={**TINY_PRESET, "transformer": {**TINY_PRESET["transformer"], "flow_map": True}},
    ),
    call=Flux3DistilledTrace(),
    prompts=Flux3Prompts(per_prompt=True, arguments={"max_sequence_length": 512}),
    sampling=Flux3DistilledSampling(),
)
