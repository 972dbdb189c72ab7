"""Kandinsky 5.0 Video image-to-video (``Kandinsky5I2VPipeline``): the first latent frame is the image's latents, the mask says so.

The transformer is the text-to-video one (``kandinsky5_t2v.py``), its 33 input channels used as
``Kandinsky5I2VPipeline`` uses them: the image, encoded alone as a one-frame clip and scaled by
the VAE's ``scaling_factor``, replaces the first latent frame of the noisy clip; the visual
condition channels stay zero and the mask channel is 1 on that first frame. The pipeline tells
every frame the same timestep and steps only frames 1.., so training does the same: the clean
first frame replaces the noisy one and the loss leaves it out (``loss_region``).

Samples take a data clip's first frame as the pipeline's ``image``; the pipeline encodes it
itself (a draw from the VAE's distribution, where the cache keeps its mode) and, before
returning latents, renormalises its first four latent frames against the next ones
(``normalize_first_frame``), as it does for its own videos.
"""

from __future__ import annotations

import dataclasses

import torch

from zeropipe.families.diffusion.bases.kandinsky5_t2v import ARCHITECTURE as T2V
from zeropipe.families.diffusion.bases.kandinsky5_t2v import Kandinsky5T2VCall, channels_last, tiny_preset
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import FirstFrameAlone


class Kandinsky5I2VCall(Kandinsky5T2VCall):
    def visual_condition(self, latents, condition):
        given = channels_last(condition["first_frame_latents"][:, :, :1]).to(latents.dtype)
        latents = torch.cat([given, latents[:, 1:]], dim=1)
        mask = torch.zeros_like(latents[..., :1])
        mask[:, 0] = 1
        return torch.cat([latents, torch.zeros_like(latents), mask], dim=-1)

    def loss_region(self, prediction, target):
        return prediction[:, :, 1:], target[:, :, 1:]  # the first latent frame is the given image, not denoised


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        T2V.record,
        name="kandinsky5-i2v",
        pipeline_class="Kandinsky5I2VPipeline",
        conditions=(FirstFrameAlone(),),
        preset_name="tiny-kandinsky5-i2v",
        preset=tiny_preset(),
    ),
    call=Kandinsky5I2VCall(),
    prompts=T2V.prompts,
    sampling=T2V.sampling,
    layouts=T2V.layouts,
    assembly=T2V.assembly,
)
