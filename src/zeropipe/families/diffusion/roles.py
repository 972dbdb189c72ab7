"""The roles of a diffusion entry: the code where a model differs, behind small interfaces (``core.Architecture`` holds one of each).

Each role is bound to its entry (``self.entry``; its record is ``self.record``). An entry subclasses a role
only where its model differs from the default:

- ``DenoiserCall``: ``inputs`` builds the denoiser's keyword arguments from a batch of latents, timesteps and
  conditions; ``predict`` calls the denoiser on them and reads its output as the objective's target; ``loss``
  and ``loss_region`` make the training loss; ``trace_inputs`` gives the planner's activation trace its inputs
  (``None``: not traced); ``checkpoint_problems`` refuses a checkpoint of the entry's pipeline class it cannot train.
  Context parallelism wraps the call here (one place for training, samples and the trace).
- ``PromptEncoding``: ``encode_prompts`` (the pipeline's own ``encode_prompt``), the tiny preset's tokenizers and the
  prompt processors the text pipeline needs besides its tokenizers.
- ``Sampling``: the samples drawn during training: ``sample_kwargs`` (conditioning and guidance), ``draw`` (the
  latents: the pipeline's own ``__call__`` by default, or the shared loop of ``sampler.py`` driven by the entry's
  steps), ``sample_outputs`` and ``unpack_latents``.
- ``ExportLayouts``: the LoRA / LoKr in the model's original (ComfyUI) key layout.
- ``Assembly``: building the pipeline from its components, a tiny preset's own components and their initial weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeropipe.families.diffusion.tiny.tokenizers import character_tokenizer



@dataclass(frozen=True)
class PredictContext:
    """What a denoiser call needs besides its inputs: the rank's device and dtype, and the run's settings."""

    device: torch.device
    dtype: torch.dtype
    vae_factor: int  # pixels per latent along each side
    guidance: float  # model.diffusion.guidance, for guidance-distilled models


class Role:
    """A role of one entry: ``entry`` is set when the entry is built (``core.Architecture`` binds a copy of the role to itself)."""

    entry: Any  # the core.Architecture (roles import nothing from core: core imports them)

    @property
    def record(self) -> Any:
        return self.entry.record


class DenoiserCall(Role):
    """How the denoiser is called, for training, samples drawn by the shared loop and the planner's trace.

    ``inputs`` is the one builder of the denoiser's keyword arguments: ``predict`` calls the denoiser on them
    and reads its output (``output``); ``trace_inputs`` gives them for a batch the entry makes at the traced
    size (``trace_batch``). An entry overrides ``inputs``, ``output`` and ``trace_batch``; one whose call
    is more than a call on built inputs overrides ``predict`` (and ``trace_inputs``) instead.
    """

    # What ``loss`` asks of the denoiser per example of a micro-batch, for the planner (``plan_specs``): the examples its call with
    # gradient takes (the activations it saves), and those it takes in calls without gradient (compute only). The default loss:
    # one call on the micro-batch. An objective that calls it otherwise states its own (``parts/flow_map.py``).
    gradient_batch: int = 1
    gradient_free_batch: int = 0

    def inputs(self, model_input: torch.Tensor, timesteps: torch.Tensor, condition: dict[str, torch.Tensor], context: PredictContext) -> dict[str, Any]:
        """The denoiser's keyword arguments for a batch of latents, timesteps and conditions (in the planner's trace, on the meta device)."""
        raise NotImplementedError(f"the {self.record.name} entry does not say how its denoiser is called")

    def output(self, out: Any) -> torch.Tensor:
        """The prediction in the denoiser's output, in the objective's layout (default: the first output)."""
        return out[0]

    def predict(self, model, model_input: torch.Tensor, timesteps: torch.Tensor, condition: dict[str, torch.Tensor], context: PredictContext) -> torch.Tensor:
        """The denoiser's output for a batch of latents, called as the pipeline calls it."""
        return self.output(model(**self.inputs(model_input, timesteps, condition, context)))

    def trace_batch(self, config: Any, latent_side: int, latent_frames: int, text_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]] | None:
        """(latents, timesteps, condition) of one example of this size for the planner's trace, from the denoiser's config; None: not traced."""
        return None

    def trace_inputs(self, config: Any, latent_side: int, latent_frames: int, text_tokens: int, dtype: torch.dtype) -> dict[str, Any] | None:
        """The denoiser's keyword arguments for one example (batch 1) of this size, made on the current (meta) device: ``inputs`` of ``trace_batch``.

        The planner runs the denoiser on them to count the activations it saves; None: the planner does not trace it.
        ``latent_frames`` is 1 unless the entry is ``video``.
        """
        batch = self.trace_batch(config, latent_side, latent_frames, text_tokens, dtype)
        # The traced context: the trace's dtype, on the meta device, at the VAE factor the planner assumes (8).
        return None if batch is None else self.inputs(*batch, PredictContext(torch.device("meta"), dtype, 8, 1.0))

    def loss_region(self, prediction: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts of the denoiser's prediction and of the target that the loss compares: all of them by default."""
        return prediction, target

    def loss(self, model, noised: Any, condition: dict[str, torch.Tensor], context: PredictContext) -> torch.Tensor:
        """The training loss of a noised micro-batch (``objectives.NoisedBatch``): the denoiser's error on its latents."""
        from zeropipe.families.diffusion.objectives import weighted_mse

        prediction, target = self.loss_region(self.predict(model, noised.model_input, noised.timesteps, condition, context), noised.target)
        return weighted_mse(prediction, target, noised.weights)

    def checkpoint_problems(self, folder: Any) -> list[tuple[str, str]]:
        """Why this entry cannot train the checkpoint in ``folder`` (``config.pipeline_index.PipelineIndex``) though its pipeline class is
        the entry's, each (key, why and what to train instead); checked before anything runs (Kandinsky 6's pi-Flow distilled heads)."""
        return []



class SoundingCall(DenoiserCall):
    """A denoiser that denoises a clip and its soundtrack in one call (LTX-2, Kandinsky 6): ``joint_predict`` gives both streams'
    velocities, ``predict`` the video's, ``loss`` adds the audio's.

    Both streams sit at the clip's noise level (sigma = timestep / 1000: the flow objective's timesteps over the schedulers' 1000
    training steps). ``predict`` noises the batch's audio latents with a fixed seed, so that the same inputs give the same output
    (training draws its own noise in ``loss``), and calls a batch without audio latents (the planner's trace, a contract batch)
    with pure noise of ``silent_audio_shape``.
    """

    def joint_predict(self, model, video: torch.Tensor, audio: torch.Tensor, timesteps: torch.Tensor, condition, context) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def silent_audio_shape(self, module, video: torch.Tensor) -> tuple[int, ...]:
        """The audio latents' shape for a clip of these video latents (batch, length, channels), as the pipeline sizes them."""
        raise NotImplementedError

    def predict(self, model, model_input, timesteps, condition, context):
        module = getattr(model, "module", model)
        sigma = (timesteps.float() / 1000.0).view(-1, 1, 1)
        generator = torch.Generator().manual_seed(0)
        if "audio_latents" in condition:
            audio = condition["audio_latents"].float()
            noise = torch.randn(audio.shape, generator=generator).to(audio)
            audio = (1 - sigma.to(audio)) * audio + sigma.to(audio) * noise
        else:
            audio = torch.randn(self.silent_audio_shape(module, model_input), generator=generator).to(model_input.device)
        return self.joint_predict(model, model_input, audio, timesteps, condition, context)[0]

    def loss(self, model, noised, condition, context):
        """Video and audio velocity errors added (ltx-trainer's ``compute_loss``), both streams at the clip's noise level."""
        from zeropipe.families.diffusion.objectives import weighted_mse

        audio = condition["audio_latents"].float()
        sigma = (noised.timesteps.float() / 1000.0).view(-1, 1, 1).to(audio)
        noise = torch.randn(audio.shape, dtype=torch.float32).to(audio)  # this rank's stream, saved with checkpoints
        noisy = (1 - sigma) * audio + sigma * noise
        video_velocity, audio_velocity = self.joint_predict(model, noised.model_input, noisy, noised.timesteps, condition, context)
        return weighted_mse(video_velocity, noised.target, noised.weights) + weighted_mse(audio_velocity, noise - audio, noised.weights)


class PromptEncoding(Role):
    """Prompts to the conditioning tensors the text cache holds, and the tokenizers and processors that encoding needs."""

    def encode_prompts(self, pipeline, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """The conditioning tensors of a batch of prompts, from the pipeline's own encode_prompt."""
        raise NotImplementedError(f"the {self.record.name} entry does not say how its prompts are encoded")

    def tiny_tokenizer(self, tokenizer: str):
        """A tokenizer for a tiny preset, built without a download (single characters are enough for captions)."""
        return character_tokenizer(self.record.tokenizer_length(tokenizer))

    def tiny_prompt_processor(self, processor: str, parts: dict[str, Any], folder: Path) -> None:
        """Write the files of a prompt processor (the prompt part's ``processors``) of a tiny preset into its folder."""
        raise NotImplementedError(f"the {self.record.name} entry names prompt processors {self.record.text.processors} but cannot build a tiny one")

    def load_prompt_processor(self, pipeline_dir: Path, processor: str, parts: dict[str, Any]):
        """The prompt processor the text pipeline is given, from its folder and the other loaded parts (the tokenizers)."""
        raise NotImplementedError(f"the {self.record.name} entry names prompt processors {self.record.text.processors} but cannot load one")


@dataclass(eq=False)
class EncodePrompt(PromptEncoding):
    """Prompt encoding that is the pipeline's own ``encode_prompt``, declared: its keyword arguments besides the prompts and device,
    and the name the text cache keeps each of its returned tensors under (None: not kept)."""

    returns: tuple[str | None, ...] = ("prompt_embeds",)
    arguments: dict[str, Any] = field(default_factory=dict)

    def encode_prompts(self, pipeline, prompts, device):
        out = pipeline.encode_prompt(prompt=prompts, device=device, **self.arguments)
        out = out if isinstance(out, tuple) else (out,)
        return {name: value for name, value in zip(self.returns, out, strict=False) if name is not None}


class Sampling(Role):
    """The samples drawn during training: the pipeline's own call by default, else the shared loop (``sampler.py``)."""

    def sample_kwargs(self, condition: dict[str, torch.Tensor], negative: dict[str, torch.Tensor], guidance_scale: float, guidance: float) -> dict[str, Any]:
        """The pipeline call's conditioning and guidance arguments (classifier-free guidance by default)."""
        kwargs: dict[str, Any] = {"prompt_embeds": condition["prompt_embeds"], "guidance_scale": guidance_scale, "negative_prompt_embeds": negative["prompt_embeds"]}
        if "pooled_prompt_embeds" in condition:
            kwargs["pooled_prompt_embeds"] = condition["pooled_prompt_embeds"]
        if "pooled_prompt_embeds" in negative:
            kwargs["negative_pooled_prompt_embeds"] = negative["pooled_prompt_embeds"]
        return kwargs

    def draw(self, pipeline, kwargs: dict[str, Any]) -> torch.Tensor:
        """Latents of the samples drawn with these arguments: the pipeline's own call (``sampler.pipeline_call``) unless the entry overrides it."""
        from zeropipe.families.diffusion.sampler import pipeline_call

        return pipeline_call(pipeline, kwargs)[0]

    def sample_outputs(self, pipeline, kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The samples' latents and what else the pipeline drew, by name (LTX-2's audio latents), which the parts' ``add_to_samples`` read."""
        return self.draw(pipeline, kwargs), {}

    def unpack_latents(self, pipeline, latents: torch.Tensor, size: int, vae_factor: int) -> torch.Tensor:
        """Latents as the VAE decodes them, from what the pipeline returned with output_type="latent"."""
        return latents

    def decoded(self, pipeline, latents: torch.Tensor, kwargs: dict[str, Any], decode) -> torch.Tensor:
        """The samples' pixels from those latents: ``decode`` (the codec's VAE decode) of them all, or an entry's own (Wan Animate 2's segments, decoded one by one)."""
        return decode(latents)


class ExportLayouts(Role):
    """The adapter in the model's original (ComfyUI) key layout; None where the model has none."""

    def original_lora_layout(self, layers: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor] | None:
        return None

    def original_lokr_layout(self, layers: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor] | None:
        """A LoKr adapter in the original layout; ``scaling`` (peft's alpha / r) is folded into the first factor."""
        return None


class Assembly(Role):
    """Building the pipeline, and a tiny preset's own components."""

    def construct_pipeline(self, cls, kwargs: dict[str, Any], folder: Any):
        """The pipeline of these components (missing ones None: a text pipeline has no denoiser and no VAE); ``folder`` is its ``PipelineIndex``."""
        return cls(**kwargs)

    def tiny_component(self, name: str, fields: dict[str, Any]):
        """A tiny preset's component besides the scheduler, text encoders and VAE, from its preset fields: the denoiser (an image encoder, an entry's own)."""
        return self.entry.model_class()(**fields)

    def tiny_denoiser(self, model) -> None:
        """Give a tiny preset's freshly built denoiser the weights it needs to learn (default: as its class initialises them)."""


DEFAULT_ROLES = {"call": DenoiserCall, "prompts": PromptEncoding, "sampling": Sampling, "layouts": ExportLayouts, "assembly": Assembly}
