"""An fp8 frozen base under ZeRO-3 on 2 CPU ranks: LoRA trains on it, resumes exactly, and its export loads onto the bf16 base.

The base is a bf16 checkpoint each rank quantizes while streaming its own rows (models.quantized);
under ZeRO-3 the fp8 bytes are what is partitioned and gathered. The precision is pinned (fp32
compute) so that the figures are the same on every CPU.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.conftest import TINY_LLAMA, assert_ok, metrics, zeropipe, zeropipe_here
from tests.integration.test_qlora import resume_matches

pytestmark = pytest.mark.integration


@pytest.fixture
def base_model(tmp_path):
    """A tiny pretrained-style directory (bf16 safetensors + tokenizer)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zeropipe.data.synthetic import generate_dataset
    from zeropipe.data.tokenizer import train_tokenizer

    data = generate_dataset("arithmetic", 200, 0, tmp_path / "corpus.jsonl")
    texts = [v for line in data.read_text().splitlines() for v in json.loads(line).values()]
    directory = tmp_path / "base"
    tokenizer = train_tokenizer(texts, 300, directory)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**fields, vocab_size=len(tokenizer))).to(torch.bfloat16).save_pretrained(directory)
    return directory


def test_lora_on_an_fp8_base_trains_resumes_and_exports_under_zero3_and_trains_under_zero2(tmp_run, base_model):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tmp_path, make = tmp_run
    config = make(
        "fp8z3",
        model={"config": None, "path": str(base_model), "lora": {"r": 4, "alpha": 8, "dropout": 0.1}, "quantization": "fp8"},
        train={"max_steps": 6, "lr": 2e-2, "save_every": 3, "log_every": 1},
        deepspeed={"zero_stage": 3, "precision": "fp32"},
    )
    result = zeropipe("train", config)
    assert_ok(result)
    run_dir = tmp_path / "runs" / "fp8z3"
    rows = metrics(run_dir)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert "linear layers of the blocks stored as fp8" in (run_dir / "logs" / "rank0.log").read_text()
    resume_matches(config, run_dir, tmp_path)

    # The adapter alone loads with peft onto the bf16 base it was trained from, and changes its answers.
    adapter = tmp_path / "adapter"
    assert_ok(zeropipe_here("export", run_dir, "--out", adapter))
    assert all("lora_" in key for key in load_file(adapter / "adapter_model.safetensors"))
    via_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32), adapter).eval()
    ids = torch.tensor([[1, 5, 9, 14, 20, 33]])
    with torch.no_grad():
        untouched = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).eval()(ids).logits
        assert not torch.allclose(via_peft(ids).logits, untouched, atol=1e-4), "the adapter changed nothing"

    # ZeRO-2: every rank holds the whole fp8 base (per-tensor scales here); the same LoRA trains.
    config = make(
        "fp8z2",
        model={"config": None, "path": str(base_model), "lora": {"r": 4, "alpha": 8}, "quantization": {"format": "fp8", "scale": "tensor"}},
        train={"max_steps": 4, "lr": 2e-2, "save_every": 100, "log_every": 1},
        deepspeed={"zero_stage": 2, "precision": "fp32"},
    )
    assert_ok(zeropipe("train", config))
    rows = metrics(tmp_path / "runs" / "fp8z2")
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"]
