"""What a part of a diffusion architecture is, and what the shared code hands each part.

An architecture entry is a small core (its pipeline class, its denoiser and how it is called)
plus parts: one latent codec (``codec.py``), one prompt part (``text.py``,
``control_prompt.py``) and any number of conditions (``first_frame.py``,
``first_frame_embeddings.py``, ``control_image.py``, or a plug-in's own). The shared code —
the launcher's data step, the node's cache filling, a rank's batches and samples — loops over
the parts an entry declares and calls the hooks below; it never asks which kinds they are.
A new kind of condition is one subclass of :class:`Condition` in its own module.

The objects given to the hooks (:class:`Planning`, :class:`Encoding`, :class:`Inputs`,
:class:`Sampling`) are made by the shared code; a part reads them and needs to import none of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch


@dataclass
class Planning:
    """The launcher's data step, as a part sees it (``zeropipe.families.diffusion.prepare``).

    ``items`` are the plan's items (dicts: path, caption, width, height, ...); a part may add its
    own fields to them (the control image's path). ``notes`` are shown to the user.
    """

    config: Any  # RunConfig
    arch: Any  # Architecture
    folder: Any  # PipelineFolder
    image_dir: Path
    cache_dir: Path
    items: list[dict[str, Any]]
    buckets: list[tuple[int, ...]]
    prompts: list[str]
    fingerprints: Path  # where component fingerprints are remembered
    notes: list[str] = field(default_factory=list)


@dataclass
class Encoding:
    """One chunk of items of the same bucket and flip being encoded into the latent cache (or for a batch, caches off).

    ``pixels`` are what the VAE encoded (after the codec's ``vae_pixels``); ``loaded`` holds, per
    item, what the condition's ``load`` returned; ``encoder`` what its ``encoder`` returned.
    """

    vae: Any
    pixels: torch.Tensor
    loaded: list[Any]
    encoder: Any
    codec: Any
    device: torch.device


@dataclass
class Inputs:
    """A rank's micro-batch, as a condition turns its cached values into the denoiser's inputs."""

    device: torch.device
    dtype: torch.dtype
    normalize: Callable[[torch.Tensor], torch.Tensor]  # VAE latents (on the device) -> the denoiser's normalised layout, in its dtype


@dataclass
class SampleInputs:
    """What a part adds to the pipeline call that draws samples.

    ``kwargs`` go into every call; ``per_prompt`` (one dict per prompt), where given, makes the
    sampler call the pipeline once per prompt with them added; ``rows`` (one dict per prompt) go
    into the samples' index rows (which file a sample was drawn from).
    """

    kwargs: dict[str, Any] = field(default_factory=dict)
    per_prompt: list[dict[str, Any]] | None = None
    rows: list[dict[str, Any]] | None = None


@dataclass
class Sampling:
    """A rank drawing samples, as a part sees it (``zeropipe.families.diffusion.task``)."""

    prompts: list[str]
    size: int
    bucket: tuple[int, ...]  # the sample size as an item's bucket (with one frame for video models)
    plan: Any  # DiffusionPlan
    folder: Any  # PipelineFolder
    device: torch.device
    load_pixels: Callable[..., Any]  # (item index, bucket, crop=, flip=) -> PreparedImage
    vae: Callable[[], Any]  # the rank's VAE, loaded on first use


class Part:
    """Hooks every part may fill; the defaults do nothing."""

    def problems(self, config: Any, arch: Any) -> list[tuple[str, str]]:
        """Settings this part cannot work with, each (key, what is wrong and the fix); checked before anything runs."""
        return []

    def config_keys(self) -> tuple[str, ...]:
        """The config keys this part reads, which a run of an entry without it must not set (``data.control_path``)."""
        return ()

    def sample_components(self, sampling: Sampling) -> dict[str, Any]:
        """Frozen pipeline components the pipeline needs while it draws samples (the VAE, an image encoder)."""
        return {}

    def add_to_samples(self, sampling: Sampling, outputs: dict[str, torch.Tensor], written: list[dict[str, Any]], folder: Path) -> None:
        """On rank 0, after the codec wrote the samples (``written``: their index rows): add what this part makes of the
        pipeline's other outputs (``Sampling.sample_outputs``), such as an audio track muxed into each video."""


class Condition(Part):
    """One input the denoiser sees besides the noisy latents and the prompt, cached with each item's latents.

    Attributes:
        entry: the field of an item's latent cache entry that holds it.
        key_suffix: what it adds to the name of the cache key's crop (a cache of an entry without
            this condition never matches).
    """

    entry: str = ""
    key_suffix: str = ""

    def active(self, folder: Any) -> bool:
        """Whether this pipeline folder has what the condition needs (Wan 2.2 I2V has no image encoder); inactive, it is skipped everywhere."""
        return True

    def wanted(self, config: Any) -> bool:
        """Whether the run's settings ask for this condition (FLUX.2's reference images: only where data.control_path(s) is set); unwanted, it is skipped everywhere."""
        return True

    # ------------------------------------------------------------------ the launcher
    def attach(self, planning: Planning) -> None:
        """Add what the condition needs to each item (its control image's path), or refuse the data."""

    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        """DiffusionPlan fields this condition fills (the items the sample prompts edit)."""
        return {}

    def key_files(self, item: dict[str, Any]) -> tuple[tuple[str, Path], ...]:
        """(label, file) pairs besides the image whose identity is part of the item's cache key."""
        return ()

    def fingerprints(self, planning: Planning) -> tuple[str, ...]:
        """Fingerprints of the encoders it uses, part of every cache key (a changed image encoder re-encodes)."""
        return ()

    # ------------------------------------------------------------------ the node's cache filling
    def encoder(self, folder: Any, dtype: torch.dtype, device: torch.device) -> Any:
        """What ``encode`` needs besides the VAE, loaded once per setup (an image encoder's pipeline); None by default."""
        return None

    def load(self, plan: Any, index: int, bucket: tuple[int, ...], flip: bool) -> Any:
        """What one item gives the condition besides its pixels (its control image's pixels), read with the item.

        Raises:
            DataError: it cannot be read; the item is skipped.
        """
        return None

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        """Per item of the chunk, the tensor its cache entry holds under ``entry`` (every condition defines it)."""
        raise NotImplementedError(f"{type(self).__name__} is a condition without encode(): it must say what its cache entry holds")

    # ------------------------------------------------------------------ a rank
    def inputs(self, values: list[torch.Tensor], batch: Inputs) -> dict[str, torch.Tensor]:
        """The ``condition[...]`` entries ``predict`` receives for a micro-batch, from each item's cached value (every condition defines it)."""
        raise NotImplementedError(f"{type(self).__name__} is a condition without inputs(): it must say what the denoiser receives")

    def sample_inputs(self, sampling: Sampling, kwargs: dict[str, Any]) -> SampleInputs:
        """What this condition adds to the sampling pipeline's call (``kwargs``: the call so far)."""
        return SampleInputs()
