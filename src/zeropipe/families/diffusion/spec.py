"""The planner's description of a diffusion model, counted on the meta device: a run's denoiser (model.path or an
inline tiny preset), a catalog entry, a diffusers model's config and a pipeline folder.

The planner (``plan/``) knows no diffusion architecture: this module registers its builders there
(:func:`zeropipe.plan.model_spec.register_diffusion_specs`) when the family is imported, and the
planner asks them (:func:`zeropipe.plan.model_spec.diffusion_specs`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zeropipe.config.pipeline_index import PipelineIndex, read_pipeline_index
from zeropipe.config.schema import RunConfig
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.families.diffusion.entries import architecture_for_denoiser, architecture_for_pipeline, architecture_named
from zeropipe.families.diffusion.pipelines import preset_components
from zeropipe.plan.model_spec import (  # the planner's meta-device counters
    DiffusionSpecs,
    FrozenModel,
    ModelSpec,
    QuantizedBase,
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


def diffusion_config_spec(run_config: RunConfig) -> ModelSpec:
    """The denoiser a diffusion run config trains, at its resolution, with the frozen models its ranks hold.

    With both caches on, the ranks never load the VAE or the text encoders (they are encoded
    once before training), so they are not counted; with one cache off, its encoder is.
    """

    section, data = run_config.model, run_config.data
    if section.path:
        folder = read_pipeline_index(section.path)
        spec = _pipeline_spec(folder, section.lora, resolution=data.images.resolution, frames=max(data.video.frame_buckets))
    else:
        arch, components = preset_components(section.config or {})
        trained = {"name": arch.denoiser, "library": "diffusers", "class": arch.denoiser_class, "config": components[arch.denoiser]}
        frozen = [{"name": "vae", "library": "diffusers", "class": arch.vae_class, "config": components["vae"]}]
        for name in arch.text_encoders:
            fields = dict(components[name])
            cls = fields.pop("class")
            fields["model_type"] = _text_encoder_model_type(cls)
            frozen.append({"name": name, "library": "transformers", "class": cls, "config": fields})
        factor, temporal = vae_factors(components["vae"], arch)
        entry = {
            **arch.codec.planned_shape(data.video.frame_buckets, arch.tokenizer_length(arch.tokenizers[0]) if arch.tokenizers else arch.trace_text_tokens()),
            "vae_temporal_factor": temporal,
            "name": section.config["pipeline"],
            "family": "diffusion_transformer" if arch.denoiser == "transformer" else "diffusion_unet",
            "resolution": data.images.resolution,
            "vae_factor": factor,
            "trained": trained,
            "frozen": frozen,
        }
        spec = replace(_diffusion_spec(entry, section.lora), source="run config: model.config")
    quant = section.quantization
    if quant is not None and quant.storage in ("fp8", "fp8_e5m2", "int8"):
        # bitsandbytes' int8 is one byte per weight with a float32 scale per row too (models.bnb_base).
        spec = spec.with_fp8_base(quant.storage)
    elif quant is not None:
        # nf4/fp4: the block linears in 4 bits (QuantizedBase counts the rest as fp32, where a denoiser keeps it in
        # the precision: an overcount of the non-block weights, 1-3% of a DiT's).
        spec = replace(spec, quantized=QuantizedBase(spec.block_linear_params, spec.frozen_base_params - spec.block_linear_params, quant.double_quant))
    cached = {"vae"} if data.cache.latents else set()
    if data.cache.text:
        cached |= {m.name for m in spec.frozen_models if m.name.startswith("text_encoder")}
    return replace(
        spec,
        frozen_models=tuple(m for m in spec.frozen_models if m.name not in cached),
        cached_models=tuple(m for m in spec.frozen_models if m.name in cached),
    )


# ---------------------------------------------------------------------------------------------
# The builders the planner asks (moved from plan/model_spec.py, bodies unchanged)


def denoiser_config_spec(path: Path, config: dict[str, Any], lora: LoraSection | None) -> ModelSpec:
    """A diffusers model's config (a pipeline's unet/ or transformer/): its architecture is the entry that trains that class."""
    arch = architecture_for_denoiser(config["_class_name"])
    entry = {
        "name": path.name,
        "architecture": arch.name if arch is not None else None,
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
    if lora is not None:
        named = entry.get("architecture")
        arch = architecture_named(named) if named else architecture_for_denoiser(entry["trained"]["class"])
        auto = arch.lora_targets if arch is not None else None  # what training adapts when target_modules is auto
        lora_shape, trainable, sizes = _lora_counts(model, lora, None, "diffusion", auto)
        _inject_lora(model, lora, auto)
    resolution = int(entry.get("resolution", 1024))
    trace = _trace(model, entry, resolution)
    config = model.config
    hidden = (
        getattr(config, "num_attention_heads", 0) * getattr(config, "attention_head_dim", 0) if entry["family"] == "diffusion_transformer" else None
    )
    return ModelSpec(
        name=entry["name"],
        family=entry["family"],
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
    """The denoiser's activations for one example, traced on inputs its architecture entry makes (``Architecture.trace_inputs``).

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
    frames = int(entry.get("frames", arch.trace_frames())) if arch.video else 1
    latent_frames = (frames - 1) // int(entry.get("vae_temporal_factor", arch.frame_multiple)) + 1
    text_tokens = int(entry.get("text_tokens", arch.trace_text_tokens()))
    with torch.device("meta"):
        inputs = arch.trace_inputs(config, latent, latent_frames, text_tokens, dtype)
    if inputs is None:
        return None
    return trace_diffusion(model, lambda: inputs, resolution, frames=frames)


def _vae_factors(folder: PipelineIndex, arch) -> tuple[int, int]:
    """(pixels per latent along a side, frames per latent frame) of a pipeline's VAE; (8, 1) when its config cannot tell."""
    try:
        return vae_factors(folder.component_config("vae"), arch)
    except (ConfigError, KeyError):
        return 8, 1


def _denoiser_family(class_name: str, arch) -> str:
    """diffusion_unet or diffusion_transformer: the component its architecture entry trains, else where diffusers keeps the class."""
    if arch is not None:
        return "diffusion_transformer" if arch.denoiser == "transformer" else "diffusion_unet"
    module = getattr(_diffusers_class("diffusers", class_name), "__module__", "")
    return "diffusion_unet" if ".unets." in module else "diffusion_transformer"


def _text_encoder_model_type(class_name: str) -> str:
    """The transformers model_type of a text encoder class (T5EncoderModel: t5, LlamaModel: llama, CLIPTextModel: clip_text_model)."""
    import transformers

    return getattr(transformers, class_name).config_class.model_type


def _architecture(folder: PipelineIndex):
    """The diffusion architecture of a pipeline folder, or None when its pipeline class is none ZeRO-Pipe knows."""
    return architecture_for_pipeline(folder.class_name, folder.index)


def vae_factors(config: dict[str, Any], arch=None) -> tuple[int, int]:
    """(pixels per latent along a side, frames per latent frame) of a VAE config, read as its architecture reads it."""
    from zeropipe.families.diffusion.core import Architecture

    if arch is not None:
        return arch.vae_factors(config)
    return Architecture.vae_factors(None, config)  # the generic reading: video VAEs say both, image VAEs halve per block


def _pipeline_spec(folder: PipelineIndex, lora: LoraSection | None, resolution: int = 1024, frames: int = 81) -> ModelSpec:
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
    arch = _architecture(folder)
    vae_factor, vae_temporal_factor = _vae_factors(folder, arch)
    entry = {
        "name": path.name,
        "architecture": getattr(arch, "name", None),
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
