"""The old shape of a diffusion entry, kept so that entries not yet converted (and plug-ins written against it) still register.

An entry in the old shape subclasses ``LegacyEntry`` (formerly ``core.Architecture``) and overrides its methods;
``LegacyEntry.entry()`` gives today's ``core.Architecture``: the record read from its fields and constant methods,
its code behind roles that call its methods (``core.LegacyCall`` and the rest), so its behaviour is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeropipe.families.diffusion import roles
from zeropipe.families.diffusion.core import Architecture, PredictContext, Record
from zeropipe.families.diffusion.parts import Condition, ImageLatents, Part, PromptText
from zeropipe.families.diffusion.tiny.tokenizers import character_tokenizer
from zeropipe.models.common import DIFFUSERS_LORA_TARGETS


@dataclass(frozen=True)
class LegacyEntry:
    """An entry written in the old shape (one class of 46 members, constants written as methods): kept so that such an entry still registers.

    ``entry()`` turns it into today's shape (``core.Architecture``: a declared ``Record`` and roles that call
    these methods). docs/architecture.md says how to convert one ("Converting an entry in the old shape");
    the registry converts any ``LegacyEntry`` it is given. What follows is the old class's documentation.


    The core is the pipeline and its denoiser: how prompts are encoded (``encode_prompts``), how the
    denoiser is called (``predict``), the sampler's arguments. What the latents are, what the
    prompt's conditioning is cached as and what else the denoiser is conditioned on are parts
    (``zeropipe.families.diffusion.parts``), which the shared code loops over (``parts``).

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
        codec: the latent codec part: the VAE, the latents' layout and normalisation, what the data and samples are
            (``ImageLatents``, ``VideoLatents`` or an entry's own).
        text: the prompt part: the text cache's entries (``PromptText``; ``PromptWithControlImage`` where the text
            encoder sees the control image).
        conditions: the other condition parts, each cached with an item's latents and given to ``predict`` in
            ``condition[...]`` (``FirstFrame``, ``FirstFrameEmbeddings``, ``ControlImage``, a plug-in's own).
        trace_frames: the clip length (frames) the planner traces a ``video`` entry at when the model spec does not give one
            (the pipeline's default clip: Wan's 81 frames).
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

    def vae_factors(self, vae_config: dict[str, Any]) -> tuple[int, int]:
        """The codec's (spatial, temporal) VAE factors; ``Architecture.vae_factors(None, config)`` reads a config generically."""
        return (self.codec if self is not None else ImageLatents()).vae_factors(vae_config)

    # -------------------------------------------------------------- classes
    def pipeline(self):
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    def model_class(self):
        import diffusers

        return getattr(diffusers, self.denoiser_class)

    def pipeline_kwargs(self) -> dict[str, Any]:
        """Constructor arguments the pipeline needs besides its components (safety checkers off...)."""
        return {}

    def construct_pipeline(self, cls, kwargs: dict[str, Any], folder: Any):
        """The pipeline of these components (missing ones None: a text pipeline has no denoiser and no VAE); ``folder`` is its ``PipelineIndex``."""
        return cls(**kwargs)

    def tokenizer_length(self, tokenizer: str) -> int:
        """model_max_length of a tiny preset's tokenizer."""
        return 77

    def image_processor_factor(self, vae_factor: int) -> int:
        """The factor the pipeline's image processor rounds sizes to."""
        return vae_factor

    def tiny_tokenizer(self, tokenizer: str):
        """A tokenizer for a tiny preset, built without a download (single characters are enough for captions)."""
        return character_tokenizer(self.tokenizer_length(tokenizer))

    def tiny_component(self, name: str, fields: dict[str, Any]):
        """A tiny preset's component besides the scheduler, text encoders and VAE, from its preset fields: the denoiser (an image encoder, an entry's own)."""
        return self.model_class()(**fields)

    def tiny_denoiser(self, model) -> None:
        """Give a tiny preset's freshly built denoiser the weights it needs to learn (default: as its class initialises them).

        A class that zero-initialises its modulations (adaLN-zero: Kandinsky 5) builds blocks whose
        every output is gated by zero, through which a LoRA gets no gradient; a checkpoint's are trained.
        """

    def tiny_prompt_processor(self, processor: str, parts: dict[str, Any], folder: Path) -> None:
        """Write the files of a prompt processor (the prompt part's ``processors``) of a tiny preset into its folder, built without a download."""
        raise NotImplementedError(f"the {self.name} entry names prompt processors {self.text.processors} but cannot build a tiny one")

    def load_prompt_processor(self, pipeline_dir: Path, processor: str, parts: dict[str, Any]):
        """The prompt processor the text pipeline is given, from its folder and the other loaded parts (the tokenizers)."""
        raise NotImplementedError(f"the {self.name} entry names prompt processors {self.text.processors} but cannot load one")

    # -------------------------------------------------------------- planner
    def trace_inputs(self, config: Any, latent_side: int, latent_frames: int, text_tokens: int, dtype: torch.dtype) -> dict[str, Any] | None:
        """The denoiser's keyword arguments for one example (batch 1) of this size, made on the current (meta) device.

        The planner runs the denoiser on them to count the activations it saves; None: the planner does not trace it.
        ``latent_frames`` is 1 unless the entry is ``video``.
        """
        return None

    def trace_text_tokens(self) -> int:
        """The prompt length the planner traces when the model spec does not give one (a catalog entry's ``text_tokens``)."""
        return self.tokenizer_length(self.tokenizers[0])

    # -------------------------------------------------------------- export
    def original_lora_layout(self, layers: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor] | None:
        """The LoRA in the original (ComfyUI) key layout, from its diffusers layout; None when the architecture has none."""
        return None

    def original_lokr_layout(self, layers: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor] | None:
        """A LoKr adapter (peft's ``module.lokr_w1``, ``lokr_w2_a``...) in the original (ComfyUI) key layout; None when there is none.

        ``scaling`` is peft's alpha / r, which the layout folds into the first factor (LyCORIS applies no
        alpha to full factors, and a file without ``.alpha`` keys is read at scale 1 by ComfyUI and diffusers).
        """
        return None

    # -------------------------------------------------------------- conditioning
    def encode_prompts(self, pipeline, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """The conditioning tensors of a batch of prompts, from the pipeline's own encode_prompt."""
        raise NotImplementedError

    def predict(self, model, model_input: torch.Tensor, timesteps: torch.Tensor, condition: dict[str, torch.Tensor], context: PredictContext) -> torch.Tensor:
        """The denoiser's output for a batch of latents, called as the pipeline calls it."""
        raise NotImplementedError

    def loss_region(self, prediction: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts of the denoiser's prediction and of the target that the loss compares: all of them by default.

        An entry whose input holds given (not noised) latents leaves them out, as its trainers do
        (Wan 2.2 TI2V's image-to-video: the first latent frame is the image itself).
        """
        return prediction, target

    def loss(self, model, noised: Any, condition: dict[str, torch.Tensor], context: PredictContext) -> torch.Tensor:
        """The training loss of a noised micro-batch (``objectives.NoisedBatch``): the denoiser's error on its latents.

        An entry whose denoiser also denoises a target a condition carries (LTX-2's audio latents,
        noised at the same level) adds that term here.
        """
        from zeropipe.families.diffusion.objectives import weighted_mse

        prediction, target = self.loss_region(self.predict(model, noised.model_input, noised.timesteps, condition, context), noised.target)
        return weighted_mse(prediction, target, noised.weights)

    # -------------------------------------------------------------- sampling
    def sample_kwargs(self, condition: dict[str, torch.Tensor], negative: dict[str, torch.Tensor], guidance_scale: float, guidance: float) -> dict[str, Any]:
        """The pipeline call's conditioning and guidance arguments (classifier-free guidance by default)."""
        kwargs: dict[str, Any] = {"prompt_embeds": condition["prompt_embeds"], "guidance_scale": guidance_scale, "negative_prompt_embeds": negative["prompt_embeds"]}
        if "pooled_prompt_embeds" in condition:
            kwargs["pooled_prompt_embeds"] = condition["pooled_prompt_embeds"]
        if "pooled_prompt_embeds" in negative:
            kwargs["negative_pooled_prompt_embeds"] = negative["pooled_prompt_embeds"]
        return kwargs

    def call_pipeline(self, pipeline, kwargs: dict[str, Any]) -> torch.Tensor:
        """Latents of the samples the pipeline draws with these arguments (the conditions' included: a control image as ``image``)."""
        from zeropipe.families.diffusion.sampler import pipeline_call

        return pipeline_call(pipeline, kwargs)[0]

    def sample_outputs(self, pipeline, kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The samples' latents and what else the pipeline drew, by name (LTX-2's audio latents), which the parts' ``add_to_samples`` read."""
        return self.call_pipeline(pipeline, kwargs), {}

    def unpack_latents(self, pipeline, latents: torch.Tensor, size: int, vae_factor: int) -> torch.Tensor:
        """Latents as the VAE decodes them, from what the pipeline returned with output_type="latent"."""
        return latents

    # -------------------------------------------------------------- today's shape
    def entry(self):
        """This entry in today's shape: its record (constants read once from the methods that return them) and roles that call its methods."""
        record = Record(
            **{name: getattr(self, name) for name in LEGACY_RECORD_FIELDS},
            tokenizer_lengths={name: self.tokenizer_length(name) for name in self.tokenizers},
            trace_tokens=self.trace_text_tokens(),
            pipeline_kwargs=self.pipeline_kwargs(),
            image_processor_patch=self.image_processor_factor(8) // 8,
        )
        return Architecture(
            record=record, call=roles.LegacyCall(self), prompts=roles.LegacyPrompts(self), sampling=roles.LegacySampling(self),
            layouts=roles.LegacyLayouts(self), assembly=roles.LegacyAssembly(self),
        )


LEGACY_RECORD_FIELDS = (
    "name", "pipeline_class", "denoiser", "denoiser_class", "objective", "text_encoders", "tokenizers", "related_pipelines",
    "pipeline_settings", "patch_factor", "preset_name", "preset", "lora_targets", "codec", "text", "conditions", "trace_frames",
)
