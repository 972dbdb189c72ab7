"""QLoRA's configuration logic, without a GPU: what BitsAndBytesConfig receives for each precision and ZeRO stage."""

from __future__ import annotations

import pytest
import torch

from zeropipe.check.run import check_config
from zeropipe.config.load import validate_config
from zeropipe.families.causal_lm.model import quantization_kwargs

DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture
def qlora(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 64}')
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')

    def make(precision="bf16", zero_stage=3, **quantization):
        raw = {
            "model": {"path": str(base), "lora": {"r": 8}, "quantization": quantization},
            "data": {"path": str(data)},
            "deepspeed": {"precision": precision, "zero_stage": zero_stage},
            "hardware": {"gpus": 2},
        }
        return validate_config(raw)

    return make


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_storage_auto_is_the_model_dtype_under_zero3_only(qlora, precision, zero_stage):
    kwargs = quantization_kwargs(qlora(precision, zero_stage).model, precision, zero_stage)
    assert kwargs["bnb_4bit_compute_dtype"] == DTYPE[precision]
    assert kwargs["bnb_4bit_quant_storage"] == (DTYPE[precision] if zero_stage == 3 else torch.uint8)
    assert (kwargs["load_in_4bit"], kwargs["bnb_4bit_quant_type"], kwargs["bnb_4bit_use_double_quant"]) == (True, "nf4", True)


def test_explicit_dtypes_are_kept(qlora):
    config = qlora("bf16", 3, compute_dtype="fp32", quant_storage="bf16", quant_type="fp4", double_quant=False)
    kwargs = quantization_kwargs(config.model, "bf16", 3)
    assert kwargs["bnb_4bit_compute_dtype"] == torch.float32
    assert kwargs["bnb_4bit_quant_storage"] == torch.bfloat16
    assert (kwargs["bnb_4bit_quant_type"], kwargs["bnb_4bit_use_double_quant"]) == ("fp4", False)
    # A compute dtype of its own does not move the storage under ZeRO-3: the storage follows the model.
    assert quantization_kwargs(qlora("bf16", 3, compute_dtype="fp32").model, "bf16", 3)["bnb_4bit_quant_storage"] == torch.bfloat16


def test_transformers_accepts_the_arguments_without_a_gpu(qlora):
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(**quantization_kwargs(qlora("bf16", 3).model, "bf16", 3))
    assert config.load_in_4bit and config.bnb_4bit_quant_storage == torch.bfloat16


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zp007_storage_must_match_the_model_dtype_under_zero3(qlora, monkeypatch, precision):
    monkeypatch.setattr("zeropipe.check.rules.bitsandbytes_version", lambda: (0, 50, 2))
    other = "fp16"
    storage = [f for f in check_config(qlora(precision, 3, quant_storage=other), accelerator="cuda") if f.rule == "ZP007"]
    assert [f.key for f in storage] == ["model.quantization.quant_storage"]
    assert f"model's dtype {precision}" in storage[0].message and f"quant_storage: auto (or {precision})" in storage[0].fix
    assert not [f for f in check_config(qlora(precision, 2, quant_storage=other), accelerator="cuda") if f.rule == "ZP007"]
    assert not [f for f in check_config(qlora(precision, 3), accelerator="cuda") if f.rule == "ZP007"]


def test_zp007_refuses_only_where_no_4bit_backend_exists(qlora, monkeypatch):
    def findings(accelerator, installed):
        monkeypatch.setattr("zeropipe.check.rules.bitsandbytes_version", lambda: installed)
        return [f for f in check_config(qlora("fp32", 3), accelerator=accelerator) if f.rule == "ZP007"]

    # bitsandbytes with its CPU 4-bit backend: QLoRA runs on CPU ranks as on GPUs.
    assert findings("cpu", (0, 50, 2)) == [] and findings("cuda", (0, 50, 2)) == []
    # An older bitsandbytes has CUDA kernels only: fine on GPUs, refused on CPU ranks with the version to install.
    assert findings("cuda", (0, 43, 1)) == []
    (old,) = findings("cpu", (0, 43, 1))
    assert old.key == "model.quantization" and "0.43.1 has no CPU 4-bit backend" in old.message and "bitsandbytes>=0.47" in old.fix
    # None installed: one finding on either machine, naming the install.
    for accelerator in ("cpu", "cuda"):
        (missing,) = findings(accelerator, None)
        assert "not installed" in missing.message and missing.fix.startswith("pip install 'bitsandbytes>=0.47'")


def test_zp007_reads_the_installed_version_without_importing_bitsandbytes(monkeypatch):
    import sys

    from zeropipe.check.rules import bitsandbytes_version, version_tuple

    assert version_tuple("0.50.2") == (0, 50, 2) and version_tuple("0.47.0.dev0") == (0, 47, 0)
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    installed = bitsandbytes_version()
    assert "bitsandbytes" not in sys.modules
    assert installed is None or installed >= (0, 43)
