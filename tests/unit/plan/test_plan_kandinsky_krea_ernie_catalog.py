"""Kandinsky 5 T2I, Krea 2 and ERNIE-Image in the planner's catalog: counted from their published configs on the meta device, and planned with each entry's own LoRA targets.

Tracing a catalog entry at 1024 px takes 40 s on a CI core (see test_plan_image_catalog.py); the
trace inputs are checked on the tiny presets here, and the counts on the catalog's configs.
"""

from __future__ import annotations

import json

import pytest
import torch

from zeropipe.plan.model_spec import CATALOG_DIR, catalog_names

# name: (published size of the trained model, tolerance, its text encoders by component name). Sources in each catalog entry's "source".
PUBLISHED = {
    # Kandinsky 5.0 Image Lite: "6B" (model card; the config counts 6.02B); Qwen2.5-VL-7B with its vision tower 8.29B; CLIP ViT-L/14's text model 123M.
    "kandinsky5-t2i-lite": (6.0e9, 0.01, {"text_encoder": 8.29e9, "text_encoder_2": 0.123e9}),
    # Krea 2: 12.9B (the diffusers conversions' cards; Krea's card rounds to 12B); Qwen3-VL-4B-Instruct without its (tied) head 4.44B.
    "krea-2": (12.9e9, 0.01, {"text_encoder": 4.44e9}),
    # ERNIE-Image: "8B" (diffusers' docs, the hub's collection); Ministral 3 3B with its Pixtral tower.
    "ernie-image": (8.0e9, 0.02, {"text_encoder": 3.85e9}),
}


def meta_count(component: dict) -> int:
    import diffusers
    import transformers

    with torch.device("meta"):
        if component.get("library") == "transformers":
            cls = getattr(transformers, component["class"])
            config = dict(component["config"])
            model_type = config.pop("model_type")
            model = cls._from_config(transformers.AutoConfig.for_model(model_type, **config))
        else:
            model = getattr(diffusers, component["class"]).from_config({k: v for k, v in component["config"].items() if not k.startswith("_")})
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_catalog_entry_counts_its_published_size(name):
    params, tolerance, encoders = PUBLISHED[name]
    assert name in catalog_names()
    entry = json.loads((CATALOG_DIR / f"{name}.json").read_text())
    assert entry["published_params"] == pytest.approx(params)
    assert meta_count(entry["trained"]) == pytest.approx(params, rel=tolerance)
    frozen = {component["name"].split(" ")[0]: component for component in entry["frozen"]}
    for component, count in encoders.items():
        assert meta_count(frozen[component]) == pytest.approx(count, rel=0.01), component


# ERNIE-Image's transformer opens torch.autocast on the meta device, which torch refuses: the planner cannot trace it.
UNTRACED = ("tiny-ernie-image",)


@pytest.mark.parametrize("preset", ["tiny-kandinsky5-t2i", "tiny-krea2", "tiny-ernie-image"])
def test_the_planner_traces_each_entry_and_counts_its_own_lora_targets(preset):
    """target_modules auto is the entry's own targets, as training resolves them (the planner used to take to_q/to_k/to_v/to_out.0 for every model)."""
    from zeropipe.config.schema import RunConfig
    from zeropipe.families.diffusion.entries import architecture_for_preset
    from zeropipe.families.diffusion.spec import diffusion_config_spec

    arch = architecture_for_preset(preset)
    data = {"synthetic": {"task": "shapes"}, "images": {"resolution": 64, "bucket_step": 16}}
    spec = diffusion_config_spec(RunConfig.model_validate({"model": {"config": {"pipeline": preset}, "lora": {"r": 4}}, "data": data}))
    targets = (arch.record.lora_targets,) if isinstance(arch.record.lora_targets, str) else tuple(arch.record.lora_targets)
    assert spec.lora is not None and spec.lora.target_modules == targets and spec.trainable_params > 0
    trace = spec.activation_trace
    if preset in UNTRACED:  # the entry says why (its trace_inputs)
        assert trace is None and arch.call.trace_inputs(None, 8, 1, 8, torch.bfloat16) is None
        return
    assert trace is not None and trace.resolution == 64 and trace.forward_flops > 0
