"""A diffusion run's validation loss (held-out images, fixed timesteps and noise) and samples from the EMA weights: one real 2-rank ZeRO-3 run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.integration.conftest import assert_ok, metrics, zeropipe, zeropipe_here
from tests.integration.test_diffusion import diffusion_config

pytestmark = pytest.mark.integration


def eval_json(run_dir, *extra) -> dict:
    result = zeropipe_here("eval", str(run_dir), "--json", *extra)  # the CLI's code, without a new interpreter's start-up and imports
    assert_ok(result)
    return json.loads(result.stdout.strip().splitlines()[-1])


def in_process(run_dir, checkpoint: str | None = None):
    """What `zeropipe eval` computes, called in this process (no interpreter start, no imports again)."""
    from zeropipe.families.causal_lm.evaluation import resolve_run_checkpoint
    from zeropipe.families.diffusion.evaluation import evaluate_diffusion_checkpoint

    return evaluate_diffusion_checkpoint(*resolve_run_checkpoint(run_dir, checkpoint))


def test_validation_loss_is_the_same_on_two_ranks_and_in_process_and_ema_draws_the_samples(tmp_path):
    """2 ranks under ZeRO-3 evaluate 5 held-out images (an odd count: one rank repeats an uncounted pass); `zeropipe eval` in one process gives the same number."""
    config = diffusion_config(
        tmp_path, "valloss", pipeline="tiny-sd3",
        data={"synthetic": {"task": "shapes", "examples": 24}, "eval_fraction": 0.2, "images": {"resolution": 32, "bucket_step": 8}},
        train={"max_steps": 4, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "log_every": 2, "eval_every": 2, "save_every": 2,
               "ema": {"decay": 0.5, "warmup": "none", "sample_from_ema": True}},
        deepspeed={"zero_stage": 3, "precision": "fp32"},
        generate={"prompts": ["a red circle on a blue background"], "sample_steps": 2, "sample_every": 2},
    )
    result = zeropipe("train", config, cwd=tmp_path)
    assert_ok(result)
    run_dir = tmp_path / "runs" / "valloss"
    assert "held out 5 of 24 images" in result.stdout + result.stderr
    evals = [row for row in metrics(run_dir) if row.get("kind") == "eval"]
    assert [row["step"] for row in evals] == [2, 4], evals
    for row in evals:
        assert row["eval_examples"] == 5 and len(row["eval_loss_by_quantile"]) == 9 and math.isfinite(row["eval_loss"])
        assert row["eval_loss"] == pytest.approx(sum(row["eval_loss_by_quantile"].values()) / 9, rel=1e-12)
    plan = json.loads((run_dir / "data" / "diffusion.json").read_text())
    assert len(plan["eval_items"]) == 5 and all(plan["repeats"][index] == 0 for index in plan["eval_items"])  # never trained on

    # The same checkpoint, one process without DeepSpeed: the same figure (fixed noise per image, one pass per image and timestep).
    first = eval_json(run_dir)
    assert first["step"] == 4 and first["examples"] == 5
    assert first["loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-6, abs=1e-9)
    for quantile, loss in evals[-1]["eval_loss_by_quantile"].items():
        assert first["loss_by_quantile"][quantile] == pytest.approx(loss, rel=1e-6, abs=1e-9)
    # And again, in this process (whatever random state it has): identical.
    torch.manual_seed(12345)
    assert in_process(run_dir).to_json() == first

    # Samples at step 2 and at the end were drawn from the EMA weights, and say so.
    rows = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    assert {row["step"] for row in rows} == {2, 4} and all(row.get("weights") == "ema" for row in rows), rows
    # At step 2 the ranks evaluated, then drew the samples from the EMA, then saved the checkpoint: its validation loss is
    # the row's, so the trained weights were back after the samples (the EMA's, decay 0.5, would give another figure).
    second = in_process(run_dir, "step_00000002")
    assert second.step == 2 and second.loss == pytest.approx(evals[0]["eval_loss"], rel=1e-6, abs=1e-9)
    assert evals[0]["eval_loss"] != evals[-1]["eval_loss"]
