"""The planner counts an fp8 base as models.quantized stores it: one byte per block-linear weight, scales whole on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeropipe.config.load import validate_config
from zeropipe.families.causal_lm.spec import causal_lm_config_spec
from zeropipe.plan import plan_run
from zeropipe.plan.hardware import GIB, Hardware
from zeropipe.plan.memory import Choice
from zeropipe.plan.totals import per_gpu_terms

CATALOG = Path(__file__).parents[3] / "src/zeropipe/plan/catalog"


def gpus(count: int = 5, ram: int = 64) -> Hardware:
    return Hardware(gpus_per_node=count, gpu_memory_bytes=24 * GIB, nodes=1, host_ram_bytes=ram * GIB, gpu_name="NVIDIA GeForce RTX 4090", accelerator="cuda")


@pytest.fixture
def llm(tmp_path):
    def make(name: str, quantization=None, stage=3, **deepspeed):
        directory = tmp_path / name
        directory.mkdir(exist_ok=True)
        (directory / "config.json").write_text(json.dumps(json.loads((CATALOG / f"{name}.json").read_text())["config"]))
        data = tmp_path / "train.jsonl"
        data.write_text('{"instruction": "hi", "output": "yo"}\n')
        model = {"path": str(directory), "lora": {"r": 16}, "gradient_checkpointing": True}
        if quantization:
            model["quantization"] = quantization
        raw = {"model": model, "data": {"path": str(data), "max_seq_len": 2048}, "deepspeed": {"precision": "bf16", "zero_stage": stage, **deepspeed}, "hardware": {"gpus": 5}}
        return validate_config(raw)

    return make


def test_the_fp8_base_is_one_byte_per_block_linear_weight_and_halves_the_frozen_share(llm):
    spec = causal_lm_config_spec(llm("llama-3.1-8b", "fp8"))
    base = spec.fp8_base
    # Llama 3.1 8B: 32 layers x (4 attention + 3 MLP projections); embeddings and lm_head stay bf16.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert base.params_fp8 == 32 * per_layer and base.channels == 32 * (4096 * 2 + 1024 * 2 + 14336 * 2 + 4096)
    choice = Choice(zero_stage=3, precision="bf16", gradient_checkpointing=True)
    fp8 = {t.name: t.bytes for t in per_gpu_terms(spec, gpus(), choice)}
    plain = {t.name: t.bytes for t in per_gpu_terms(causal_lm_config_spec(llm("llama-3.1-8b")), gpus(), choice)}
    assert fp8["frozen fp8 base"] == pytest.approx(base.params_fp8 / 5 + 4 * base.channels, abs=8)
    assert fp8["frozen base weights (16-bit)"] == pytest.approx((spec.frozen_base_params - base.params_fp8) * 2 / 5, rel=1e-4)
    # The embeddings and lm_head (1.05B weights) stay bf16: the frozen share is 0.56 of bf16's, not half.
    stored = fp8["frozen fp8 base"] + fp8["frozen base weights (16-bit)"]
    assert 0.5 < stored / plain["frozen base weights (16-bit)"] < 0.6
    assert fp8["dequantized weight (fp8 base)"] == 4096 * 14336 * 2


def test_the_plan_offers_fp8_when_it_is_what_makes_the_lora_run_fit(llm):
    """Qwen2.5-32B LoRA on 5 x 24 GB with 64 GB of RAM, ZeRO-3 with parameters offloaded: 61 GiB of bf16 weights do not fit the host; 8 bits do."""
    plain = plan_run(llm("qwen2.5-32b", offload_param="cpu", offload_optimizer="cpu"), gpus(), causal_lm_config_spec(llm("qwen2.5-32b", offload_param="cpu", offload_optimizer="cpu")))
    assert not plain.configured.fits
    (offer,) = [note for note in plain.notes if "model.quantization: fp8" in note]
    assert "makes this run fit" in offer
    config = llm("qwen2.5-32b", "fp8", offload_param="cpu", offload_optimizer="cpu")
    fp8 = plan_run(config, gpus(), causal_lm_config_spec(config))
    assert fp8.configured.fits and not any("model.quantization: fp8" in note for note in fp8.notes)
    offloaded = {t.name: t.bytes for t in fp8.configured.per_node_terms}["offloaded parameters"]
    assert offloaded < 0.6 * {t.name: t.bytes for t in plain.configured.per_node_terms}["offloaded parameters"]
