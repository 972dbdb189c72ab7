"""Flux Kontext: Flux.1's transformer trained on (control image, instruction, target image) triples.

As ``FluxKontextPipeline`` conditions it, the control image's latents (the distribution's
mode, shifted and scaled as the target's) are packed 2x2 and appended after the noisy
target's tokens; their position ids carry 1 in the first axis where the target's carry 0,
and only the target's tokens of the output are the prediction. The prompt is encoded as
Flux.1's (CLIP and T5, without the image), so the text cache stays per caption.

Training takes the control image at its target's bucket (``data.control_path``); samples go
through the pipeline's own call with ``_auto_resize=False`` (the pipeline would otherwise
move the control image to the nearest of Kontext's preferred resolutions, about a megapixel)
and ``max_area`` at the sample size.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from zeropipe.families.diffusion.bases.flux import ARCHITECTURE as FLUX
from zeropipe.families.diffusion.bases.flux import FluxCall, FluxSampling
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import ControlImage
from zeropipe.families.diffusion.sampler import pipeline_call


class FluxKontextCall(FluxCall):
    def predict(self, model, model_input, timesteps, condition, context):
        from diffusers import FluxKontextPipeline

        batch, channels, height, width = model_input.shape
        packed = FluxKontextPipeline._pack_latents(model_input, batch, channels, height, width)
        control = FluxKontextPipeline._pack_latents(condition["control_latents"].to(model_input.dtype), batch, channels, height, width)
        target_ids = FluxKontextPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, context.device, context.dtype)
        control_ids = target_ids.clone()
        control_ids[..., 0] = 1  # the pipeline's mark of the control image's tokens
        text_ids = torch.zeros(condition["prompt_embeds"].shape[1], 3, device=context.device, dtype=context.dtype)
        guidance = self.guidance_input(model, batch, context)
        out = model(
            hidden_states=torch.cat([packed, control], dim=1), timestep=(timesteps / 1000).to(context.dtype), guidance=guidance,
            pooled_projections=condition["pooled_prompt_embeds"], encoder_hidden_states=condition["prompt_embeds"],
            txt_ids=text_ids, img_ids=torch.cat([target_ids, control_ids], dim=0),
        ).sample
        return FluxKontextPipeline._unpack_latents(out[:, : packed.shape[1]], height * context.vae_factor, width * context.vae_factor, context.vae_factor)


class FluxKontextSampling(FluxSampling):
    def draw(self, pipeline, kwargs):
        size = kwargs["height"] * kwargs["width"]
        return pipeline_call(pipeline, {**kwargs, "max_area": size, "_auto_resize": False})[0]


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        FLUX.record,
        name="flux-kontext",
        pipeline_class="FluxKontextPipeline",
        related_pipelines=("FluxKontextInpaintPipeline",),
        preset_name="tiny-flux-kontext",
        preset=copy.deepcopy(FLUX.record.preset),
        conditions=(ControlImage(),),
    ),
    call=FluxKontextCall(),
    prompts=FLUX.prompts,
    sampling=FluxKontextSampling(),
)
