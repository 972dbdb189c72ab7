"""The planner's builders of a diffusion model's spec, registered with the planner when the family is imported.

The planner (``plan/``) knows no diffusion architecture: it asks these (through
:func:`zeropipe.plan.model_spec.diffusion_specs`) for a diffusion catalog entry, a diffusers model's
``config.json`` and a pipeline folder; they find the entry that trains the denoiser, count it on the
meta device and trace its activations on the inputs the entry makes. Moved from ``plan/model_spec.py``
with their bodies unchanged.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zeropipe.config.pipeline_index import PipelineIndex
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.families.diffusion.entries import TASK_SETTING, architecture_for_denoiser, architecture_for_pipeline, architecture_named, task_problem
from zeropipe.plan.model_spec import (  # the planner's meta-device counters
    DiffusionSpecs,
    FrozenModel,
    ModelSpec,
    _block_linear_counts,
    _build_component,
    _count,
    _diffusers_class,
    _lora_counts,
    lora_targets,
    register_diffusion_specs,
)
from zeropipe.plan.trace import ActivationTrace, trace_diffusion

if TYPE_CHECKING:
    from zeropipe.config.schema import LoraSection



def denoiser_config_spec(path: Path, config: dict[str, Any], lora: LoraSection | None) -> ModelSpec:
    """A diffusers model's config (a pipeline's unet/ or transformer/): its architecture is the entry that trains that class."""
    arch = architecture_for_denoiser(config["_class_name"])
    entry = {
        "name": path.name,
        "architecture": arch.record.name if arch is not None else None,
        "family": _denoiser_family(config["_class_name"], arch),
        "resolution": 1024,
        "trained": {"name": path.name, "library": "diffusers", "class": config["_class_name"], "config": config},
    }
    return _diffusion_spec(entry, lora)


def _diffusion_spec(entry: dict[str, Any], lora: LoraSection | None) -> ModelSpec:
    model = _build_component(entry["trained"])
    frozen = tuple(FrozenModel(c["name"], sum(p.numel() for p in _build_component(c).parameters())) for c in entry.get("frozen", ()))
    counts = _count(model)
    linears = _block_linear_counts(model)
    trainable, sizes, lora_shape = counts["total"], counts["sizes"], None
    named = entry.get("architecture")
    arch = architecture_named(named) if named else architecture_for_denoiser(entry["trained"]["class"])
    task = entry.get("task", "auto")  # model.diffusion.task of a run config planned from a catalog entry (before_download)
    if arch is not None and task != "auto":
        chosen = architecture_for_pipeline(arch.record.pipeline_class, {}, task) or arch
        problem = task_problem(chosen, arch.record.pipeline_class, task)
        if problem:
            raise ConfigError([("model.diffusion.task", problem)])
        arch = chosen
        entry = {**entry, "architecture": arch.record.name}  # the trace is the task's entry's (Kandinsky 6's image-to-video: its reference frame)
    if lora is not None:
        auto = arch.record.lora_targets if arch is not None else None  # what training adapts when target_modules is auto
        lora_shape, trainable, sizes = _lora_counts(model, lora, None, "diffusion", auto)
        _inject_lora(model, lora, auto)
    resolution = int(entry.get("resolution", 1024))
    trace = _trace(model, entry, resolution)
    config = model.config
    hidden = (
        getattr(config, "num_attention_heads", 0) * getattr(config, "attention_head_dim", 0) if entry["family"] == "diffusion_transformer" else None
    )
    from zeropipe.families.diffusion.sequence_parallel import VERIFIED

    split_heads = getattr(config, "num_attention_heads", 0) if entry["trained"]["class"] in VERIFIED else 0
    return ModelSpec(
        name=entry["name"],
        family=entry["family"],
        sequence_parallel_heads=int(split_heads) or None,
        total_params=counts["total"] + (trainable if lora is not None else 0),
        trainable_params=trainable,
        layers=0,
        hidden_size=hidden or None,
        largest_layer_params=counts["largest_layer"],
        largest_layer_name=counts["largest_layer_name"],
        largest_parameter=counts["largest_parameter"],
        parameter_sizes=tuple(sizes),
        lora=lora_shape,
        frozen_models=frozen,
        activation_trace=trace,
        # The entry's loss may call the denoiser on more than the micro-batch (the flow-map objective: twice with gradient, twice
        # without): the trace is one call of one example, scaled by what the loss asks (its call's gradient_batch /
        # gradient_free_batch; a gradient-free pass as large as the gradient one is the spec's reference_forward).
        sequences_per_example=arch.call.gradient_batch if arch is not None else 1,
        reference_forward=arch is not None and arch.call.gradient_free_batch > 0,
        **linears,
    )


def _inject_lora(model, lora: LoraSection, auto=None) -> None:
    """Adapters on the meta model, so the trace sees what frozen base layers and adapters save."""
    import torch
    from peft import inject_adapter_in_model

    from zeropipe.models.adapters import is_adapter_parameter, peft_adapter_config

    targets = lora_targets(lora, "diffusion", auto)
    with torch.device("meta"):
        inject_adapter_in_model(peft_adapter_config(lora, targets), model)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_parameter(name))


def _trace(model, entry: dict[str, Any], resolution: int) -> ActivationTrace | None:
    """The denoiser's activations for one example, traced on inputs its architecture entry makes (``DenoiserCall.trace_inputs``).

    The entry says what its denoiser takes, whether its latents have frames (``video``) and the
    prompt length and clip length to trace when the spec does not say (a catalog entry's
    ``text_tokens`` and ``frames``); None when no entry trains this model or it is not traced.
    """
    import torch

    named = entry.get("architecture")
    # An entry may name its architecture where several share a denoiser class (Qwen-Image and Qwen-Image-Edit).
    arch = architecture_named(named) if named else architecture_for_denoiser(entry["trained"]["class"])
    if arch is None:
        return None
    config, dtype = model.config, torch.bfloat16
    latent = resolution // int(entry.get("vae_factor", 8))
    frames = int(entry.get("frames", arch.record.trace_frames)) if arch.record.video else 1
    latent_frames = (frames - 1) // int(entry.get("vae_temporal_factor", arch.record.frame_multiple)) + 1
    text_tokens = int(entry.get("text_tokens", arch.record.trace_text_tokens()))
    from zeropipe.plan import trace_store  # a catalog shape's trace is stored (seconds saved per plan)

    # Entries chosen by model.diffusion.task share their folder, so their denoiser's config, with another entry: their traces differ
    # (Kandinsky 6's image-to-video has one more latent frame) under the same config and shape, so their key names the entry.
    shares_folder = dict(arch.record.pipeline_settings).get(TASK_SETTING) is not None
    key = trace_store.trace_key(model, entry["trained"], resolution, frames, latent, latent_frames, text_tokens, entry=arch.record.name if shares_folder else None)
    stored = trace_store.lookup(key)
    if stored is not None:
        return stored
    with torch.device("meta"):
        inputs = arch.call.trace_inputs(config, latent, latent_frames, text_tokens, dtype)
    if inputs is None:
        return None
    trace = trace_diffusion(model, lambda: inputs, resolution, frames=frames)
    temporal = int(entry.get("vae_temporal_factor", arch.record.frame_multiple)) if arch.record.video else 1
    trace = replace(trace, text_tokens=text_tokens, vae_factor=int(entry.get("vae_factor", 8)), temporal_factor=temporal)
    if trace_store.RECORDING:
        trace_store.record(key, str(entry.get("name")), trace)
    return trace


def _vae_factors(folder: PipelineIndex, arch) -> tuple[int, int]:
    """(pixels per latent along a side, frames per latent frame) of a pipeline's VAE; (8, 1) when its config cannot tell."""
    try:
        return vae_factors(folder.component_config("vae"), arch)
    except (ConfigError, KeyError):
        return 8, 1


def _denoiser_family(class_name: str, arch) -> str:
    """diffusion_unet or diffusion_transformer: the component its architecture entry trains, else where diffusers keeps the class."""
    if arch is not None:
        return "diffusion_transformer" if arch.record.denoiser == "transformer" else "diffusion_unet"
    module = getattr(_diffusers_class("diffusers", class_name), "__module__", "")
    return "diffusion_unet" if ".unets." in module else "diffusion_transformer"


def _text_encoder_model_type(class_name: str) -> str:
    """The transformers model_type of a text encoder class (T5EncoderModel: t5, LlamaModel: llama, CLIPTextModel: clip_text_model)."""
    import transformers

    return getattr(transformers, class_name).config_class.model_type


def _architecture(folder: PipelineIndex, task: str = "auto"):
    """The diffusion architecture of a pipeline folder (for ``model.diffusion.task``), or None when its pipeline class is none ZeRO-Pipe knows."""
    return architecture_for_pipeline(folder.class_name, folder.index, task)


def vae_factors(config: dict[str, Any], arch=None) -> tuple[int, int]:
    """(pixels per latent along a side, frames per latent frame) of a VAE config, read as its architecture reads it."""
    from zeropipe.families.diffusion.parts import ImageLatents

    if arch is not None:
        return arch.record.codec.vae_factors(config)
    return ImageLatents().vae_factors(config)  # the generic reading: video VAEs say both, image VAEs halve per block


def _pipeline_spec(folder: PipelineIndex, lora: LoraSection | None, resolution: int = 1024, frames: int = 81, task: str = "auto") -> ModelSpec:
    """A diffusers pipeline folder: train the UNet or transformer, keep text encoders and VAE frozen."""
    path, index = folder.path, folder.index
    trained_name = "transformer" if "transformer" in index else "unet"
    if trained_name not in index:
        raise ZeroPipeError(f"{folder.index_file} names neither a unet nor a transformer to train")
    components = []
    for name, (library, cls) in folder.components().items():
        if library not in ("diffusers", "transformers") or not folder.has_component_config(name):
            continue
        components.append({"name": name, "library": library, "class": cls, "config": folder.component_config(name)})
    trained = next((c for c in components if c["name"] == trained_name), None)
    if trained is None:
        raise ZeroPipeError(f"{path}/{trained_name}/config.json is missing")
    family = "diffusion_transformer" if trained_name == "transformer" else "diffusion_unet"
    arch = _architecture(folder, task)
    vae_factor, vae_temporal_factor = _vae_factors(folder, arch)
    entry = {
        "name": path.name,
        "architecture": arch.record.name if arch is not None else None,
        "family": family,
        "resolution": resolution,
        "vae_factor": vae_factor,
        "vae_temporal_factor": vae_temporal_factor,
        "frames": frames,
        "trained": trained,
        "frozen": [c for c in components if c is not trained and c["name"] in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")],
    }
    return replace(_diffusion_spec(entry, lora), source=f"pipeline: {path}")


register_diffusion_specs(DiffusionSpecs(catalog_entry=_diffusion_spec, denoiser_config=denoiser_config_spec, pipeline=_pipeline_spec))
