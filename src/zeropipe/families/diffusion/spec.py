"""The planner's description of a diffusion run's denoiser (model.path or an inline tiny preset), counted on the meta device.

The builders the planner asks for a catalog entry, a diffusers model's config and a pipeline folder are in
``plan_specs.py``, registered with the planner when this family is imported.
"""

from __future__ import annotations

from dataclasses import replace

from zeropipe.config.pipeline_index import read_pipeline_index
from zeropipe.config.schema import RunConfig
from zeropipe.families.diffusion.pipelines import preset_components
from zeropipe.families.diffusion.plan_specs import _diffusion_spec, _pipeline_spec, _text_encoder_model_type, vae_factors
from zeropipe.plan.model_spec import ModelSpec, QuantizedBase  # the planner's meta-device counters


def diffusion_config_spec(run_config: RunConfig) -> ModelSpec:
    """The denoiser a diffusion run config trains, at its resolution, with the frozen models its ranks hold.

    With both caches on, the ranks never load the VAE or the text encoders (they are encoded
    once before training), so they are not counted; with one cache off, its encoder is.
    """

    section, data = run_config.model, run_config.data
    if section.path:
        folder = read_pipeline_index(section.path)
        spec = _pipeline_spec(folder, section.lora, resolution=data.images.resolution, frames=max(data.video.frame_buckets), task=section.diffusion.task)
    else:
        arch, components = preset_components(section.config or {})
        trained = {"name": arch.record.denoiser, "library": "diffusers", "class": arch.record.denoiser_class, "config": components[arch.record.denoiser]}
        frozen = [{"name": "vae", "library": "diffusers", "class": arch.record.vae_class, "config": components["vae"]}]
        for name in arch.record.text_encoders:
            fields = dict(components[name])
            cls = fields.pop("class")
            fields["model_type"] = _text_encoder_model_type(cls)
            frozen.append({"name": name, "library": "transformers", "class": cls, "config": fields})
        factor, temporal = vae_factors(components["vae"], arch)
        entry = {
            **arch.record.codec.planned_shape(data.video.frame_buckets, arch.record.tokenizer_length(arch.record.tokenizers[0]) if arch.record.tokenizers else arch.record.trace_text_tokens()),
            "vae_temporal_factor": temporal,
            "name": section.config["pipeline"],
            "architecture": arch.record.name,  # entries share denoiser classes (SD 1.5 and SDXL's UNet): the trace is this entry's
            "family": "diffusion_transformer" if arch.record.denoiser == "transformer" else "diffusion_unet",
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
