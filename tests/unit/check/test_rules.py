"""One config that triggers each rule and one that does not."""

import json
from pathlib import Path

import pytest

from zeropipe.check.rules import RULES
from zeropipe.check.run import build_context, check_config
from zeropipe.config.load import validate_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def make(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    base_model = tmp_path / "base"
    base_model.mkdir()
    (base_model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 64}))

    def build(ds_json=None, **sections):
        raw = {"model": {"config": {"model_type": "llama", "hidden_size": 32}}, "data": {"path": str(data)}, "hardware": {"gpus": 2}}
        for section, values in sections.items():
            raw.setdefault(section, {}).update(values)
        if raw["model"].get("path") == "BASE":
            raw["model"]["path"] = str(base_model)
            raw["model"].pop("config")
        if ds_json is not None:
            path = tmp_path / "ds.json"
            path.write_text(json.dumps(ds_json))
            raw.setdefault("deepspeed", {})["config_file"] = str(path)
        return validate_config(raw)

    return build


def rule_ids(config, accelerator=None):
    return {f.rule for f in check_config(config, accelerator=accelerator)}


def test_rule_ids_are_unique_and_documented():
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids)) >= 13
    assert all(r.link and r.title and r.severity in ("error", "warning") for r in RULES)


def test_clean_config_has_no_errors(make):
    findings = check_config(make())
    assert [f for f in findings if f.severity == "error"] == []


def test_zp001_pipeline_with_zero3(make):
    assert "ZP001" in rule_ids(make({"zero_optimization": {"stage": 3}, "pipeline": {"stages": 2}}))
    assert "ZP001" not in rule_ids(make({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}}))


def test_zp002_offload_param_below_stage3_in_user_json(make):
    findings = check_config(make({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}))
    assert any(f.rule == "ZP002" and "stage 3" in f.fix for f in findings)
    assert "ZP002" not in rule_ids(make({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}))


def test_zp003_optimizer_without_cpu_implementation(make):
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert "ZP003" in rule_ids(make({"zero_optimization": offload, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}))
    assert "ZP003" not in rule_ids(make({"zero_optimization": offload, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))


def test_zp004_loss_scale_keys_in_bf16(make):
    findings = check_config(make({"bf16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}, "zero_optimization": {"stage": 2}}))
    found = [f for f in findings if f.rule == "ZP004"]
    assert found and "initial_scale_power, loss_scale" in found[0].message and "Extra inputs are not permitted" in found[0].message
    assert "ZP009" not in {f.rule for f in findings}, "the same problem must not be reported twice"
    assert "ZP004" not in rule_ids(make({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))


def test_zp005_fp16_static_scale_of_one(make):
    fp16 = {"fp16": {"enabled": True, "loss_scale": 1}, "zero_optimization": {"stage": 2}}
    assert "ZP005" in rule_ids(make(fp16, deepspeed={"precision": "fp16"}), accelerator="cuda")
    fp16["fp16"]["loss_scale"] = 0
    assert "ZP005" not in rule_ids(make(fp16, deepspeed={"precision": "fp16"}), accelerator="cuda")


def test_zp006_device_map_and_low_cpu_mem_usage(make):
    ids = rule_ids(make(model={"path": "BASE", "load_kwargs": {"device_map": "auto", "low_cpu_mem_usage": True}}, deepspeed={"zero_stage": 3}))
    assert "ZP006" in ids
    assert "ZP006" not in rule_ids(make(model={"path": "BASE", "load_kwargs": {"revision": "main"}}, deepspeed={"zero_stage": 3}))


def test_zp007_qlora_storage_under_zero3(make, monkeypatch):
    monkeypatch.setattr("zeropipe.check.rules.bitsandbytes_version", lambda: (0, 43, 1))
    qlora = {"path": "BASE", "lora": {"r": 8}, "quantization": {"quant_storage": "uint8"}}
    findings = check_config(make(model=qlora, deepspeed={"zero_stage": 3}), accelerator="cuda")
    assert any(f.rule == "ZP007" and "quant_storage" in f.key for f in findings)
    qlora["quantization"]["quant_storage"] = "auto"
    assert "ZP007" not in rule_ids(make(model=qlora, deepspeed={"zero_stage": 3}), accelerator="cuda")
    # Without a GPU, a bitsandbytes without its CPU backend is refused plainly.
    findings = check_config(make(model=qlora, deepspeed={"zero_stage": 3}))
    assert any(f.rule == "ZP007" and "no CPU 4-bit backend" in f.message for f in findings)


def test_qlora_storage_auto_follows_compute_dtype_under_zero3(make):
    import torch

    from zeropipe.families.causal_lm.model import quantization_kwargs

    config = make(model={"path": "BASE", "lora": {"r": 8}, "quantization": {}})
    assert quantization_kwargs(config.model, "bf16", zero_stage=3)["bnb_4bit_quant_storage"] == torch.bfloat16
    assert quantization_kwargs(config.model, "bf16", zero_stage=2)["bnb_4bit_quant_storage"] == torch.uint8
    assert quantization_kwargs(config.model, "bf16", zero_stage=3)["bnb_4bit_compute_dtype"] == torch.bfloat16


def test_zp008_batch_triple(make):
    bad = {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    findings = check_config(make(bad))
    assert any(f.rule == "ZP008" and "7 != micro-batch 2" in f.message for f in findings)
    assert "ZP008" not in rule_ids(make({**bad, "train_batch_size": 4}))


def test_zp009_deepspeed_own_schema(make):
    findings = check_config(make({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5}}))
    assert any(f.rule == "ZP009" and "reduce_bucket_sise" in f.key for f in findings)
    assert "ZP009" not in rule_ids(make({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5}}))


def test_zp010_fp16_on_cpu(make):
    assert "ZP010" in rule_ids(make(deepspeed={"precision": "fp16"}), accelerator="cpu")
    assert "ZP010" not in rule_ids(make(deepspeed={"precision": "bf16"}), accelerator="cpu")


def test_context_reports_world_size_and_stage(make):
    context = build_context(make(deepspeed={"zero_stage": 3}), world_size=5)
    assert context.zero_stage == 3 and context.ds_config["train_batch_size"] == 5


def test_zp011_plan_exceeds_host_ram_names_the_numbers(make):
    big = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}
    findings = check_config(make(model={"config": big}, deepspeed={"zero_stage": 2}))
    found = [f for f in findings if f.rule == "ZP011"]
    assert found and found[0].message.startswith("does not fit: ") and "GiB" in found[0].message, found
    assert "ZP011" not in rule_ids(make())


def test_zp012_zero3_for_a_small_model(make):
    assert "ZP012" in rule_ids(make(deepspeed={"zero_stage": 3}))
    assert "ZP012" not in rule_ids(make(deepspeed={"zero_stage": 2}))


def test_zp013_activations_dominate(make):
    long_sequences = {"max_seq_len": 8192}
    ids = rule_ids(make(data=long_sequences, train={"micro_batch_size": 16}))
    assert "ZP013" in ids
    assert "ZP013" not in rule_ids(make(data=long_sequences, train={"micro_batch_size": 16}, model={"gradient_checkpointing": True}))


def test_small_figures_are_shown_in_mib_and_small_activations_not_warned_about(make):
    from zeropipe.check.planning import readable_bytes

    assert readable_bytes(3 * 1024**2) == "3 MiB" and readable_bytes(2.5 * 1024**3) == "2.5 GiB"
    findings = [f for f in check_config(make(deepspeed={"zero_stage": 3})) if f.rule == "ZP012"]
    assert findings and "0.0 G" not in findings[0].message, findings
    # A tiny model whose activations are most of its (tiny) memory: nothing worth checkpointing.
    tiny = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300}
    assert "ZP013" not in rule_ids(make(model={"config": tiny}, data={"max_seq_len": 512}, train={"micro_batch_size": 16}))


def test_accepted_warnings_are_not_repeated_but_errors_stand(make):
    config = make(deepspeed={"zero_stage": 3}, run={"accept_warnings": ["ZP012", "ZP010"]})
    assert "ZP012" not in {f.rule for f in check_config(config)}
    fp16 = make(deepspeed={"precision": "fp16"}, run={"accept_warnings": ["ZP010"]})
    assert "ZP010" in {f.rule for f in check_config(fp16, accelerator="cpu")}


def test_the_quickstart_checks_without_warnings():
    from zeropipe.config.load import load_config

    findings = check_config(load_config(ROOT / "examples" / "quickstart.yaml"), world_size=2, accelerator="cpu")
    assert findings == [], [f.render() for f in findings]


def test_loha_under_zero3_is_refused_with_the_stages_and_kind_that_train(make):
    findings = [f for f in check_config(make(model={"config": {"model_type": "llama", "hidden_size": 32}, "lora": {"kind": "loha"}}, deepspeed={"zero_stage": 3})) if f.rule == "ZP021"]
    assert len(findings) == 1 and findings[0].key == "model.lora.kind" and "zero_stage 2" in findings[0].fix and "lokr" in findings[0].fix
    for kind, stage in (("loha", 2), ("lokr", 3), ("dora", 3)):
        assert "ZP021" not in rule_ids(make(model={"config": {"model_type": "llama", "hidden_size": 32}, "lora": {"kind": kind}}, deepspeed={"zero_stage": stage}))
