"""The planner counts QLoRA as bitsandbytes and transformers hold it (issue 31, defect 2).

A 4-bit base: the linear layers two weights per byte plus their quantization constants, every
other frozen weight in fp32 after prepare_model_for_kbit_training, and the real loading path:
transformers builds a quantized model outside deepspeed.zero.Init, so every rank first holds the
whole 4-bit base on its device, even under ZeRO-3.
"""

from __future__ import annotations

import json

import pytest

from zeropipe.config.load import validate_config
from zeropipe.families.causal_lm.spec import causal_lm_config_spec
from zeropipe.plan import plan_run
from zeropipe.plan.hardware import GIB, Hardware
from zeropipe.plan.memory import Choice, quantized_base_bytes
from zeropipe.plan.totals import per_gpu_terms

CATALOG = "src/zeropipe/plan/catalog"


def five_24gb_gpus(count: int = 5) -> Hardware:
    return Hardware(gpus_per_node=count, gpu_memory_bytes=24 * GIB, nodes=1, host_ram_bytes=64 * GIB, gpu_name="NVIDIA GeForce RTX 4090", accelerator="cuda")


@pytest.fixture
def run_config(tmp_path):
    def make(name: str, quantized: bool, stage: int = 3):
        from pathlib import Path

        source = json.loads((Path(__file__).parents[3] / CATALOG / f"{name}.json").read_text())
        directory = tmp_path / name
        directory.mkdir(exist_ok=True)
        (directory / "config.json").write_text(json.dumps(source["config"]))
        data = tmp_path / "train.jsonl"
        data.write_text('{"instruction": "hi", "output": "yo"}\n')
        model = {"path": str(directory), "lora": {"r": 16}, "gradient_checkpointing": True}
        if quantized:
            model["quantization"] = {}
        raw = {"model": model, "data": {"path": str(data), "max_seq_len": 2048}, "deepspeed": {"precision": "bf16", "zero_stage": stage}, "hardware": {"gpus": 5}}
        return validate_config(raw)

    return make


def test_the_plan_of_a_qlora_run_is_not_the_plan_of_its_lora_run(run_config):
    hardware = five_24gb_gpus()
    plans = {}
    for quantized in (False, True):
        config = run_config("llama-3.1-8b", quantized)
        plans[quantized] = plan_run(config, hardware, causal_lm_config_spec(config))
    assert plans[False].to_dict() != plans[True].to_dict()
    lora, qlora = (plans[q].configured for q in (False, True))
    assert "frozen 4-bit base" in [t.name for t in qlora.per_gpu_terms]
    assert "frozen 4-bit base" not in [t.name for t in lora.per_gpu_terms]
    assert plans[True].to_dict()["model"]["quantized"]["params_4bit"] > 6.9e9


def test_llama_8b_qlora_base_is_4bit_layers_plus_fp32_embeddings(run_config):
    spec = causal_lm_config_spec(run_config("llama-3.1-8b", True))
    base = spec.quantized
    # Embeddings and lm_head (2 x 128,256 x 4,096), 65 RMSNorms of 4,096: the weights left out of 4-bit.
    assert base.params_upcast == 2 * 128_256 * 4096 + 65 * 4096
    assert base.params_4bit + base.params_upcast == spec.frozen_base_params
    whole = quantized_base_bytes(base)
    # 6.98B weights at half a byte, ~1/64 byte of double-quantized constants each, 1.05B fp32 weights.
    assert whole == pytest.approx(base.params_4bit * (0.5 + 1 / 64) + base.params_upcast * 4, rel=0.001)
    assert 7.2 * GIB < whole < 7.35 * GIB


def test_zero3_counts_the_whole_4bit_base_every_rank_loads(run_config):
    """Llama-3.1-70B QLoRA on 4 x 24 GB: ZeRO-3 shares are small, but each rank first loads the whole base (~41 GiB)."""
    config = run_config("llama-3.1-70b", True)
    spec = causal_lm_config_spec(config)
    hardware = five_24gb_gpus(4)
    terms = {t.name: t for t in per_gpu_terms(spec, hardware, Choice(zero_stage=3, precision="bf16", gradient_checkpointing=True))}
    loading = terms["whole 4-bit base while loading (QLoRA)"]
    assert loading.phase == "model loading"
    assert loading.bytes + terms["frozen 4-bit base"].bytes + terms["frozen weights upcast to fp32"].bytes == quantized_base_bytes(spec.quantized)
    assert quantized_base_bytes(spec.quantized) > 40 * GIB
    result = plan_run(config, hardware, spec)
    assert not result.configured.fits
    assert "whole 4-bit base while loading (QLoRA)" in result.configured.why_not
    assert not any(c.fits for c in result.candidates), "no ZeRO setting avoids the whole-model load"


def test_host_ram_of_a_qlora_load_is_one_tensor_per_rank_not_the_model(run_config):
    config = run_config("qwen2.5-32b", True)
    result = plan_run(config, five_24gb_gpus(), causal_lm_config_spec(config))
    (loading,) = [t for t in result.configured.per_node_terms if t.name == "model loading peak"]
    assert loading.bytes < 10 * GIB and "quantizes it on the rank's device" in loading.explanation
