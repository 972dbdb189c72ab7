"""Packing and evaluation in a real 2-rank ZeRO-3 run, and `zeropipe eval` on its checkpoint."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import assert_ok, metrics, zeropipe, zeropipe_here

pytestmark = pytest.mark.integration


def test_packed_zero3_run_evaluates_during_training_and_zeropipe_eval_agrees(tmp_run):
    tmp_path, make = tmp_run
    # 330 records, 10% held out: 33 eval examples, 17 and 16 per rank, so with micro-batches of
    # 8 one rank runs a batch more than the other: the other must repeat one (ZeRO-3 collective).
    config = make(
        "packed",
        data={"synthetic": {"task": "arithmetic", "examples": 330}, "max_seq_len": 64, "packing": True, "eval_fraction": 0.1},
        train={"max_steps": 12, "eval_every": 4},
        deepspeed={"zero_stage": 3},
    )
    result = zeropipe("train", config)
    assert_ok(result)
    run_dir = tmp_path / "runs" / "packed"
    rows = metrics(run_dir)
    steps = [row for row in rows if row.get("kind") is None]
    evals = [row for row in rows if row.get("kind") == "eval"]
    assert [row["step"] for row in steps] == list(range(1, 13))
    assert [row["step"] for row in evals] == [4, 8, 12]
    assert all(row["eval_examples"] == 33 and row["eval_tokens"] > 0 for row in evals)
    assert evals[-1]["eval_loss"] < 0.8 * evals[0]["eval_loss"], [row["eval_loss"] for row in evals]
    assert "step 12 eval loss" in result.stderr

    # Packed: the sampler deals sequences holding several examples each.
    packs = json.loads((run_dir / "cache" / "packs.json").read_text())
    plan = json.loads((run_dir / "run.json").read_text())
    assert packs["packs"] < packs["examples"] == 297
    assert plan["micro_batches_per_epoch"] == (packs["packs"] // 2) // 8
    # samples/s counts examples, not packed rows: more than 16 rows' worth per step.
    assert all(row["samples_per_s"] * row["step_time_s"] > 16 for row in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_loss"] == steps[-1]["loss"] and summary["final_eval_loss"] == evals[-1]["eval_loss"]

    evaluated = zeropipe_here("eval", run_dir, "--json")
    assert_ok(evaluated)
    figures = json.loads(evaluated.stdout)
    assert figures["checkpoint"] == "step_00000012" and figures["examples"] == 33
    assert figures["tokens"] == evals[-1]["eval_tokens"]
    assert figures["loss"] == pytest.approx(evals[-1]["eval_loss"], abs=0.02)
