"""Qwen-Image 2.1 in the planner's catalog: counted from its published configs on the meta device (sources in the entry's "source")."""

from __future__ import annotations

import json

import pytest

from tests.unit.plan.test_plan_kandinsky_krea_ernie_catalog import meta_count
from zeropipe.plan.model_spec import CATALOG_DIR, catalog_names


def test_the_catalog_entry_counts_qwen_image_21s_published_size():
    """'A 7B single-stream DiT': its config counts 7.12B (within 2%). The text encoder's width must be the transformer's text input."""
    assert "qwen-image-2.1" in catalog_names()
    entry = json.loads((CATALOG_DIR / "qwen-image-2.1.json").read_text())
    assert entry["architecture"] == "qwen-image-2.1" and entry["published_params"] == pytest.approx(7.0e9)
    # Counted from one and two of its identical blocks (building all 32 on the meta device takes 6 s on a loaded CI core).
    trained = entry["trained"]
    one, two = (meta_count({**trained, "config": {**trained["config"], "num_layers": layers}}) for layers in (1, 2))
    assert one + (trained["config"]["num_layers"] - 1) * (two - one) == pytest.approx(7.0e9, rel=0.02)
    frozen = {component["name"].split(" ")[0]: component for component in entry["frozen"]}
    assert entry["trained"]["config"]["context_in_dim"] == frozen["text_encoder"]["config"]["text_config"]["hidden_size"]
    assert entry["trained"]["config"]["in_channels"] == frozen["vae"]["config"]["z_dim"]


def test_the_planner_plans_the_tiny_preset_with_its_lora_targets_and_says_it_cannot_trace_it():
    """Its transformer lays out the joint sequence from its masks' values, which the meta device does not have: no activation term (the entry says why)."""
    import torch

    from zeropipe.config.schema import RunConfig
    from zeropipe.families.diffusion.entries import architecture_for_preset
    from zeropipe.families.diffusion.spec import diffusion_config_spec

    arch = architecture_for_preset("tiny-qwen-image-2.1")
    data = {"synthetic": {"task": "shapes"}, "images": {"resolution": 64, "bucket_step": 32}}
    spec = diffusion_config_spec(RunConfig.model_validate({"model": {"config": {"pipeline": "tiny-qwen-image-2.1"}, "lora": {"r": 4}}, "data": data}))
    assert spec.lora is not None and spec.lora.target_modules == tuple(arch.record.lora_targets) and spec.trainable_params > 0
    assert spec.activation_trace is None and arch.call.trace_inputs(None, 8, 1, 8, torch.bfloat16) is None
