"""What a diffusion entry is: a declared record (``Record``) and the roles where its code differs (``roles.py``).

``Architecture`` is the entry core: the record, the five roles and the two classes it names. It has at most
15 members (``tests/unit/diffusion/test_architecture_contract.py`` counts them); everything an entry only
states (its pipeline and denoiser classes, its components, codec, prompt part, conditions, objective, LoRA
targets, tiny preset, prompt lengths, the pipeline's extra constructor arguments) is a field of its record.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zeropipe.families.diffusion.parts import Condition, ImageLatents, Part, PromptText
from zeropipe.families.diffusion.roles import (
    DEFAULT_ROLES,
    Assembly,
    DenoiserCall,
    ExportLayouts,
    PredictContext,
    PromptEncoding,
    Sampling,
)
from zeropipe.models.common import DIFFUSERS_LORA_TARGETS  # LoRA's default targets in diffusers models: the attention projections


@dataclass(frozen=True)
class Record:
    """What an entry declares, as data: read by the caches, buckets, training loop, samples, export, the planner and the converter.

    Attributes:
        name: the short name used in configs, caches and exports (``sdxl``).
        pipeline_class: the diffusers pipeline class that loads and samples it.
        denoiser: the trained component of the pipeline directory (``unet`` or ``transformer``).
        denoiser_class: its diffusers model class.
        objective: ``ddpm`` (noise/velocity prediction) or ``flow`` (rectified flow).
        text_encoders, tokenizers: the components whose outputs the text cache holds.
        related_pipelines: other pipeline class names saved with the same components (img2img...).
        pipeline_settings: (key, value) pairs the pipeline folder's ``model_index.json`` must hold for this entry to be
            its architecture, where entries share a pipeline class (Wan 2.2 TI2V-5B: ``expand_timesteps`` true).
        patch_factor: latent pixels per denoiser token along a side (buckets must be multiples of it).
        preset_name, preset: a tiny pipeline of this layout, built from config for tests and demos.
        lora_targets: module names LoRA adapts by default (suffixes, as peft matches a list), or one regular
            expression that peft matches against whole module names (where a suffix would also hit a layer outside the blocks).
        codec: the latent codec part: the VAE, the latents' layout and normalisation, what the data and samples are.
        text: the prompt part: the text cache's entries (``PromptText``; ``PromptWithControlImage``...).
        conditions: the other condition parts, each cached with an item's latents and given to the denoiser call in ``condition[...]``.
        trace_frames: the clip length (frames) the planner traces a video entry at when the model spec does not give one.
        tokenizer_lengths: each tokenizer's ``model_max_length`` in a tiny preset (77 where not named).
        trace_tokens: the prompt length the planner traces when the model spec does not give one (default: the first tokenizer's length).
        pipeline_kwargs: constructor arguments the pipeline needs besides its components (safety checkers off...).
        image_processor_patch: the pipeline's image processor rounds sizes to the VAE factor times this (2 where the denoiser patchifies 2x2).
    """

    name: str
    pipeline_class: str
    denoiser: str
    denoiser_class: str
    objective: str
    text_encoders: tuple[str, ...]
    tokenizers: tuple[str, ...]
    related_pipelines: tuple[str, ...] = ()
    pipeline_settings: tuple[tuple[str, Any], ...] = ()
    patch_factor: int = 1
    preset_name: str | None = None
    preset: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    lora_targets: tuple[str, ...] | str = DIFFUSERS_LORA_TARGETS
    codec: ImageLatents = field(default_factory=ImageLatents)
    text: PromptText = field(default_factory=PromptText)
    conditions: tuple[Condition, ...] = ()
    trace_frames: int = 1
    tokenizer_lengths: Mapping[str, int] = field(default_factory=dict, compare=False, hash=False)
    trace_tokens: int | None = None
    pipeline_kwargs: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    image_processor_patch: int = 1

    @property
    def parts(self) -> tuple[Part, ...]:
        """Every part of the entry: codec, prompt part, conditions."""
        return (self.codec, self.text, *self.conditions)

    @property
    def frozen_components(self) -> tuple[str, ...]:
        return ("vae", *self.text_encoders)

    # The codec's facts that readers outside the diffusion package (the planner, the config converter) ask the entry.
    @property
    def video(self) -> bool:
        return self.codec.video

    @property
    def frame_multiple(self) -> int:
        return self.codec.frame_multiple

    @property
    def vae_class(self) -> str:
        return self.codec.vae_class

    def tokenizer_length(self, tokenizer: str) -> int:
        """model_max_length of a tiny preset's tokenizer."""
        return self.tokenizer_lengths.get(tokenizer, 77)

    def trace_text_tokens(self) -> int:
        """The prompt length the planner traces when the model spec does not give one (a catalog entry's ``text_tokens``)."""
        return self.trace_tokens if self.trace_tokens is not None else self.tokenizer_length(self.tokenizers[0])

    def image_processor_factor(self, vae_factor: int) -> int:
        """The factor the pipeline's image processor rounds sizes to."""
        return vae_factor * self.image_processor_patch


ROLES = ("call", "prompts", "sampling", "layouts", "assembly")


@dataclass(frozen=True)
class Architecture:
    """One diffusion entry: its declared record and its roles (the code where the model differs).

    - ``call`` (``roles.DenoiserCall``): the denoiser's inputs for training and for the planner's trace, its call, the loss;
    - ``prompts`` (``roles.PromptEncoding``): prompts to conditioning tensors, tiny tokenizers, prompt processors;
    - ``sampling`` (``roles.Sampling``): the samples drawn during training, through the shared sampler (``sampler.py``);
    - ``layouts`` (``roles.ExportLayouts``): the LoRA / LoKr in the model's original (ComfyUI) key layout;
    - ``assembly`` (``roles.Assembly``): building the pipeline and a tiny preset's own components.

    Each role is given as an instance of its class (the default where the entry adds nothing); the entry
    binds a copy of it to itself, so a role's methods read ``self.record`` and reach the other roles
    through ``self.entry``.
    """

    record: Record
    call: DenoiserCall = None  # type: ignore[assignment]
    prompts: PromptEncoding = None  # type: ignore[assignment]
    sampling: Sampling = None  # type: ignore[assignment]
    layouts: ExportLayouts = None  # type: ignore[assignment]
    assembly: Assembly = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        for name in ROLES:
            role = getattr(self, name)
            role = copy.copy(role) if role is not None else DEFAULT_ROLES[name]()
            object.__setattr__(role, "entry", self)
            object.__setattr__(self, name, role)

    def pipeline(self):
        import diffusers

        return getattr(diffusers, self.record.pipeline_class)

    def model_class(self):
        import diffusers

        return getattr(diffusers, self.record.denoiser_class)


def original_layout_name(
    module: str, blocks: tuple[tuple[str, str, dict[str, tuple[str, int | None]]], ...], top_level: dict[str, str], model: str
) -> tuple[str, int | None]:
    """A diffusers module's name in an original (Black Forest Labs style) layout, and its part of a fused layer.

    ``blocks``: (diffusers prefix, original prefix, {name in the block: (original name, part)}) per kind of
    block; ``top_level``: names outside the blocks. transformer_blocks.0.attn.to_k -> (double_blocks.0.img_attn.qkv, 1).

    Raises:
        ValueError: the module has no name in that layout.
    """
    for prefix, original_prefix, names in blocks:
        if module.startswith(prefix):
            index, _, rest = module[len(prefix):].partition(".")
            if rest in names:
                original, part = names[rest]
                return f"{original_prefix}{index}.{original}", part
    if module in top_level:
        return top_level[module], None
    raise ValueError(f"{module} has no name in {model}'s original layout")


__all__ = ["Architecture", "PredictContext", "Record", "ROLES", "DDPM_SCHEDULE", "original_layout_name"]

DDPM_SCHEDULE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000, "steps_offset": 1}
