"""Train, export and reload with real DeepSpeed on 2 CPU ranks."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.conftest import RESUME_STEPS, SAVE_EVERY, assert_ok, metrics, zeropipe, zeropipe_here

pytestmark = pytest.mark.integration


def loss_fell(rows: list[dict], factor: float = 0.8) -> bool:
    first = sum(r["loss"] for r in rows[:2]) / 2
    last = sum(r["loss"] for r in rows[-2:]) / 2
    return last < factor * first


def export_and_check_logits(run_dir, out, tmp_path):
    """Export, reload with from_pretrained, and check it predicts like the trained weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32")
    assert_ok(result)
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("What is 1 + 2?", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 3
    return model, tokenizer


def test_zero3_with_cpu_offload_trains_and_exports(tmp_run):
    tmp_path, make = tmp_run
    config = make("z3", deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}, train={"max_steps": 16})
    result = zeropipe("train", config)
    assert_ok(result)
    run_dir = tmp_path / "runs" / "z3"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert loss_fell(rows), [r["loss"] for r in rows]
    assert all(len(r["host_rss_bytes"]) == 2 and min(r["host_rss_bytes"]) > 0 for r in rows)
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds_config["train_batch_size"] == 8 * 1 * 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"]
    assert "generations of the trained model" in result.stderr
    export_and_check_logits(run_dir, tmp_path / "export", tmp_path)


def test_zero2_export_matches_training_weights(uninterrupted, tmp_path):
    """The exported model computes the same loss as the last logged step's weights would.

    The run is the session's uninterrupted ZeRO-2 fp32 reference (conftest.py: RESUME_STEPS steps, a
    checkpoint every SAVE_EVERY, read-only here), which the exact-resume tests continue: a run of its own
    trained the same tiny model for 10 steps again.
    """
    _, run_dir = uninterrupted(2)
    final = f"step_{RESUME_STEPS:08d}"
    # A checkpoint every save_every steps, and the last step's.
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [f"step_{s:08d}" for s in range(SAVE_EVERY, RESUME_STEPS, SAVE_EVERY)] + [final]
    model, _ = export_and_check_logits(run_dir, tmp_path / "export", tmp_path)
    # Compare every exported tensor with the consolidated fp32 checkpoint.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    reference = get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints"), tag=final)
    exported = model.state_dict()
    assert set(reference) == set(exported)
    for name, tensor in reference.items():
        assert torch.equal(tensor, exported[name]), name


def test_stage0_and_stage1_train(tmp_run):
    tmp_path, make = tmp_run
    for stage in (0, 1):
        config = make(f"s{stage}", deepspeed={"zero_stage": stage}, train={"max_steps": 8})
        assert_ok(zeropipe("train", config))
        rows = metrics(tmp_path / "runs" / f"s{stage}")
        assert len(rows) == 8 and loss_fell(rows, 0.9), [r["loss"] for r in rows]
    # In this process: `python -m zeropipe export` in a new interpreter is test_toy_family.py's and test_condition_door.py's.
    assert_ok(zeropipe_here("export", tmp_path / "runs" / "s0", "--out", tmp_path / "export0"))
    assert (tmp_path / "export0" / "config.json").is_file()


def test_epochs_accumulation_checkpointing_and_linear_schedule(tmp_run):
    tmp_path, make = tmp_run
    config = make(
        "accum",
        model={"gradient_checkpointing": True},
        train={"max_steps": None, "epochs": 1, "gradient_accumulation_steps": 2, "schedule": "linear", "warmup_steps": 2},
        deepspeed={"zero_stage": 3, "precision": "fp32"},
    )
    assert_ok(zeropipe("train", config))
    run_dir = tmp_path / "runs" / "accum"
    plan = json.loads((run_dir / "run.json").read_text())
    # 400 examples over 2 ranks, micro-batch 8: 25 micro-batches per epoch, 12 steps of 2.
    assert (plan["micro_batches_per_epoch"], plan["total_steps"]) == (25, 12)
    assert json.loads((run_dir / "ds_config.json").read_text())["train_batch_size"] == 8 * 2 * 2
    rows = metrics(run_dir)
    assert len(rows) == 12 and loss_fell(rows, 0.9)
    lrs = [r["lr"] for r in rows]
    # DeepSpeed's warm-up spends its first two steps at 0, then rises linearly; then linear decay.
    assert lrs[:4] == pytest.approx([0.0, 0.0, 5e-3, 1e-2]) and all(a > b for a, b in zip(lrs[3:], lrs[4:])), lrs
    # Each step saw 2 micro-batches of 8 on each of 2 ranks.
    assert all(r["samples_per_s"] * r["step_time_s"] == pytest.approx(32) for r in rows)
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "ZeRO-3: 21 of 21 parameter tensors partitioned at construction" in log
    # Every rank reached the end of its run and left (without the interpreter teardown that aborted ranks in CI).
    for rank in (0, 1):
        assert (run_dir / "logs" / f"rank{rank}.log").read_text().rstrip().endswith(f"rank {rank}: finished")


def test_user_deepspeed_json_with_auto_values(tmp_run):
    tmp_path, make = tmp_run
    ds_file = tmp_path / "ds_hf_trainer.json"
    ds_file.write_text(
        json.dumps(
            {
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "bf16": {"enabled": "auto"},
                "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            }
        )
    )
    config = make("userjson", deepspeed={"config_file": str(ds_file), "zero_stage": 2}, train={"max_steps": 5})
    result = zeropipe("train", config)
    assert_ok(result)
    assert "DeepSpeed train_batch_size = 16 (micro-batch 8 x accumulation 1 x 2 ranks)" in result.stderr
    assert "DeepSpeed optimizer.params.lr = 0.01 (from train.lr)" in result.stderr
    used = json.loads((tmp_path / "runs" / "userjson" / "ds_config.json").read_text())
    assert "auto" not in json.dumps(used)
    assert used["scheduler"]["type"] == "WarmupCosineLR"
