"""`zeropipe generate` on a real 2-rank LoRA run: from the run directory, its adapter export and its merged export."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.conftest import TINY_LLAMA, assert_ok, zeropipe, zeropipe_here

pytestmark = pytest.mark.integration

PROMPTS = ["What is 1 + 2?", "What is 7 - 3?"]


@pytest.fixture
def base_model(tmp_path):
    """A tiny pretrained-style directory (safetensors + tokenizer), so the adapter export names a loadable base."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zeropipe.data.synthetic import generate_dataset
    from zeropipe.data.tokenizer import train_tokenizer

    data = generate_dataset("arithmetic", 200, 0, tmp_path / "corpus.jsonl")
    texts = [v for line in data.read_text().splitlines() for v in json.loads(line).values()]
    directory = tmp_path / "base"
    tokenizer = train_tokenizer(texts, 300, directory)
    torch.manual_seed(0)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    AutoModelForCausalLM.from_config(LlamaConfig(**fields, vocab_size=len(tokenizer))).save_pretrained(directory)
    return directory


def test_run_directory_and_its_exports_generate_the_same_text(tmp_run, base_model):
    from zeropipe.families import export_run, generate, load_model

    tmp_path, make = tmp_run
    config = make(
        "gen",
        model={"config": None, "path": str(base_model), "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}},
        train={"max_steps": 6, "save_every": 3, "lr": 3e-2},
        generate={"prompts": []},
    )
    assert_ok(zeropipe("train", config))
    run_dir = tmp_path / "runs" / "gen"

    # Sampled with a seed: equal outputs then need equal distributions at every step, not only the
    # same argmax (a barely trained LoRA model answers most greedy prompts with end-of-sequence).
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    result = zeropipe_here("generate", run_dir, *prompts, "--max-new-tokens", "6", "--temperature", "1.0", "--seed", "3", "--json")
    assert_ok(result)
    from_run = json.loads(result.stdout)
    assert from_run["kind"] == "run" and from_run["checkpoint"] == "step_00000006"
    assert [g["prompt"] for g in from_run["generations"]] == PROMPTS
    outputs = [g["output"] for g in from_run["generations"]]
    assert all(outputs), "a sampled answer is empty"

    adapter = export_run(run_dir, tmp_path / "adapter", dtype="fp32")
    merged = export_run(run_dir, tmp_path / "merged", dtype="fp32", merge=True)
    for source, kind in ((adapter, "adapter"), (merged, "hf")):
        loaded = load_model(source, device="cpu")
        assert loaded.source.kind == kind
        assert [g.output for g in generate(loaded, PROMPTS, max_new_tokens=6, temperature=1.0, seed=3)] == outputs, source

    earlier = load_model(run_dir, checkpoint="3", device="cpu")
    assert earlier.source.checkpoint.tag == "step_00000003"
    assert len(generate(earlier, PROMPTS[:1], max_new_tokens=6)) == 1
