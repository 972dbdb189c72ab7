"""Cosmos-Predict2 Video2World (NVIDIA): the text-to-image entry's transformer class given a first frame to continue, at 16 fps.

``Cosmos2VideoToWorldPipeline`` encodes the given image (as a clip of that image repeated, whose
first latent frame is the image's own: the Wan 2.1 VAE is causal) and keeps that latent frame
clean at every step: the transformer sees it in place of the noisy one, told the conditioning
noise level ``t = 0.0001 / 1.0001`` for that frame (one timestep per latent frame), with a
condition-mask channel (its 17th input channel: 1 on the given frame, 0 elsewhere), the padding
mask and ``fps=16``; the denoised frame is replaced by the given one after every step. Training
does the same with the first frame's latents (``FirstFrameAlone``: the first frame encoded alone,
cached with the clip's), and the loss leaves that frame out (``loss_region``), as the pipeline never
denoises it. Everything else (the flow objective under the EDM-style sampler, T5-11B's 512 tokens,
the per-channel latents) is the text-to-image entry's (``bases/cosmos_predict2.py``: its record and roles).

NVIDIA's guardrail: as for text-to-image (``cosmos_predict2.py``'s docstring and docs/video.md).
The pipelines ZeRO-Pipe assembles hold ``GuardrailNotLoaded`` and cannot generate; samples during
training are drawn by :func:`draw_video_latents`, a loop over the pipeline's own parts (its
``prepare_latents``, which encodes the sample's first frame with the VAE, its scheduler and the
same per-frame arithmetic), without the guardrail; every pipeline a user loads keeps it.
diffusion-pipe trains only Cosmos-Predict2's text-to-image variants.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from zeropipe.families.diffusion.bases.cosmos_predict2 import ARCHITECTURE as TEXT_TO_IMAGE
from zeropipe.families.diffusion.bases.cosmos_predict2 import CosmosCall, CosmosSampling, traceable
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import FirstFrameAlone
from zeropipe.families.diffusion.parts.latents import CosmosVideoLatents
from zeropipe.families.diffusion.sampler import denoise

FPS = 16  # Cosmos2VideoToWorldPipeline's fps, which its transformer's rotary embedding is told
SIGMA_CONDITIONING = 0.0001  # the pipeline's sigma_conditioning: the given frame's noise level
T_CONDITIONING = SIGMA_CONDITIONING / (SIGMA_CONDITIONING + 1)


def given_frame(latents: torch.Tensor) -> torch.Tensor:
    """(1, 1, frames, 1, 1): 1 on the given (first) latent frame, 0 on the others, as the pipeline's ``cond_indicator``."""
    indicator = latents.new_zeros(1, 1, latents.shape[2], 1, 1)
    indicator[:, :, :1] = 1.0
    return indicator


@torch.no_grad()
def draw_video_latents(
    pipeline, image, prompt_embeds: torch.Tensor, negative_prompt_embeds: torch.Tensor | None, guidance_scale: float, height: int, width: int,
    num_frames: int, num_inference_steps: int, generator: torch.Generator | None, output_type: str = "latent", return_dict: bool = False,
) -> torch.Tensor:
    """Latents (batch, channels, frames, h, w) drawn as ``Cosmos2VideoToWorldPipeline.__call__`` draws them from ``image``, without its guardrail.

    Written by hand for the reason ``cosmos_predict2.draw_latents`` is; every step is the pipeline's
    own (its ``prepare_latents``, which encodes the image with the VAE, the same timesteps, per-frame
    conditioning and guidance), held equal to its ``__call__`` by ``tests/unit/diffusion/test_cosmos_predict2.py``.
    """
    from diffusers.pipelines.cosmos.pipeline_cosmos2_video2world import retrieve_timesteps

    if output_type != "latent" or return_dict:
        raise ValueError("draw_video_latents returns latents only (output_type='latent', return_dict=False): the caller decodes them")
    scheduler, transformer = pipeline.scheduler, pipeline.transformer
    device = pipeline._execution_device
    dtype = transformer.dtype
    guided = guidance_scale > 1.0
    sigmas = torch.linspace(0, 1, num_inference_steps, dtype=torch.float64)  # float64, as the pipeline has them off Apple MPS
    timesteps, _ = retrieve_timesteps(scheduler, device=device, sigmas=sigmas)
    if scheduler.config.final_sigmas_type == "sigma_min":
        scheduler.sigmas[-1] = scheduler.sigmas[-2]
    video = pipeline.video_processor.preprocess(image, height, width).unsqueeze(2).to(device=device, dtype=pipeline.vae.dtype)
    latents, given, indicator, _, mask, _ = pipeline.prepare_latents(
        video, prompt_embeds.shape[0], transformer.config.in_channels - 1, height, width, num_frames, guided, torch.float32, device, generator
    )
    mask = mask.to(dtype)
    padding_mask = latents.new_zeros(1, 1, height, width, dtype=dtype)
    t_given = torch.tensor(SIGMA_CONDITIONING, dtype=torch.float32, device=device)
    t_given = t_given / (t_given + 1)

    def model_output(index, step, latents):
        sigma = scheduler.sigmas[index]
        t = sigma / (sigma + 1)
        timestep = t.view(1, 1, 1, 1, 1).expand(latents.size(0), -1, latents.size(2), -1, -1)
        model_input = (indicator * given + (1 - indicator) * latents * (1 - t)).to(dtype)
        frame_timesteps = (indicator * t_given + (1 - indicator) * timestep).to(dtype)

        def denoised(embeds: torch.Tensor) -> torch.Tensor:
            velocity = transformer(
                hidden_states=model_input, timestep=frame_timesteps, encoder_hidden_states=embeds, fps=FPS, condition_mask=mask,
                padding_mask=padding_mask, return_dict=False,
            )[0]
            out = ((1 - t) * latents - t * velocity.float()).to(dtype)
            return indicator * given + (1 - indicator) * out

        prediction = denoised(prompt_embeds)
        if guided:
            prediction = prediction + guidance_scale * (prediction - denoised(negative_prompt_embeds))
        return (latents - prediction) / sigma

    return denoise(scheduler, latents, timesteps, model_output)


class CosmosVideo2WorldCall(CosmosCall):
    def inputs(self, model_input, timesteps, condition, context):
        batch, _, frames, height, width = model_input.shape
        indicator = given_frame(model_input)
        first = condition["first_frame_latents"].to(model_input.dtype)
        hidden = torch.cat([first, model_input[:, :, 1:]], dim=2)  # the given frame clean, the others as noised
        t = (timesteps / 1000).float().view(batch, 1, 1, 1, 1)
        frame_timesteps = indicator * T_CONDITIONING + (1 - indicator) * t.expand(batch, 1, frames, 1, 1)
        mask = (indicator * model_input.new_ones(batch, 1, frames, height, width)).to(context.dtype)
        padding_mask = model_input.new_zeros(1, 1, height * context.vae_factor, width * context.vae_factor, dtype=context.dtype)
        return {
            "hidden_states": hidden, "timestep": frame_timesteps.to(context.dtype), "encoder_hidden_states": condition["prompt_embeds"], "fps": FPS,
            "condition_mask": mask, "padding_mask": padding_mask,
        }

    def trace_batch(self, config, latent_side, latent_frames, text_tokens, dtype):
        if not traceable(config):
            return None  # not traced where torchvision is missing (a run is refused then)
        channels = config.in_channels - 1  # the latents; the condition mask is the last input channel
        latents = torch.randn(1, channels, latent_frames, latent_side, latent_side, dtype=dtype)
        condition = {
            "prompt_embeds": torch.randn(1, text_tokens, config.text_embed_dim, dtype=dtype),
            "first_frame_latents": torch.randn(1, channels, 1, latent_side, latent_side, dtype=dtype),
        }
        return latents, torch.tensor([500.0]), condition

    def loss_region(self, prediction, target):
        return prediction[:, :, 1:], target[:, :, 1:]  # the first latent frame is the given image, never denoised


class CosmosVideo2WorldSampling(CosmosSampling):
    def draw(self, pipeline, kwargs):
        return draw_video_latents(pipeline, **kwargs)


def tiny_preset() -> dict[str, Any]:
    preset = copy.deepcopy(TEXT_TO_IMAGE.record.preset)
    # 16 latent channels and the condition mask; the 2B's rotary scale (diffusers' converter: (1, 3, 3)).
    preset["transformer"].update({"in_channels": 17, "rope_scale": [1.0, 3.0, 3.0]})
    return preset


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        TEXT_TO_IMAGE.record,
        name="cosmos-predict2-video2world",
        trace_frames=93,  # Cosmos2VideoToWorldPipeline's default clip: about 6 s at 16 fps
        pipeline_class="Cosmos2VideoToWorldPipeline",
        codec=CosmosVideoLatents(vae_class="AutoencoderKLWan", frame_multiple=4, frame_rate=float(FPS)),
        conditions=(FirstFrameAlone(),),
        preset_name="tiny-cosmos-predict2-video2world",
        preset=tiny_preset(),
    ),
    call=CosmosVideo2WorldCall(),
    prompts=TEXT_TO_IMAGE.prompts,
    sampling=CosmosVideo2WorldSampling(),
    layouts=TEXT_TO_IMAGE.layouts,
)
