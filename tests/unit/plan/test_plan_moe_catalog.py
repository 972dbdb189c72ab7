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
    assert spec.to_dict()["moe"]["active_experts"] == moe.active_experts
    # Each token goes through top-k experts: the activation formula's MLP is that many experts wide.
    assert spec.block.intermediate == moe.active_experts * moe.expert_intermediate and spec.block.gated_mlp


def test_qwen3_30b_a3b_counts():
    from zeropipe.plan.model_spec import spec_from_catalog

    spec = spec_from_catalog("qwen3-30b-a3b")
    # 48 layers x 128 experts x 3 x 2048 x 768 expert weights; one block: those of a layer plus its 128 x 2048 router.
    assert spec.moe.expert_params == 48 * 128 * 3 * 2048 * 768
    assert spec.moe.leaf_params == 128 * 3 * 2048 * 768 + 128 * 2048
    assert (spec.moe.experts, spec.moe.active_experts) == (128, 8)


def test_lora_on_experts_is_counted_as_peft_builds_it():
    """The planner's trainable count of a config with model.lora.target_parameters equals peft's on the real model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from zeropipe.config.schema import RunConfig
    from zeropipe.families.causal_lm.spec import causal_lm_config_spec
    from zeropipe.models.common import model_config

    fields = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 8,
              "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64}
    config = RunConfig.model_validate({"model": {"config": fields, "lora": {"r": 4, "target_parameters": "experts"}}, "data": {"synthetic": {}}})
    spec = causal_lm_config_spec(config)
    model = get_peft_model(AutoModelForCausalLM.from_config(model_config(config.model)), LoraConfig(
        r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    assert spec.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert spec.total_params == sum(p.numel() for p in model.parameters())
