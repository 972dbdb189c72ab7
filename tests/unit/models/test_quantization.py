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


def test_one_word_names_the_storage_and_old_sections_stay_4bit(qlora):
    assert qlora("bf16", 3).model.quantization.storage == "nf4"  # {} as before: QLoRA
    assert qlora("bf16", 3, quant_type="fp4").model.quantization.storage == "fp4"
    fp8 = validate_config({**_raw(qlora), "model": {**_raw(qlora)["model"], "quantization": "fp8"}}).model.quantization
    assert (fp8.storage, fp8.is_fp8, fp8.scale) == ("fp8", True, "channel")
    assert qlora("bf16", 3, format="fp8_e5m2", scale="tensor").model.quantization.storage == "fp8_e5m2"
    with pytest.raises(Exception, match="fp8_e4m3.*not a storage format: one of nf4, fp4, int8, fp8, fp8_e5m2"):
        validate_config({**_raw(qlora), "model": {**_raw(qlora)["model"], "quantization": "fp8_e4m3"}})


def _raw(qlora) -> dict:
    config = qlora("bf16", 3)
    return {"model": {"path": config.model.path, "lora": {"r": 8}}, "data": {"path": config.data.path}, "deepspeed": {"precision": "bf16", "zero_stage": 3}, "hardware": {"gpus": 2}}


def test_check_refuses_a_full_fine_tune_of_an_fp8_base_and_int8_under_zero3(qlora):
    raw = _raw(qlora)
    full = validate_config({**raw, "model": {"path": raw["model"]["path"], "quantization": "fp8"}})
    (finding,) = [f for f in check_config(full, accelerator="cpu") if f.rule == "ZP007"]
    assert "full fine-tune cannot update weights stored in fp8" in finding.message and "add model.lora" in finding.fix
    lora = validate_config({**raw, "model": {**raw["model"], "quantization": "fp8"}})
    assert not [f for f in check_config(lora, accelerator="cpu") if f.rule == "ZP007"]  # fp8 needs no bitsandbytes, runs on CPU ranks
    int8 = validate_config({**raw, "model": {**raw["model"], "quantization": "int8"}})
    assert any("ZeRO-3 does not partition" in f.message and "fp8" in f.fix for f in check_config(int8, accelerator="cuda") if f.rule == "ZP007")


def test_an_fp8_base_is_offered_to_diffusion_runs_and_vlms_and_bitsandbytes_to_diffusion_below_zero3_only():
    from zeropipe.families import family_named

    raw = {"model": {"config": {"pipeline": "tiny-wan"}, "lora": {"r": 4}, "quantization": "fp8"}, "data": {"synthetic": {"task": "shapes"}}}
    config = validate_config(raw)
    assert family_named("diffusion").config_problems(config) == []
    nf4 = validate_config({**raw, "model": {**raw["model"], "quantization": "nf4"}, "deepspeed": {"zero_stage": 3}})
    assert any("model.quantization: fp8" in why for _, why in family_named("diffusion").config_problems(nf4))
    vlm = validate_config({"model": {"config": {"model_type": "llava"}, "lora": {"r": 4}, "quantization": "fp8"}, "data": {"synthetic": {"task": "shapes"}}})
    assert family_named("vlm").config_problems(vlm) == []  # the language model's block linears in fp8 (tests/unit/families/test_vlm_fp8_base.py)
    vlm_nf4 = validate_config({"model": {"config": {"model_type": "llava"}, "lora": {"r": 4}, "quantization": "nf4"}, "data": {"synthetic": {"task": "shapes"}}})
    assert any("set model.quantization: fp8" in why for _, why in family_named("vlm").config_problems(vlm_nf4))
