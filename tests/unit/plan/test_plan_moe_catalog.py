"""Mixture-of-experts catalog entries: total and active weights against the published sizes, the MoE block as ZeRO-3's gather."""

from __future__ import annotations

import json

import pytest

from zeropipe.plan.model_spec import CATALOG_DIR

MOE_MODELS = ["qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-20b", "gpt-oss-120b", "mixtral-8x7b"]


@pytest.mark.parametrize("name", MOE_MODELS)
def test_total_and_active_weights_match_the_published_sizes(spec_of, name):
    entry = json.loads((CATALOG_DIR / f"{name}.json").read_text())
    spec = spec_of(name)
    moe = spec.moe
    assert spec.total_params == pytest.approx(entry["published_params"], rel=0.005)
    active = moe.active_params
    if entry.get("published_active_excludes") == "embedding":
        # OpenAI counts the weights a token is multiplied by: the input embedding is a lookup.
        active -= spec.vocab_size * spec.hidden_size
    # Published active counts are rounded to one decimal of a billion (3.3B, 22B, 12.9B).
    assert active == pytest.approx(entry["published_active_params"], rel=0.02)
    assert moe.expert_params < spec.total_params and moe.moe_layers == spec.layers
    # Under ZeRO-3 a whole MoE block (router and every expert) is gathered at once: the largest gather.
    assert spec.largest_layer_params == moe.leaf_params and "ZeRO-3 leaf" in spec.largest_layer_name
    # Each token goes through top-k experts: the activation formula's MLP is that many experts wide.
    assert spec.block.intermediate == moe.active_experts * moe.expert_intermediate and spec.block.gated_mlp


def test_qwen3_30b_a3b_counts():
    from zeropipe.plan.model_spec import spec_from_catalog

    spec = spec_from_catalog("qwen3-30b-a3b")
    # 48 layers x 128 experts x 3 x 2048 x 768 expert weights; one block: those of a layer plus its 128 x 2048 router.
    assert spec.moe.expert_params == 48 * 128 * 3 * 2048 * 768
    assert spec.moe.leaf_params == 128 * 3 * 2048 * 768 + 128 * 2048
    assert (spec.moe.experts, spec.moe.active_experts) == (128, 8)
