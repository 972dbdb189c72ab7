"""QLoRA on CPU ranks with bitsandbytes' CPU 4-bit backend: train, resume exactly, export, generate.

The precision is pinned (fp32): ``auto`` depends on the CPU (bf16 where it runs natively), and
with it the storage dtype of the packed 4-bit weights under ZeRO-3 (``bnb_4bit_quant_storage``).
Where no backend exists (no bitsandbytes, or one without a CPU backend on a machine without
CUDA), check rule ZP007 refuses the run: tests/unit/models/test_quantization.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.integration.conftest import TINY_LLAMA, assert_ok, metrics, zeropipe, zeropipe_here

pytestmark = pytest.mark.integration

bitsandbytes = pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes: pip install 'zeropipe[qlora]'")


@pytest.fixture
def base_model(tmp_path):
    """A tiny pretrained-style directory (bf16 safetensors + tokenizer) for bitsandbytes to quantise."""
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


def qlora_run(make, base_model, name: str, stage: int):
    return make(
        name,
        model={"config": None, "path": str(base_model), "lora": {"r": 4, "alpha": 8, "dropout": 0.1}, "quantization": {}},
        train={"max_steps": 6, "lr": 2e-2, "save_every": 3, "log_every": 1},
        deepspeed={"zero_stage": stage, "precision": "fp32"},
    )


def resume_matches(config, run_dir, tmp_path) -> None:
    """Continued from its first checkpoint, a copy of the run repeats every later step bit for bit (dropout included)."""
    copy = tmp_path / "runs" / f"{run_dir.name}-resumed"
    shutil.copytree(run_dir, copy)
    assert_ok(zeropipe("train", config, f"run.name={copy.name}", "--resume", copy / "checkpoints" / "step_00000003"))
    expected = metrics(run_dir)
    resumed = metrics(copy)
    assert [row["step"] for row in resumed] == list(range(1, 7))
    for row, reference in zip(resumed[3:], expected[3:]):
        assert (row["loss"], row["grad_norm"]) == (reference["loss"], reference["grad_norm"]), row["step"]


def test_qlora_trains_resumes_exports_and_generates_on_cpu_ranks(tmp_run, base_model):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tmp_path, make = tmp_run
    # ZeRO-3: the packed weights stored in the model's dtype (fp32 here) and partitioned like the rest.
    config = qlora_run(make, base_model, "qlora3", 3)
    result = zeropipe("train", config)
    assert_ok(result)
    assert "nothing was started" not in result.stderr
    run_dir = tmp_path / "runs" / "qlora3"
    rows = metrics(run_dir)
    assert rows[-1]["loss"] < rows[0]["loss"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parameters"]["trainable"] < summary["parameters"]["total"] / 4
    resume_matches(config, run_dir, tmp_path)

    # The adapter alone, loadable by peft on the full-precision base it was trained from.
    adapter = tmp_path / "adapter"
    assert_ok(zeropipe_here("export", run_dir, "--out", adapter))
    assert all("lora_" in key for key in load_file(adapter / "adapter_model.safetensors"))
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_model.resolve())
    via_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32), adapter).eval()
    # Merged on request into that full-precision base: a plain transformers model, no bitsandbytes needed to load it.
    merged_dir = tmp_path / "merged"
    assert_ok(zeropipe_here("export", run_dir, "--out", merged_dir, "--merge"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any("absmax" in key or "quant" in key for key in load_file(merged_dir / "model.safetensors"))
    ids = torch.tensor([[1, 5, 9, 14, 20, 33]])
    with torch.no_grad():
        untouched = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).eval()(ids).logits
        assert torch.allclose(via_peft(ids).logits, merged(ids).logits, atol=1e-4)
        assert not torch.allclose(merged(ids).logits, untouched, atol=1e-4), "the adapter changed nothing"

    # Generating from the run answers as its merged export does (the adapters on the full-precision base).
    answers = [zeropipe_here("generate", source, "--prompt", "What is 1 + 2?", "--max-new-tokens", "4", "--json") for source in (run_dir, merged_dir)]
    for answer in answers:
        assert_ok(answer)
    assert json.loads(answers[0].stdout)["generations"] == json.loads(answers[1].stdout)["generations"]

    # ZeRO-2: the packed weights stay whole, in bitsandbytes' uint8; the same run trains and resumes exactly.
    config = qlora_run(make, base_model, "qlora2", 2)
    assert_ok(zeropipe("train", config))
    resume_matches(config, tmp_path / "runs" / "qlora2", tmp_path)


MEASURE_LOAD = """
import gc, json, sys
import torch
from peft import prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

def anonymous_rss():
    # Anonymous memory only: the memory-mapped checkpoint's file pages are the page cache's, not the model's.
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssAnon:"))

import bitsandbytes  # noqa: F401  (its import is not the model)
gc.collect()
before = anonymous_rss()
quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.uint8)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, quantization_config=quantization)
model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
gc.collect()
print(json.dumps({"held": anonymous_rss() - before}))
"""


def test_planned_4bit_base_matches_a_measured_cpu_load_of_real_layers(tmp_path):
    """Llama-3.2-1B's real layer and embedding shapes (2 of its 16 layers), loaded in 4-bit on CPU as a rank loads it."""
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM, LlamaConfig

    from zeropipe.config.load import validate_config
    from zeropipe.families.causal_lm.spec import causal_lm_config_spec
    from zeropipe.plan.memory import quantized_base_bytes

    catalog = json.loads((Path(__file__).parents[2] / "src/zeropipe/plan/catalog/llama-3.2-1b.json").read_text())["config"]
    fields = {key: value for key, value in catalog.items() if key not in ("architectures", "model_type")} | {"num_hidden_layers": 2}
    torch.manual_seed(0)
    base = tmp_path / "slice"
    AutoModelForCausalLM.from_config(LlamaConfig(**fields), dtype=torch.bfloat16).save_pretrained(base)
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    config = validate_config({"model": {"path": str(base), "lora": {"r": 8}, "quantization": {}}, "data": {"path": str(data)}, "hardware": {"gpus": 2}})
    planned = quantized_base_bytes(causal_lm_config_spec(config).quantized)

    measured = subprocess.run([sys.executable, "-c", MEASURE_LOAD, str(base)], capture_output=True, text=True, timeout=300)
    assert measured.returncode == 0, measured.stderr[-3000:]
    held = json.loads(measured.stdout.strip().splitlines()[-1])["held"]
    # The 4-bit layers with their constants and the fp32 tied embedding: 1.11 GB planned, 1.19 GB measured here.
    assert abs(held - planned) / planned < 0.15, (held, planned)
