"""QLoRA on a machine without CUDA: `zeropipe train` refuses before any rank or run directory exists."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import TINY_LLAMA, zeropipe

pytestmark = pytest.mark.integration


def test_qlora_without_cuda_stops_before_anything_starts(tmp_run):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    tmp_path, make = tmp_run
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": 300}))
    config = make("qlora", model={"config": None, "path": str(base), "lora": {"r": 8}, "quantization": {}}, deepspeed={"zero_stage": 3})
    result = zeropipe("train", config)
    assert result.returncode == 2, result.stderr
    assert "nothing was started" in result.stderr
    assert "ZP007 model.quantization: bitsandbytes' 4-bit kernels need CUDA" in result.stderr
    assert result.stderr.count("error ZP007") == 1, "one clear message, not one per symptom"
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        assert "pip install bitsandbytes" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists(), "no run directory may be left behind"
