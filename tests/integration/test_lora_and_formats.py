"""LoRA on a pretrained local checkpoint, and every instruction format through a real run."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.conftest import TINY_LLAMA, assert_ok, metrics, zeropipe, zeropipe_here

pytestmark = pytest.mark.integration


@pytest.fixture
def base_model(tmp_path):
    """A tiny pretrained-style HF directory (safetensors + tokenizer) saved by the test itself."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zeropipe.data.synthetic import generate_dataset
    from zeropipe.data.tokenizer import train_tokenizer

    data = generate_dataset("arithmetic", 200, 0, tmp_path / "corpus.jsonl")
    texts = [v for line in data.read_text().splitlines() for v in json.loads(line).values()]
    directory = tmp_path / "base"
    tokenizer = train_tokenizer(texts, 300, directory)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**fields, vocab_size=len(tokenizer)))
    # bf16 on disk, as real checkpoints are: training in bf16 then changes no frozen weight.
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_trains_adapters_only_and_exports_for_peft(tmp_run, base_model, stage):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tmp_path, make = tmp_run
    name = f"lora{stage}"
    config = make(
        name,
        model={"config": None, "path": str(base_model), "lora": {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}},
        train={"max_steps": 12, "lr": 2e-2},
        deepspeed={"zero_stage": stage},
    )
    result = zeropipe("train", config)
    assert_ok(result)
    run_dir = tmp_path / "runs" / name
    summary = json.loads((run_dir / "summary.json").read_text())
    trainable, total = summary["parameters"]["trainable"], summary["parameters"]["total"]
    # Per layer: q_proj 32->32 and v_proj 32->16 adapters of rank 4 (A: r x in, B: out x r).
    assert trainable == 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))
    assert trainable < total / 10
    rows = metrics(run_dir)
    assert rows[-1]["loss"] < rows[0]["loss"]

    adapter = tmp_path / f"adapter{stage}"
    assert_ok(zeropipe_here("export", run_dir, "--out", adapter, "--dtype", "fp32"))
    assert (adapter / "adapter_model.safetensors").is_file()
    assert all("lora_" in key for key in load_file(adapter / "adapter_model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter).eval()

    merged_dir = tmp_path / f"merged{stage}"
    assert_ok(zeropipe_here("export", run_dir, "--out", merged_dir, "--merge", "--dtype", "fp32"))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    ids = torch.tensor([[1, 5, 9, 14, 20, 33]])
    with torch.no_grad():
        untouched = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).eval()(ids).logits
        via_peft = peft_model(ids).logits
        via_merge = merged(ids).logits
    assert torch.allclose(via_peft, via_merge, atol=1e-4)
    assert not torch.allclose(via_peft, untouched, atol=1e-4), "the adapter changed nothing"

    if stage == 3:
        # model.lora.init_from on 2 ranks under ZeRO-3: a run continuing from this export (at another alpha, so lora_B is
        # rescaled) starts with the same adapter in its partitions: one step at a negligible lr, exported, gives the same logits.
        name = "continued3"
        config = make(
            name,
            model={"config": None, "path": str(base_model), "lora": {"r": 4, "alpha": 16, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"], "init_from": str(adapter)}},
            train={"max_steps": 1, "lr": 1e-12, "warmup_steps": 0},
            deepspeed={"zero_stage": 3},
        )
        assert_ok(zeropipe("train", config))
        continued_dir = tmp_path / "runs" / name
        recorded = json.loads((continued_dir / "run.json").read_text())["adapter_init"]
        assert recorded["layout"] == "peft" and recorded["rank"] == [4] and recorded["path"] == str((adapter / "adapter_model.safetensors").resolve())
        again = tmp_path / "adapter-continued"
        assert_ok(zeropipe_here("export", continued_dir, "--out", again, "--dtype", "fp32"))
        assert json.loads((again / "adapter_config.json").read_text())["lora_alpha"] == 16
        base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
        with torch.no_grad():
            via_continued = PeftModel.from_pretrained(base, again).eval()(ids).logits
        torch.testing.assert_close(via_continued, via_peft, rtol=0, atol=1e-5)


FORMATS = {
    "alpaca": lambda i: {"instruction": f"What is {i % 7} + 2?", "input": "", "output": str(i % 7 + 2)},
    "dolly": lambda i: {"instruction": "Add two to the number.", "context": str(i % 7), "response": str(i % 7 + 2)},
    "chat": lambda i: {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i % 7} plus 2?"}, {"role": "assistant", "content": str(i % 7 + 2)}]},
    "sharegpt": lambda i: {"conversations": [{"from": "human", "value": f"{i % 7} plus 2?"}, {"from": "gpt", "value": str(i % 7 + 2)}]},
    "text": lambda i: {"text": f"The number {i % 7} plus two is {i % 7 + 2}. " * 3},
}


def test_every_instruction_format_trains(tmp_run):
    """Each format through the launcher's data step (detected, tokenized, cached); two of them through real runs.

    What depends on the format happens in the launcher, before any rank starts: detection, the
    conversion to conversations or texts, and the token cache with its loss mask. That step runs
    in-process for all five (unit tests check each format's rendering and mask). The ranks read
    the same token cache whatever the format, so real 2-rank runs train on the two kinds of cache:
    conversations (alpaca) and chunked plain text, 25 s of CI each instead of five.
    """
    from zeropipe.config.load import load_config
    from zeropipe.families import family_of
    from zeropipe.rundir import RunDir

    tmp_path, make = tmp_run
    for fmt, make_record in FORMATS.items():
        data = tmp_path / f"{fmt}.jsonl"
        data.write_text("".join(json.dumps(make_record(i)) + "\n" for i in range(120)))
        config = make(fmt, data={"synthetic": None, "path": str(data)}, train={"max_steps": 6}, generate={"prompts": []})
        if fmt in ("alpaca", "text"):
            result = zeropipe("train", config)
            assert_ok(result)
            cache_dir = tmp_path / "runs" / fmt / "cache"
            rows = metrics(tmp_path / "runs" / fmt)
            assert len(rows) == 6 and rows[-1]["loss"] < rows[0]["loss"], (fmt, [r["loss"] for r in rows])
        else:
            run = RunDir(tmp_path / "prepared" / fmt)
            run.path.mkdir(parents=True)
            loaded = load_config(config)
            prepared = family_of(loaded.model).prepare_data(loaded, run, reuse=False)
            assert any(f"({fmt} format, detected)" in note for note in prepared.notes), prepared.notes
            assert prepared.examples >= 120
            cache_dir = run.cache
        cache = json.loads((cache_dir / "cache.json").read_text())
        assert cache["format"] == fmt and cache["examples"] >= 120
        # Instructions train on the answers only; texts on every token but each chunk's first.
        if fmt == "text":
            assert 0 <= cache["tokens"] - cache["loss_tokens"] <= cache["examples"], cache
        else:
            assert 0 < cache["loss_tokens"] <= cache["tokens"] / 2, cache
