"""Ideogram 4 in the planner's catalog: counted from its published config on the meta device, and traced with its own packed inputs.

Sources are in the catalog entry's "source"; a catalog entry traced at 1024 px takes tens of seconds on a CI core,
so the trace is checked on the tiny preset and the counts on the catalog's configs.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.plan.test_plan_kandinsky_krea_ernie_catalog import meta_count
from zeropipe.plan.model_spec import CATALOG_DIR, catalog_names


def test_the_catalog_entry_counts_ideogram_4s_published_size():
    """9.28B (fal's ideogram-v4-instant card). Qwen3-VL-8B-Instruct counts 8.14B without its untied head (8.77B with it, its card's size):
    not rebuilt here (seconds of CI); the tapped layers' width must match the transformer's text input."""
    assert "ideogram-4" in catalog_names()
    entry = json.loads((CATALOG_DIR / "ideogram-4.json").read_text())
    assert entry["published_params"] == pytest.approx(9.28e9) and entry["architecture"] == "ideogram4"
    assert meta_count(entry["trained"]) == pytest.approx(9.28e9, rel=0.001)
    frozen = {component["name"].split(" ")[0]: component for component in entry["frozen"]}
    # llm_features_dim is the 13 tapped layers of the text encoder's width.
    assert entry["trained"]["config"]["llm_features_dim"] == 13 * frozen["text_encoder"]["config"]["text_config"]["hidden_size"]


def test_the_planner_plans_ideogram_4_with_its_own_lora_targets_and_says_it_cannot_trace_it():
    """Its rotary embedding opens torch.autocast on the meta device, which torch refuses: the plan has no activation term (the entry says why)."""
    from zeropipe.config.schema import RunConfig
    from zeropipe.families.diffusion.entries import architecture_for_preset
    from zeropipe.families.diffusion.spec import diffusion_config_spec

    arch = architecture_for_preset("tiny-ideogram4")
    data = {"synthetic": {"task": "shapes"}, "images": {"resolution": 64, "bucket_step": 16}}
    spec = diffusion_config_spec(RunConfig.model_validate({"model": {"config": {"pipeline": "tiny-ideogram4"}, "lora": {"r": 4}}, "data": data}))
    assert spec.lora is not None and spec.lora.target_modules == tuple(arch.record.lora_targets) and spec.trainable_params > 0
    assert spec.activation_trace is None and arch.call.trace_inputs(None, 8, 1, 8, torch.bfloat16) is None
