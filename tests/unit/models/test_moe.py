"""Mixture-of-experts blocks, expert weights and router settings found from transformers' own classes (models.moe)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from zeropipe.config.schema import LoraSection
from zeropipe.models.moe import configure_moe, expert_parameter_names, moe_blocks, moe_shape, router_figures, tokens_per_expert

TINY = {
    "qwen3_moe": dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64),
    "gpt_oss": dict(hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, vocab_size=64, sliding_window=8),
    "mixtral": dict(hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=64),
}
BLOCKS = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "gpt_oss": "GptOssMLP", "mixtral": "MixtralSparseMoeBlock"}


def tiny(model_type: str, **changes):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[model_type](**{**TINY[model_type], **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_blocks_and_expert_weights_are_found_from_the_models_own_classes(model_type):
    config, model = tiny(model_type)
    blocks = moe_blocks(model)
    assert [name for name, _ in blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert {type(block).__name__ for _, block in blocks} == {BLOCKS[model_type]}
    assert expert_parameter_names(model) == ["experts.down_proj", "experts.gate_up_proj"]
    assert moe_shape(config).experts == 8 and moe_shape(config).active == 2


def test_a_dense_model_has_no_blocks_and_its_config_is_left_alone():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)
    assert moe_blocks(LlamaForCausalLM(config)) == [] and moe_shape(config) is None
    assert configure_moe(config, 0.5, "auto") == [] and not hasattr(config, "router_aux_loss_coef")


def test_router_aux_loss_follows_the_model_or_the_user_and_enters_the_loss():
    config, _ = tiny("qwen3_moe")
    notes = configure_moe(config, None, "auto")
    assert config.output_router_logits and config.router_aux_loss_coef == pytest.approx(0.001)
    assert "router auxiliary loss x 0.001 added to the loss (the model's config)" in notes
    configure_moe(config, 0.0, "eager")
    assert not config.output_router_logits and config._experts_implementation == "eager"

    config, model = tiny("mixtral")
    configure_moe(config, 0.5, "auto")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        with_aux = model(input_ids=ids, labels=ids)
        without = model(input_ids=ids, labels=ids, output_router_logits=False)
    figures = router_figures(with_aux)
    # The model's own loss: LM loss + coefficient x its load-balancing loss (top-2 of 8: about 2 when balanced).
    assert float(with_aux.loss) == pytest.approx(float(without.loss) + 0.5 * float(figures["router_aux_loss"]), rel=1e-5)
    counts = tokens_per_expert(with_aux, 8, 2)
    assert int(counts.sum()) == 2 * 10 * 2


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_grouped_and_batched_experts_equal_the_per_expert_loop(implementation):
    config, model = tiny("qwen3_moe")
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        loop = model(input_ids=ids).logits
        model.set_experts_implementation(implementation)
        fused = model(input_ids=ids).logits
    assert torch.allclose(loop, fused, atol=1e-5)


def test_lora_on_experts_takes_plain_lora_without_dropout():
    section = LoraSection(target_parameters="experts")
    assert section.dropout == 0.0
    with pytest.raises(ValidationError, match="takes no dropout: set model.lora.dropout: 0"):
        LoraSection(target_parameters="experts", dropout=0.1)
    with pytest.raises(ValidationError, match="plain LoRA only"):
        LoraSection(target_parameters=["experts.gate_up_proj"], kind="dora")


def test_gpt_oss_mxfp4_experts_load_dequantized_for_training(tmp_path):
    """gpt-oss's published checkpoints hold the experts as MXFP4 blocks and scales: transformers dequantizes them on CPU."""
    import json

    from safetensors.torch import load_file, save_file

    from zeropipe.config.schema import ModelSection
    from zeropipe.families.causal_lm.model import build_model
    from zeropipe.models.common import model_config

    experts, hidden, intermediate = 4, 64, 32  # MXFP4 packs 32 values per block: widths are multiples of 32
    config, model = tiny("gpt_oss", hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts, head_dim=16, num_hidden_layers=1)
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows, columns = (2 * intermediate, hidden) if "gate_up" in name else (hidden, intermediate)
        del state[name]
        # FP4 code 2 is 1.0 (e2m1), in both nibbles of every byte; scale 127 is 2^0.
        state[name + "_blocks"] = torch.full((experts, rows, columns // 32, 16), 0x22, dtype=torch.uint8)
        state[name + "_scales"] = torch.full((experts, rows, columns // 32), 127, dtype=torch.uint8)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    written = json.loads((tmp_path / "config.json").read_text())
    written["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(written))

    section = ModelSection(path=str(tmp_path), attn_implementation="eager")
    loaded = build_model(section, model_config(section), "fp32")
    weights = loaded.model.layers[0].mlp.experts.gate_up_proj
    assert weights.dtype == torch.float32 and tuple(weights.shape) == (experts, hidden, 2 * intermediate)
    assert torch.all(weights == 1.0), "every MXFP4 value was 1.0 x 2^0"
    loss = loaded(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss
    loss.backward()
    assert weights.grad is not None
