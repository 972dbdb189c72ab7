"""The first-frame condition: image-to-video (Wan I2V).

The VAE encodes the clip with every frame but the first set to zero (``conditioning_pixels``);
those latents (the distribution's mean, as the pipeline encodes them) are cached with the
clip's and reach ``predict`` as ``condition["first_frame_latents"]``, normalised as the clip's.
Samples are drawn from a dataset clip's first frame (the pipeline's ``image``, which it
encodes with the VAE on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zeropipe.data.images import first_frame_image
from zeropipe.families.diffusion.parts.base import Condition, Encoding, Inputs, SampleInputs, Sampling


@dataclass(frozen=True)
class FirstFrame(Condition):
    entry = "condition"
    key_suffix = "-first-frame"

    def problems(self, config, arch):
        buckets = sorted(set(config.data.video.frame_buckets))
        if buckets and buckets[0] == 1:
            return [("data.video.frame_buckets", f"a {arch.record.name} model is conditioned on the first frame, which is all a one-frame clip holds: remove 1 from {buckets}")]
        return []

    @staticmethod
    def conditioning_pixels(pixels: torch.Tensor) -> torch.Tensor:
        """What the VAE encodes as the condition: the first frame kept, the others black (0 in [-1, 1] is grey; Wan uses 0)."""
        condition = torch.zeros_like(pixels)
        condition[:, :, :1] = pixels[:, :, :1]
        return condition

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        return list(encoding.codec.encode(encoding.vae, self.conditioning_pixels(encoding.pixels))[0])

    def inputs(self, values: list[torch.Tensor], batch: Inputs) -> dict[str, torch.Tensor]:
        return {"first_frame_latents": batch.normalize(torch.stack(values).to(batch.device))}

    def sample_components(self, sampling: Sampling) -> dict[str, Any]:
        return {"vae": sampling.vae()}  # the pipeline encodes the first frame

    def sample_inputs(self, sampling: Sampling, kwargs: dict[str, Any]) -> SampleInputs:
        """The first frame of the data's first video clip (else its first image), centre-cropped to the sample size."""
        items = sampling.plan.items
        videos = [index for index, item in enumerate(items) if item.get("frames", 1) > 1]
        index = videos[0] if videos else 0
        pixels = sampling.load_pixels(index, sampling.bucket, crop="center", flip=False).pixels
        return SampleInputs(kwargs={"image": first_frame_image(pixels)}, rows=[{"first_frame": items[index]["path"]}] * len(sampling.prompts))


@dataclass(frozen=True)
class FirstFrameAlone(FirstFrame):
    """The first frame encoded alone (one latent frame), as pipelines that take the image's own latents encode it.

    Wan 2.2 TI2V-5B's ``WanImageToVideoPipeline`` with ``expand_timesteps`` and
    ``HunyuanVideo15ImageToVideoPipeline`` encode the image as a one-frame clip (the distribution's
    mode), not the clip with its other frames blacked out.
    """

    key_suffix = "-first-frame-alone"

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        return list(encoding.codec.encode(encoding.vae, encoding.pixels[:, :, :1])[0])


@dataclass(frozen=True)
class SeededFirstFrame(FirstFrameAlone):
    """The first frame encoded alone, its posterior sampled under a fixed seed and rounded to float16, as MiniMax-H3 encodes a
    keyframe (``encode_vae_condition``: ``posterior.sample`` under a fresh generator seeded ``keyframe_encode_seed``, 42, then
    ``.to(torch.float16)``): the same frame always gives the same anchor, ~11 bits of every latent, as the released model saw."""

    seed: int = 42
    key_suffix = "-first-frame-seeded"

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        means, stds = encoding.codec.encode(encoding.vae, encoding.pixels[:, :, :1])
        drawn = []
        for mean, std in zip(means, stds):  # one keyframe per fresh generator, as the pipeline encodes one keyframe a call
            noise = torch.randn((1, *mean.shape), generator=torch.Generator().manual_seed(self.seed))[0].to(mean)
            drawn.append((mean + std * noise).half().float())
        return drawn
