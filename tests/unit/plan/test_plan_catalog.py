"""Catalog models are counted on the meta device and agree with their published sizes."""

from __future__ import annotations

import json

import pytest

from zeropipe.config.schema import LoraSection, ModelSection, RunConfig
from zeropipe.errors import ZeroPipeError
from zeropipe.families import model_spec as spec_from_config
from zeropipe.plan.model_spec import catalog_names, spec_from_catalog, spec_from_params, spec_from_path


def test_catalog_has_the_architectures_users_train():
    names = set(catalog_names())
    assert {"llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "gemma-2-2b", "gemma-2-9b"} <= names
    assert {"gemma-2-27b", "gemma-3-27b", "mistral-7b", "sdxl", "flux.1-dev"} <= names


@pytest.mark.parametrize(
    "name,published",
    [("llama-3.1-8b", 8.03e9), ("llama-3.1-70b", 70.6e9), ("qwen2.5-7b", 7.62e9), ("qwen2.5-14b", 14.7e9), ("qwen2.5-32b", 32.8e9)]
    + [("gemma-2-2b", 2.61e9), ("gemma-2-9b", 9.24e9), ("gemma-2-27b", 27.2e9), ("gemma-3-27b", 27.4e9), ("mistral-7b", 7.25e9)]
    + [("llama-3.2-1b", 1.24e9), ("sdxl", 2.57e9), ("flux.1-dev", 11.9e9)],
)
def test_counts_match_published_sizes(spec_of, name, published):
    spec = spec_of(name)
    assert spec.total_params == pytest.approx(published, rel=0.005)
    assert spec.trainable_params == spec.total_params


def test_diffusion_models_carry_their_frozen_encoders_and_a_traced_activation_count(spec_of):
    sdxl = spec_of("sdxl")
    frozen = {m.name.split(" ")[0]: m.params for m in sdxl.frozen_models}
    assert frozen["text_encoder"] == pytest.approx(123e6, rel=0.01)
    assert frozen["text_encoder_2"] == pytest.approx(695e6, rel=0.01)
    assert frozen["vae"] == pytest.approx(83.7e6, rel=0.01)
    trace = sdxl.activation_trace
    assert trace is not None and trace.resolution == 1024
    # Checkpointing keeps only block inputs; a block recomputed is smaller than the whole.
    assert trace.checkpointed_bytes < trace.saved_bytes / 5
    assert 0 < trace.largest_block_bytes < trace.saved_bytes


def test_lora_count_follows_the_linear_layers_shapes(spec_of):
    spec = spec_of("llama-3.1-8b", 16)
    # q and o: 4096 -> 4096; k and v: 4096 -> 1024 (8 KV heads); r x (in + out) each, 32 layers.
    per_layer = 16 * (4096 + 4096) * 2 + 16 * (4096 + 1024) * 2
    assert spec.trainable_params == 32 * per_layer
    assert spec.total_params == 8_030_261_248 + 32 * per_layer
    assert spec.lora is not None and spec.lora.r == 16


def test_spec_from_config_inline_with_lora_and_tokenizer_vocab():
    section = ModelSection(
        config={"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
        tokenizer_vocab_size=300,
        lora=LoraSection(r=4, target_modules="all-linear"),
    )
    spec = spec_from_config(RunConfig(model=section))
    assert spec.vocab_size == 300
    # all-linear: q, k, v, o (64 -> 64) and gate, up (64 -> 128), down (128 -> 64), per layer, lm_head excluded.
    assert spec.trainable_params == 2 * (4 * 4 * (64 + 64) + 2 * 4 * (64 + 128) + 4 * (128 + 64))


def test_spec_from_path_reads_a_config_json(tmp_path):
    config = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    by_dir, by_file = spec_from_path(tmp_path), spec_from_path(tmp_path / "config.json")
    assert by_dir.total_params == by_file.total_params > 0
    assert by_dir.family == "causal_lm" and by_dir.layers == 2


def test_unknown_names_and_paths_say_what_is_available(tmp_path):
    with pytest.raises(ZeroPipeError, match="llama-3.1-8b"):
        spec_from_catalog("llama-9")
    with pytest.raises(ZeroPipeError, match="no config.json"):
        spec_from_path(tmp_path)
    with pytest.raises(ZeroPipeError, match="positive"):
        spec_from_params(0)


def test_catalog_names_are_forgiving():
    assert spec_from_catalog("Llama-3.1-8B").total_params == spec_from_catalog("llama3.1-8b").total_params


@pytest.mark.parametrize("kind", ["dora", "lokr", "loha"])
def test_each_adapter_kind_is_counted_as_peft_builds_it(kind):
    """The planner's trainable count of DoRA/LoKr/LoHa equals the trainable weights peft adds to the real (tiny) model."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zeropipe.models.adapters import peft_adapter_config

    fields = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    lora = LoraSection(kind=kind, r=4, target_modules="all-linear")
    spec = spec_from_config(RunConfig(model=ModelSection(config={"model_type": "llama", **fields}, tokenizer_vocab_size=300, lora=lora)))
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(LlamaConfig(**fields, vocab_size=300)), peft_adapter_config(lora, "all-linear", task_type="CAUSAL_LM"))
    built = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert spec.trainable_params == built
    plain = spec_from_config(RunConfig(model=ModelSection(config={"model_type": "llama", **fields}, tokenizer_vocab_size=300, lora=LoraSection(r=4, target_modules="all-linear"))))
    assert spec.trainable_params != plain.trainable_params
