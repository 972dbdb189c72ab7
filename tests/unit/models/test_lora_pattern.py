"""model.lora.target_modules as a regular expression (issue 27: axolotl's vision recipes), planned and built the same way."""

from __future__ import annotations

import pytest

from zeropipe.config.schema import LoraSection, ModelSection, RunConfig
from zeropipe.families import model_spec as spec_from_config

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
# axolotl's examples/qwen2_5-vl/lora-7b.yaml and the other vision recipes, as written there.
AXOLOTL_VISION = r"model.language_model.layers.[\d]+.(mlp|cross_attn|self_attn).(up|down|gate|q|k|v|o)_proj"


def test_a_pattern_adapts_exactly_the_layers_it_matches_in_plan_and_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeropipe.families.causal_lm.model import add_lora

    pattern = r"model.layers.[\d]+.self_attn.(q|v)_proj"
    section = ModelSection(config=LLAMA, tokenizer_vocab_size=300, lora=LoraSection(r=4, target_modules=pattern))
    spec = spec_from_config(RunConfig(model=section))
    # q and v (64 -> 64) in 2 layers; o_proj, k_proj and the MLP are left alone.
    assert spec.trainable_params == 2 * 2 * 4 * (64 + 64)
    model = add_lora(LlamaForCausalLM(LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"}, vocab_size=300)), section)
    adapted = {name.split(".lora_")[0] for name, p in model.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == spec.trainable_params
    assert adapted == {f"base_model.model.model.layers.{i}.self_attn.{proj}" for i in range(2) for proj in ("q_proj", "v_proj")}


def test_a_pattern_that_does_not_compile_names_the_key():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="neither auto, all-linear"):
        LoraSection(target_modules="model.layers.[")


def test_axolotls_vision_pattern_adapts_the_language_model_only():
    from zeropipe.families.vlm.model import lora_module_names
    from tests.unit.models.test_models_vlm import TINY_LLAVA, meta_model

    model = meta_model(TINY_LLAVA)
    names = lora_module_names(model, LoraSection(r=4, target_modules=AXOLOTL_VISION), ("language_model",))
    assert names and all(name.startswith("model.language_model.layers.") for name in names)
    assert {name.rsplit(".", 1)[-1] for name in names} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
