"""GRPO under ZeRO-3 on 2 CPU ranks, with LoRA and as a full fine-tune: the reward rises, the run resumes exactly and exports.

The task is the quickstart's arithmetic (single-digit sums and differences, 200 questions) with
a checkable answer: the ``numeric`` reward is 1 when the completion's number is the right one.
The base is a tiny Llama briefly fine-tuned here on the questions (150 steps, a few seconds):
it answers with numbers, right about a quarter of the time when sampled (more often greedily), so
most groups' rewards differ and GRPO has something to learn from. The policy's completions are sampled inside the loop
with the weights gathered once per round; beta > 0 keeps the KL to the reference in play: the base with
the adapters off (LoRA), a frozen copy of the base partitioned over the two ranks (full). The full run
also trains twice on each generation (num_iterations 2, the clip against the sampling policy in play).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.conftest import TINY_LLAMA, assert_ok, metrics, write_config, zeropipe, zeropipe_here

pytestmark = pytest.mark.integration

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


# mode: (steps, save_every, model section's extra keys, train's, grpo's)
MODES = {
    "lora": (40, 30, {"lora": LORA}, {"lr": 5e-3}, {"loss_type": "dapo"}),
    "full": (40, 30, {}, {"lr": 3e-3}, {"loss_type": "dapo"}),
}


def run_config(root, name: str, mode: str) -> dict:
    steps, save_every, model, train, grpo = MODES[mode]
    return {
        "run": {"name": name, "output_dir": str(root / "runs"), "seed": 7},
        "model": {"path": str(root / "base"), **model},
        "data": {"path": str(root / "prompts.jsonl"), "max_seq_len": 32},
        "train": {"max_steps": steps, "micro_batch_size": 8, "schedule": "constant", "log_every": 5, "save_every": save_every, "keep_last": 4, **train},
        "deepspeed": {"zero_stage": 3, "precision": "fp32"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": []},
        "grpo": {"num_generations": 8, "max_completion_length": 4, "beta": 0.04, **grpo,
                 "rewards": [{"kind": "numeric"}, {"kind": "format", "pattern": r"^\s*-?\d+\s*$", "weight": 0.0, "name": "just_a_number"}]},
    }


@pytest.mark.parametrize("mode", list(MODES))
def test_grpo_raises_the_reward_under_zero3_resumes_exactly_and_exports(setup, tmp_path, mode):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = setup
    steps, save_every = MODES[mode][:2]
    config = write_config(tmp_path, run_config(root, f"grpo_{mode}", mode), f"grpo_{mode}.yaml")
    result = zeropipe("train", config)
    assert_ok(result)
    assert "50 prompts (50 with answers)" in result.stderr
    run_dir = root / "runs" / f"grpo_{mode}"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    first = sum(r["rewards/numeric/mean"] for r in rows[:10]) / 10
    last = sum(r["rewards/numeric/mean"] for r in rows[-10:]) / 10
    print(f"{mode}: mean reward (rank 0's completions): steps 1-10 {first:.3f}, steps {steps - 9}-{steps} {last:.3f}")
    assert first < 0.5 and last > first + 0.05, (first, last)
    # The policy starts as the reference (LoRA's B is zero; the full copy is the base), then moves away from it.
    assert rows[0]["kl"] == 0 and rows[-1]["kl"] > 0
    assert all(0 <= r["completions/mean_length"] <= 4 and "reward_std" in r and "clip_ratio/region_mean" in r for r in rows)
    samples = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} >= {1} and all("numeric" in s["rewards"] for s in samples)
    if mode == "full":  # the reference: the base again, half of its weights on each of the two ranks
        log = (run_dir / "logs" / "rank0.log").read_text()
        assert "KL reference: a frozen copy of" in log and "17,904 of its parameters on each rank" in log  # 35,808 in all

    # Exact resume from the checkpoint at step 30 of 40: the same samples (seeded per rank and micro-step), losses and rewards
    # over the ten steps after it, as the full fine-tune's (LoRA resumed from step 20 before: ten more steps trained for no other check).
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    assert_ok(zeropipe("train", config, "--resume", cut / "checkpoints" / f"step_{save_every:08d}"))
    again = {row["step"]: row for row in metrics(cut)}
    for row in rows[save_every:]:
        keys = ("loss", "grad_norm", "reward", "kl", "completions/mean_length")
        assert [again[row["step"]][k] for k in keys] == [row[k] for k in keys], row["step"]

    out = tmp_path / "export"
    assert_ok(zeropipe_here("export", run_dir, "--out", out))
    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    before = sampled_accuracy(base, out)
    if mode == "lora":
        trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32), out).eval()
    else:
        trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    after = sampled_accuracy(trained, out)
    print(f"{mode}: sampled accuracy on the 50 questions x 16 samples: base {before:.3f}, after GRPO {after:.3f}")
    assert after > before + 0.05, (before, after)


REWARDS = """\
def accuracy_reward(completions, answer, **kwargs):
    return [1.0 if text.strip() == right else 0.0 for text, right in zip(completions, answer)]
"""


def test_axolotls_grpo_recipe_trains_directly_twice_on_each_generation_and_resumes_exactly(setup, tmp_path):
    """axolotl's GRPO recipe (docs/rlhf.qmd's, with its reward module, model and data replaced by tiny stand-ins), trained as
    written under ZeRO-3 as a full fine-tune with num_iterations 2: each generation is trained on for two steps, the second
    clipped against the sampling policy's log-probs kept at generation; a resume at a generation boundary is exact."""
    root = setup
    (tmp_path / "rewards.py").write_text(REWARDS)
    deepspeed = Path(__file__).parents[1] / "fixtures" / "peers" / "axolotl" / "deepspeed_configs" / "zero3.json"
    config = tmp_path / "grpo.yml"
    config.write_text(f"""\
base_model: {root / 'base'}
rl: grpo
trl:
  beta: 0.04
  max_completion_length: 4
  num_generations: 8
  num_iterations: 2
  loss_type: grpo
  epsilon_high: 0.28
  reward_funcs: ["rewards.accuracy_reward"]
  reward_weights: [1.0]
datasets:
  - path: {root / 'prompts.jsonl'}
    type: rewards.prompt_transform
sequence_len: 32
micro_batch_size: 64
gradient_accumulation_steps: 1
max_steps: 8
save_steps: 4
learning_rate: 3e-3
lr_scheduler: constant
optimizer: adamw_torch
bf16: false
fp16: false
seed: 7
logging_steps: 1
deepspeed: {deepspeed}
output_dir: {tmp_path / 'out'}
""")
    result = zeropipe("train", config, cwd=tmp_path)  # rewards.py is importable from the folder the recipe is trained in
    assert_ok(result)
    written = yaml.safe_load((tmp_path / "grpo.zeropipe.yaml").read_text())
    assert written["grpo"]["num_iterations"] == 2 and written["train"]["micro_batch_size"] == 8  # 64 completions = 8 prompts x 8
    assert written["grpo"]["rewards"] == [{"kind": "function", "function": "rewards:accuracy_reward", "weight": 1.0}]
    run_dir = tmp_path / "out"
    rows = metrics(run_dir)
    assert json.loads((run_dir / "ds_config.json").read_text())["zero_optimization"]["stage"] == 3 and len(rows) == 8
    samples = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 3, 5, 7}  # completions are sampled on every other step only
    assert all(rows[i]["reward"] == rows[i + 1]["reward"] for i in range(0, 8, 2))  # the second pass reports its generation's rewards
    # The first pass samples with the very weights it trains: ratio 1, nothing clipped; the second trains a policy that moved.
    assert all(rows[i]["clip_ratio/region_mean"] == 0 for i in range(0, 8, 2)), [r["clip_ratio/region_mean"] for r in rows]
    assert any(rows[i]["clip_ratio/region_mean"] > 0 for i in range(1, 8, 2)), [r["clip_ratio/region_mean"] for r in rows]
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    assert_ok(zeropipe("train", tmp_path / "grpo.zeropipe.yaml", "--resume", cut / "checkpoints" / "step_00000004", cwd=tmp_path))
    again = {row["step"]: row for row in metrics(cut)}
    keys = ("loss", "grad_norm", "reward", "kl", "clip_ratio/region_mean")
    assert all([again[row["step"]][k] for k in keys] == [row[k] for k in keys] for row in rows[4:])


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
