"""The one sampler: samples drawn during training and the UI's Draw go through here.

Two ways to draw, and no third:

- ``pipeline_call``: the pipeline's own ``__call__``. Used where the pipeline takes what the caller has: the UI's
  Draw (a prompt string; the pipeline encodes it) and, during training, every entry whose pipeline takes the
  cached prompt embeddings and conditions as arguments (``roles.Sampling.draw``'s default; docs/architecture.md
  names them).
- ``denoise``: the shared denoising loop, driven by the entry's step output (its denoiser call with the
  pipeline's guidance): for the entries whose pipeline's ``__call__`` cannot draw training's samples
  (Qwen-Image-Edit and -Edit-Plus: the call resizes the control images to a megapixel; Cosmos-Predict2 and its
  Video2World: the call needs NVIDIA's guardrail; Ideogram 4: the call takes no precomputed prompt features).
  Each prepares its latents and timesteps with the pipeline's own methods and says what the scheduler steps on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def pipeline_call(pipeline, kwargs: dict[str, Any]):
    """The pipeline's own ``__call__`` with these arguments: its output as the pipeline returns it.

    Raises:
        TypeError: the pipeline is a modular one, whose run takes a state and returns one: its entry draws through
            ``denoise`` / ``denoise_streams`` (docs/architecture.md, "The door for modular pipelines").
    """
    from diffusers.modular_pipelines import ModularPipeline

    if isinstance(pipeline, ModularPipeline):
        raise TypeError(f"{type(pipeline).__name__} is a modular pipeline: its entry's sampling draws through sampler.denoise, not the pipeline's call")
    return pipeline(**kwargs)


@torch.no_grad()
def denoise(scheduler, latents: torch.Tensor, timesteps: Iterable, model_output: Callable[[int, Any, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The shared denoising loop: at each timestep, what the entry's step gives the scheduler (``model_output(index, t, latents)``:
    its denoiser call with guidance) and the scheduler's ``step``, as every diffusers pipeline's loop does. Returns the final latents."""
    for index, t in enumerate(timesteps):
        latents = scheduler.step(model_output(index, t, latents), t, latents, return_dict=False)[0]
    return latents


@torch.no_grad()
def denoise_streams(schedulers: tuple, latents: tuple[torch.Tensor, ...], timesteps: Iterable, model_output: Callable[[int, Any, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The shared loop for a model that denoises several streams in one call (MiniMax-H3: video and audio rows), each on its own
    scheduler: at each step (``timesteps``: one timestep per stream) the entry's call gives every stream's output, and each
    stream's scheduler steps it. Returns the final latents of every stream."""
    latents = tuple(latents)
    for index, step in enumerate(timesteps):
        outputs = model_output(index, step, latents)
        latents = tuple(scheduler.step(output, t, stream, return_dict=False)[0] for scheduler, output, t, stream in zip(schedulers, outputs, step, latents, strict=True))
    return latents
