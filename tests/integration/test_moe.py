"""Mixture-of-experts LLMs (Qwen3-MoE, gpt-oss) trained with LoRA on 2 CPU ranks: ZeRO-3 with leaf blocks, ZeRO-2, resume, export.

The tiny models are the real transformers classes with the published configs' shapes scaled down
(docs/moe.md): 16 experts, 2 per token, so that the two ranks' batches reach different experts.
Five 2-rank runs, shared by the assertions: Qwen3-MoE ZeRO-3 and its resume, Qwen3-MoE ZeRO-2,
gpt-oss ZeRO-3 and its resume.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from tests.integration.conftest import assert_ok, metrics, tiny_run_config, write_config, zeropipe, zeropipe_here

pytestmark = pytest.mark.integration

# Qwen3-30B-A3B's shape, scaled down: head_dim apart from hidden/heads, q/k norms, 128 -> 16 experts, top-8 -> top-2.
TINY_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.01,
}
# gpt-oss-20b's shape, scaled down: alternating sliding/full attention with sinks, biased experts, 32 -> 16 experts, top-4 -> top-2.
TINY_GPT_OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 32,
    "intermediate_size": 16,
    "num_local_experts": 16,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "sliding_window": 8,
    "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.01,
}
STEPS, SAVE_AT = 6, 3
LORA = {"r": 4, "alpha": 8, "target_parameters": "experts"}  # attention (auto) and the experts' 3-D weights


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """get(model, stage) -> the run directory of a finished tiny MoE LoRA run on 2 ranks; made on first use."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from zeropipe.data.synthetic import generate_dataset
    from zeropipe.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("moe")
    data = generate_dataset("arithmetic", 200, 0, root / "corpus.jsonl")
    texts = [v for line in data.read_text().splitlines() for v in json.loads(line).values()]
    made: dict[tuple[str, int], tuple] = {}

    def base(model: str):
        directory = root / f"base-{model}"
        if not directory.is_dir():
            tokenizer = train_tokenizer(texts, 300, directory)
            fields = dict(TINY_QWEN3_MOE if model == "qwen3_moe" else TINY_GPT_OSS)
            torch.manual_seed(0)
            config = CONFIG_MAPPING[fields.pop("model_type")](**fields, vocab_size=len(tokenizer))
            AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        return directory

    def get(model: str, stage: int):
        if (model, stage) not in made:
            name = f"{model}-z{stage}"
            config = tiny_run_config(
                root,
                name=name,
                model={"config": None, "path": str(base(model)), "lora": dict(LORA), "attn_implementation": "eager" if model == "gpt_oss" else "sdpa"},
                train={"max_steps": STEPS, "save_every": SAVE_AT, "keep_last": 5, "lr": 2e-2, "log_every": 1},
                deepspeed={"zero_stage": stage, "precision": "fp32"},
                generate={"prompts": []},
            )
            path = write_config(root, config, f"{name}.yaml")
            result = zeropipe("train", path)
            assert_ok(result)
            made[model, stage] = (path, root / "runs" / name, result)
        return made[model, stage]

    get.base = base
    return get


def rank0_log(run_dir) -> str:
    return (run_dir / "logs" / "rank0.log").read_text()


@pytest.mark.parametrize("model", ["qwen3_moe", "gpt_oss"])
def test_moe_lora_trains_under_zero3_with_leaf_blocks_and_resumes_exactly(moe_runs, tmp_path, model):
    config, run_dir, result = moe_runs(model, 3)
    log = rank0_log(run_dir)
    block = {"qwen3_moe": "Qwen3MoeSparseMoeBlock", "gpt_oss": "GptOssMLP"}[model]
    assert f"ZeRO-3 leaf modules (each gathered whole): {block}" in log
    assert "router auxiliary loss x 0.01 added to the loss" in result.stderr
    # The two ranks' first batches reached the experts in different proportions: the routing ZeRO-3's leaves make safe.
    counts = {int(rank): json.loads(values) for rank, values in re.findall(r"tokens per expert, rank (\d)'s first batch \(first MoE layer\): (\[[^\]]*\])", log)}
    assert set(counts) == {0, 1} and counts[0] != counts[1], counts
    assert all(sum(c) > 0 for c in counts.values())
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["router_aux_loss"] > 0 for r in rows), "the router's auxiliary loss is logged every step"
    assert rows[-1]["loss"] < rows[0]["loss"]
    summary = json.loads((run_dir / "summary.json").read_text())
    # Adapters on the attention and on the experts (peft's target_parameters): more than the attention's alone.
    attention_only = 2 * (4 * 32 + 32 * 4) + 2 * 2 * (4 * 32 + 16 * 4)  # q and o: 32 -> 32; k and v: 32 -> 16; 2 layers
    assert summary["parameters"]["trainable"] > attention_only

    # Resume from the middle checkpoint in a copy: the same losses, step for step.
    copy = tmp_path / "cut"
    shutil.copytree(run_dir, copy)
    tag = f"step_{SAVE_AT:08d}"
    resumed = zeropipe("train", config, "--resume", copy / "checkpoints" / tag)
    assert_ok(resumed)
    assert f"from {tag} (step {SAVE_AT})" in resumed.stderr
    again = {r["step"]: r["loss"] for r in metrics(copy)}
    for row in rows[SAVE_AT:]:
        assert again[row["step"]] == pytest.approx(row["loss"], rel=1e-6, abs=1e-6), (row["step"], again[row["step"]], row["loss"])


def test_moe_zero3_losses_equal_zero2(moe_runs):
    _, zero3, _ = moe_runs("qwen3_moe", 3)
    _, zero2, _ = moe_runs("qwen3_moe", 2)
    assert "leaf" not in rank0_log(zero2), "ZeRO-2 gathers nothing: no leaves"
    three, two = metrics(zero3), metrics(zero2)
    assert len(three) == len(two) == STEPS
    for a, b in zip(three, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5), (a["step"], a["loss"], b["loss"])
        assert a["router_aux_loss"] == pytest.approx(b["router_aux_loss"], rel=1e-4)


@pytest.mark.parametrize("model", ["qwen3_moe", "gpt_oss"])
def test_moe_lora_exports_load_in_peft_and_transformers(moe_runs, tmp_path, model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, run_dir, _ = moe_runs(model, 3)
    base = moe_runs.base(model)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert_ok(zeropipe_here("export", run_dir, "--out", adapter, "--dtype", "fp32"))
    assert_ok(zeropipe_here("export", run_dir, "--out", merged, "--merge", "--dtype", "fp32"))
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(adapter_config["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    ids = torch.tensor([[1, 5, 9, 14, 20, 33, 40, 41]])
    with torch.no_grad():
        untouched = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(ids).logits
        via_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()(ids).logits
        via_merge = AutoModelForCausalLM.from_pretrained(merged).eval()(ids).logits
    assert torch.allclose(via_peft, via_merge, atol=1e-4)
    assert not torch.allclose(via_peft, untouched, atol=1e-4), "the adapters changed nothing"
