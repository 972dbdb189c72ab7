"""Plan a run config before its model is downloaded: a ``model.path`` not on disk that names a catalog model.

The path names a catalog model when its last component (or the whole of it, a Hub id) is the
Hugging Face repository an entry counts, or the entry's catalog name: ``/models/FLUX.2-dev``,
``black-forest-labs/FLUX.2-dev`` and ``flux.2-dev`` all name ``flux.2-dev``. The model is then
counted from the catalog's config files with the run config's LoRA, quantization, caches,
resolution and clip length, and the plan says so. Only the planner does this: ``check`` and
``train`` still refuse the missing path. Data paths that do not exist yet are not needed to plan.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zeropipe.errors import ConfigError

if TYPE_CHECKING:
    from zeropipe.config.schema import RunConfig
    from zeropipe.plan.hardware import Hardware
    from zeropipe.plan.model_spec import ModelSpec
    from zeropipe.plan.search import PlanResult

# Problems a plan does not need solved: paths of the model (when it names a catalog entry) and of the data.
MISSING_MODEL = "is neither a Hugging Face model directory"
MISSING_PATH = "does not exist: fix the path"


def plan_from_catalog(
    config_path: str, overrides: list[str], err: ConfigError, hardware: Hardware, margin: float, global_batch: int | None, spec_of: Callable[[RunConfig], ModelSpec]
) -> PlanResult:
    """The plan of ``config_path`` whose only problems are paths not on disk yet; ``err`` again when it has others, or its model names no catalog entry.

    ``spec_of`` counts a config's model that is on disk (``zeropipe.families.model_spec``: its family's counter).

    Raises:
        ConfigError: ``err``, when a problem other than a missing model or data path remains, or the missing model names no catalog model.
    """
    from zeropipe.config.load import apply_override, read_yaml
    from zeropipe.config.schema import RunConfig
    from zeropipe.plan import plan_run
    from zeropipe.plan.search import complete
    from zeropipe.plan.variants import catalog_match

    model_missing = [p for p in err.problems if p[0] == "model.path" and MISSING_MODEL in p[1]]
    others = [p for p in err.problems if p not in model_missing and not (p[0].endswith("path") and MISSING_PATH in p[1])]
    if others:
        raise err
    raw: dict[str, Any] = read_yaml(Path(config_path))
    for item in overrides:
        apply_override(raw, item)
    if isinstance(raw.get("run"), dict):
        raw["run"].setdefault("name", Path(config_path).stem)
    config = RunConfig.model_validate(raw)
    notes = []
    if model_missing:
        name = catalog_match(config.model.path or "")
        if name is None:
            raise ConfigError(
                err.problems + [("model.path", "names no catalog model either (zeropipe plan --list-models): download it, or plan with --model NAME")],
                source=getattr(err, "source", None),
            )
        spec = catalog_config_spec(name, config)
        notes.append(
            f"model.path {config.model.path} is not on disk: planned from the catalog entry {name} (its config files), with this config's "
            "LoRA, quantization, caches and shapes; zeropipe check and train need the downloaded model there"
        )
    else:
        spec = spec_of(config)
    missing_data = [p[0] for p in err.problems if p[0] != "model.path"]
    if missing_data:
        notes.append(f"{', '.join(missing_data)} not on disk: the plan does not read the data")
    result = plan_run(config, hardware, spec, margin)
    result.notes[:0] = notes
    some = result.configured or result.best or (result.candidates[0] if result.candidates else None)
    limits = {} if some is None else {"zero3_max_live_parameters": some.choice.zero3_max_live_parameters, "zero3_reuse_distance": some.choice.zero3_reuse_distance,
                                        "tiled_loss": some.choice.tiled_loss, "loss_tile_tokens": some.choice.loss_tile_tokens}
    kwargs = dict(global_batch=global_batch or result.global_batch, seq_len=config.data.max_seq_len, margin=margin, fixed=None,
                  attention=config.model.attn_implementation, zero3_limits=limits)
    return complete(result, kwargs)


def catalog_config_spec(name: str, config: RunConfig) -> ModelSpec:
    """A catalog model counted as ``config`` trains it: its LoRA and quantization; for diffusion its caches, resolution and clip length."""
    import json

    from zeropipe.plan.model_spec import CATALOG_DIR, QuantizedBase, _causal_lm_spec, diffusion_specs
    from zeropipe.plan.variants import with_caches

    entry = json.loads((CATALOG_DIR / f"{name}.json").read_text())
    section, data = config.model, config.data
    if "trained" not in entry:  # a causal LM's or VLM's entry: one transformers config
        spec = _causal_lm_spec(entry["config"], entry["name"], section.lora)
        if section.quantization is not None and section.quantization.storage in ("fp8", "fp8_e5m2", "int8"):
            spec = spec.with_fp8_base(section.quantization.storage)
        elif section.quantization is not None and section.quantization.load_in_4bit:
            spec = replace(spec, quantized=QuantizedBase(spec.quantizable_params, spec.frozen_base_params - spec.quantizable_params, section.quantization.double_quant))
        if config.preference is not None:
            spec = replace(spec, sequences_per_example=2)
        return replace(spec, source=f"catalog (model.path not on disk): {entry['source']}")
    entry = dict(entry, resolution=data.images.resolution, task=section.diffusion.task)  # the task's entry (Kandinsky 6 image-to-video)
    if "frames" in entry and "video" in config.data.model_fields_set:  # the entry's clip length unless the config sets its own
        entry["frames"] = max(data.video.frame_buckets)
    spec = diffusion_specs().catalog_entry(entry, section.lora)  # the diffusion family's builder
    quant = section.quantization
    if quant is not None and quant.storage in ("fp8", "fp8_e5m2", "int8"):
        spec = spec.with_fp8_base(quant.storage)
    elif quant is not None:
        spec = replace(spec, quantized=QuantizedBase(spec.block_linear_params, spec.frozen_base_params - spec.block_linear_params, quant.double_quant))
    spec = with_caches(spec, latents=data.cache.latents, text=data.cache.text)
    return replace(spec, source=f"catalog (model.path not on disk): {entry['source']}")

