"""DPO under ZeRO-3 on 2 CPU ranks, with LoRA (reference: adapters off) and full weights (reference: precomputed).

The task's preferred answer is knowable: the right sum of two digits over a wrong one. On the
training pairs DPO's accuracy (its implicit reward of the right answer over the wrong one)
ends >= 0.9 and the model's own preference rises from near chance to >= 0.9 (LoRA and full), and
the reward margin grows; the full run resumes exactly from its middle checkpoint (the precomputed
reference read back, not recomputed from trained weights); both exports load with transformers
/ peft.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from tests.integration.conftest import TINY_LLAMA, assert_ok, metrics, write_config, zeropipe, zeropipe_here

pytestmark = pytest.mark.integration

PAIRS, SAVE_EVERY = 16, 8
STEPS = {True: 24, False: 16}  # LoRA (at a lower learning rate: from 1e-2 up it ends lower) needs a few more steps
# LoRA's targets: every linear layer, the output layer (lm_head) included. The base prefers the wrong sum by
# about 5.4 nats on the pairs whose right sum has one token more ("12" over "9"). Adapters on the blocks alone
# ("all-linear") left those two pairs wrong (0.875 of the pairs) after 24 steps at every setting tried (lr 3e-3
# to 2e-2, beta 0.1 to 4, rank 16 to 64); with the output layer's adapter, 1.0 for 8 LoRA initialisations out
# of 8 in a one-process replay of these steps, and 1.0 in this test with run.seed 7, 1 and 2.
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]}


def sum_pairs(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
        wrong = wrong if wrong >= 0 else a + b + 2
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                     "chosen": [{"role": "assistant", "content": str(a + b)}], "rejected": [{"role": "assistant", "content": str(wrong)}]})
    return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The pairs, and a tiny 'pretrained' base (safetensors and a tokenizer trained on the pairs' texts)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zeropipe.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("preference")
    rows = sum_pairs(PAIRS)
    (root / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    texts = [m["content"] for row in sum_pairs(200, seed=1) for key in ("prompt", "chosen", "rejected") for m in row[key]]
    tokenizer = train_tokenizer(texts, 300, root / "base")
    torch.manual_seed(0)
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    AutoModelForCausalLM.from_config(LlamaConfig(**fields, vocab_size=len(tokenizer))).save_pretrained(root / "base")
    return root, rows


def preference(model, tokenizer, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed answer log-probs of every pair, tokenized and collated as the ranks do."""
    from zeropipe.data.preference import collate_pairs, normalize_record, tokenize_record
    from zeropipe.engine.preference import sequence_logps

    items = []
    for index, row in enumerate(rows):
        done = tokenize_record(tokenizer, normalize_record(row), 64)
        items.append({"index": index, "prompt": done.prompt, "chosen": done.completions[0], "rejected": done.completions[1]})
    batch = collate_pairs(items, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return sequence_logps(logits.float(), batch)[0].chunk(2)


def run_config(root, name: str, lora: bool) -> dict:
    return {
        "run": {"name": name, "output_dir": str(root / "runs"), "seed": 7},
        "model": {"path": str(root / "base"), **({"lora": LORA} if lora else {})},
        "data": {"path": str(root / "pairs.jsonl"), "max_seq_len": 32},
        "train": {"max_steps": STEPS[lora], "micro_batch_size": 8, "lr": 3e-3 if lora else 1e-2, "schedule": "constant", "log_every": 4, "save_every": SAVE_EVERY, "keep_last": 4},
        "deepspeed": {"zero_stage": 3, "precision": "fp32"},
        "hardware": {"gpus": 2},
        "preference": {"method": "dpo", "beta": 1.0},
        "generate": {"prompts": []},
    }


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_dpo_learns_the_right_sum_under_zero3(setup, tmp_path, lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, rows = setup
    name = "dpo_lora" if lora else "dpo_full"
    config = write_config(tmp_path, run_config(root, name, lora), f"{name}.yaml")
    result = zeropipe("train", config)
    assert_ok(result)
    assert f"reference: {'adapters_off' if lora else 'precomputed'}" in result.stderr
    run_dir = root / "runs" / name
    rows_seen = metrics(run_dir)
    assert [r["step"] for r in rows_seen] == list(range(1, STEPS[lora] + 1))
    # Step 1: the policy is its reference, rewards are 0; DPO then pulls the answers apart.
    assert rows_seen[0]["rewards_margin"] == 0 and rows_seen[0]["loss"] == pytest.approx(0.6931, abs=1e-3)
    # (rank 0's figures of its micro-batch, 8 pairs: the accuracy on all pairs is measured below, from the export)
    assert rows_seen[-1]["rewards_margin"] > 0.5 and min(row["rewards_accuracy"] for row in rows_seen[-4:]) >= 0.75
    assert rows_seen[-1]["logps_chosen"] > rows_seen[-1]["logps_rejected"]

    out = tmp_path / "export"
    assert_ok(zeropipe_here("export", run_dir, "--out", out))
    tokenizer = AutoTokenizer.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    start_chosen, start_rejected = preference(base, tokenizer, rows)
    trained = PeftModel.from_pretrained(base, out) if lora else AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    chosen, rejected = preference(trained.eval(), tokenizer, rows)
    start = float((start_chosen > start_rejected).float().mean())
    end = float((chosen > rejected).float().mean())
    implicit = float(((chosen - start_chosen) > (rejected - start_rejected)).float().mean())
    print(f"{name}: prefers the right sum on {start:.2f} of the training pairs before, {end:.2f} after; implicit-reward accuracy {implicit:.2f}")
    assert 0.2 <= start <= 0.8, "the base should be near chance on this task"
    # DPO's accuracy (TRL's rewards/accuracies: the implicit reward, policy over reference) reaches 0.9,
    # and so does the policy's own preference (the ">= 0.9 on the training pairs, from ~0.5").
    assert implicit >= 0.9
    assert end >= 0.9
    # zeropipe eval: the same accuracy, from the checkpoint, on pairs given as a file (here the training pairs).
    evaluated = zeropipe_here("eval", run_dir, "--data", root / "pairs.jsonl", "--json")
    assert_ok(evaluated)
    assert json.loads(evaluated.stdout.strip().splitlines()[-1])["preference_accuracy"] == pytest.approx(implicit)

    if lora:
        return
    # Exact resume from the middle checkpoint: the cached reference is read, the steps after it are the same.
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    reference_file = cut / "cache" / "reference_logps.npy"
    before = reference_file.read_bytes()
    resumed = zeropipe("train", config, "--resume", cut / "checkpoints" / f"step_{SAVE_EVERY:08d}")
    assert_ok(resumed)
    assert reference_file.read_bytes() == before
    expected = {row["step"]: row for row in rows_seen}
    again = metrics(cut)
    assert [row["step"] for row in again] == list(range(1, STEPS[lora] + 1))
    for row in again[SAVE_EVERY:]:
        keys = ("loss", "grad_norm", "rewards_margin", "rewards_accuracy", "logps_chosen")
        assert [row[k] for k in keys] == [expected[row["step"]][k] for k in keys], row["step"]
