"""A diffusion architecture with a new *kind* of condition, added from outside the package through the registry alone.

The condition is a stand-in for audio: each image ``NAME.png`` of the data has a sidecar
``NAME.loudness`` holding a number (how loud the scene is). Everything ZeRO-Pipe needs to plan,
cache, train on, sample with and export it is in this module, which registers when imported
(``ZEROPIPE_PLUGINS=toy_condition``) in the launcher, the node's setup process and every rank:

- :class:`Loudness` is the new condition part: its cache key holds the sidecar's identity, the
  node's setup encodes the number into a feature vector cached with the image's latents, a
  micro-batch gives the vectors to ``predict`` as ``condition["loudness_embeds"]``, and samples
  are drawn at the loudness of the data's first image;
- :class:`LoudUNet` is SD 1.x's entry whose denoiser call adds those features to every text token,
  so the UNet's cross-attention sees them.

No shared module knows about either (tests/unit/diffusion/test_condition_door.py,
tests/integration/test_condition_door.py).
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from zeropipe.families.diffusion.bases.unet import UNetCall
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.entries import register
from zeropipe.families.diffusion.entries.sd15 import ARCHITECTURE as SD15
from zeropipe.families.diffusion.parts import Condition, SampleInputs
from zeropipe.errors import DataError

SIDECAR = ".loudness"


def sidecar(image: str | Path) -> Path:
    return Path(image).with_suffix(SIDECAR)


def read_loudness(image: str | Path) -> float:
    try:
        return float(sidecar(image).read_text().strip())
    except (OSError, ValueError) as err:
        raise DataError(f"{sidecar(image)}: no loudness ({err}): write a number beside each image") from None


def loudness_features(values: torch.Tensor, width: int) -> torch.Tensor:
    """(N,) numbers -> (N, width) sinusoidal features, as timesteps are embedded (no weights: the setup process computes them)."""
    half = width // 2
    frequencies = torch.exp(-math.log(100.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = 10.0 * values.float()[:, None] * frequencies[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


@dataclass(frozen=True)
class Loudness(Condition):
    """Attributes: width: the features' size, the text encoder's width (they are added to its tokens)."""

    width: int = 32

    entry = "loudness"
    key_suffix = "-loudness"

    def key_files(self, item):
        return (("loudness", sidecar(item["path"])),)  # a new sidecar re-encodes the item

    def load(self, plan, index, bucket, flip):
        return read_loudness(plan.items[index]["path"])

    def encode(self, encoding):
        return list(loudness_features(torch.tensor(encoding.loaded), self.width))

    def inputs(self, values, batch):
        return {"loudness_embeds": torch.stack(values).to(batch.device, batch.dtype)}

    def sample_inputs(self, sampling, kwargs):
        first = sampling.plan.items[0]["path"]
        level = read_loudness(first)
        features = loudness_features(torch.tensor([level]), self.width).to(kwargs["prompt_embeds"])
        # The pipeline takes no loudness: its prompt embeddings carry it, as training's predict adds it.
        return SampleInputs(kwargs={"prompt_embeds": kwargs["prompt_embeds"] + features[:, None]}, rows=[{"loudness": level}] * len(sampling.prompts))


class LoudUNetCall(UNetCall):
    def predict(self, model, model_input, timesteps, condition, context):
        heard = {**condition, "prompt_embeds": condition["prompt_embeds"] + condition["loudness_embeds"][:, None].to(condition["prompt_embeds"])}
        return super().predict(model, model_input, timesteps, heard, context)


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        SD15.record, name="toy-loud-unet", preset_name="tiny-toy-loud-unet", conditions=(Loudness(width=SD15.record.preset["text_encoder"]["hidden_size"]),)
    ),
    call=LoudUNetCall(),
    prompts=SD15.prompts,
)

register(ARCHITECTURE)
