"""The planner's description of a diffusion run's denoiser (model.path or an inline tiny preset), counted on the meta device."""

from __future__ import annotations

from dataclasses import replace

from zeropipe.config.pipeline_index import read_pipeline_index
from zeropipe.config.schema import RunConfig
from zeropipe.diffusion.pipelines import preset_components
from zeropipe.plan.model_spec import (  # the planner's meta-device counters
    ModelSpec,
    _diffusion_spec,
    _pipeline_spec,
    _text_encoder_model_type,
    vae_factors,
)


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
    if section.quantization is not None and section.quantization.is_fp8:
        spec = spec.with_fp8_base(section.quantization.storage)
    cached = {"vae"} if data.cache.latents else set()
    if data.cache.text:
        cached |= {m.name for m in spec.frozen_models if m.name.startswith("text_encoder")}
    return replace(
        spec,
        frozen_models=tuple(m for m in spec.frozen_models if m.name not in cached),
        cached_models=tuple(m for m in spec.frozen_models if m.name in cached),
    )
