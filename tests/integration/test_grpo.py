"""GRPO under ZeRO-3 on 2 CPU ranks with LoRA: the reward rises, the run resumes exactly and exports.

The task is the quickstart's arithmetic (single-digit sums and differences, 200 questions) with
a checkable answer: the ``numeric`` reward is 1 when the completion's number is the right one.
The base is a tiny Llama briefly fine-tuned here on the questions (150 steps, a few seconds):
it answers with numbers, right about a quarter of the time when sampled (more often greedily), so
most groups' rewards differ and GRPO has something to learn from. The policy's completions are sampled inside the loop
with the weights gathered once per round; beta > 0 keeps the KL to the base (adapters off) in play.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from tests.integration.conftest import TINY_LLAMA, assert_ok, metrics, write_config, zeropipe, zeropipe_here

pytestmark = pytest.mark.integration

STEPS, SAVE_EVERY = 40, 20
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]}


def questions() -> list[tuple[str, str]]:
    """The quickstart's arithmetic questions on the digits 0-4: 50 of them, so that 40 steps see each one several times."""
    return [(f"What is {a} {op} {b}?", str(a + b if op == "+" else a - b)) for a in range(5) for b in range(5) for op in "+-"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The prompts (TRL's prompt/answer layout) and a briefly fine-tuned tiny base with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeropipe.data.tokenize import render_example
    from zeropipe.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("grpo")
    pairs = questions()
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in pairs))
    tokenizer = train_tokenizer([t for pair in pairs for t in pair], 300, root / "base")
    torch.manual_seed(0)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**fields, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id))
    examples = [render_example(tokenizer, [{"role": "user", "content": q}, {"role": "assistant", "content": a}]) for q, a in pairs]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rng, threads = random.Random(0), torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest, and leaves the other cores to the other tests
    try:
        for _ in range(150):
            batch = rng.sample(examples, 32)
            width = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
            labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in batch])
            model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(root / "base")
    return root


def run_config(root, name: str) -> dict:
    return {
        "run": {"name": name, "output_dir": str(root / "runs"), "seed": 7},
        "model": {"path": str(root / "base"), "lora": LORA},
        "data": {"path": str(root / "prompts.jsonl"), "max_seq_len": 32},
        "train": {"max_steps": STEPS, "micro_batch_size": 8, "lr": 5e-3, "schedule": "constant", "log_every": 5, "save_every": SAVE_EVERY, "keep_last": 4},
        "deepspeed": {"zero_stage": 3, "precision": "fp32"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": []},
        "grpo": {"num_generations": 8, "max_completion_length": 4, "beta": 0.04, "loss_type": "dapo",
                 "rewards": [{"kind": "numeric"}, {"kind": "format", "pattern": r"^\s*-?\d+\s*$", "weight": 0.0, "name": "just_a_number"}]},
    }


def test_grpo_raises_the_reward_under_zero3_resumes_exactly_and_exports(setup, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = setup
    config = write_config(tmp_path, run_config(root, "grpo_lora"), "grpo_lora.yaml")
    result = zeropipe("train", config)
    assert_ok(result)
    assert "grpo (dapo): 50 prompts (50 with answers)" in result.stderr
    run_dir = root / "runs" / "grpo_lora"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first = sum(r["rewards/numeric/mean"] for r in rows[:10]) / 10
    last = sum(r["rewards/numeric/mean"] for r in rows[-10:]) / 10
    print(f"mean reward (rank 0's completions): steps 1-10 {first:.3f}, steps {STEPS - 9}-{STEPS} {last:.3f}")
    assert first < 0.5 and last > first + 0.05, (first, last)
    assert rows[0]["kl"] == 0 and rows[-1]["kl"] > 0  # LoRA starts as the base (its B is zero), then moves away from it
    assert all(0 <= r["completions/mean_length"] <= 4 and "reward_std" in r and "clip_ratio/region_mean" in r for r in rows)
    samples = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} >= {1, STEPS} and all("numeric" in s["rewards"] for s in samples)

    # Exact resume from the middle checkpoint: the same samples (seeded per rank and micro-step), losses and rewards.
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    assert_ok(zeropipe("train", config, "--resume", cut / "checkpoints" / f"step_{SAVE_EVERY:08d}"))
    again = {row["step"]: row for row in metrics(cut)}
    for row in rows[SAVE_EVERY:]:
        keys = ("loss", "grad_norm", "reward", "kl", "completions/mean_length")
        assert [again[row["step"]][k] for k in keys] == [row[k] for k in keys], row["step"]

    out = tmp_path / "export"
    assert_ok(zeropipe_here("export", run_dir, "--out", out))
    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    before = sampled_accuracy(base, out)
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32), out).eval()
    after = sampled_accuracy(trained, out)
    print(f"sampled accuracy on the 50 questions x 16 samples: base {before:.3f}, after GRPO {after:.3f}")
    assert after > before + 0.05, (before, after)


def sampled_accuracy(model, tokenizer_dir, samples: int = 16) -> float:
    """The share of right answers among ``samples`` completions of every question, sampled at temperature 1 as in training."""
    from transformers import AutoTokenizer

    from zeropipe.data.tokenize import render_prompt
    from zeropipe.engine.generation import sample_completions

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    right = total = 0
    for question, answer in questions():
        ids = torch.tensor([render_prompt(tokenizer, [{"role": "user", "content": question}])])
        completions, mask, _ = sample_completions(model, ids, torch.ones_like(ids), num_generations=samples, max_new_tokens=4, temperature=1.0, top_p=1.0,
                                                  top_k=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=total)
        texts = tokenizer.batch_decode(completions.masked_fill(mask == 0, tokenizer.pad_token_id).tolist(), skip_special_tokens=True)
        right += sum(text.strip() == answer for text in texts)
        total += samples
    return right / total
