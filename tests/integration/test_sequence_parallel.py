"""Ulysses sequence parallelism on CPU ranks: 4 ranks as 2 groups of 2 (SP=2 x DP=2) train a tiny
Llama with the per-step losses and gradient norms of 2 plain data-parallel ranks on the same
global batch. The groups exchange tokens: each rank holds half of every sample's sequence."""

from __future__ import annotations

import json
import shutil

from tests.integration.conftest import assert_ok, metrics, zeropipe


def test_sp2_x_dp2_matches_two_data_parallel_ranks_and_resumes_exactly(tmp_run):
    tmp_path, make = tmp_run
    common = {"train": {"max_steps": 6, "log_every": 3, "save_every": 3, "keep_last": 5}, "deepspeed": {"zero_stage": 3, "precision": "fp32"}, "generate": {"prompts": []}}
    reference = make("dp2", hardware={"gpus": 2}, **common)
    sp = make("sp2", hardware={"gpus": 4}, parallel={"sequence_parallel_size": 2}, **common)
    assert_ok(zeropipe("train", reference))
    result = zeropipe("train", sp)
    assert_ok(result)
    run_dir = tmp_path / "runs" / "sp2"
    assert "6 steps of 8 x 1 x 2 examples (sequence parallel: groups of 2 ranks share each example's tokens)" in result.stderr + result.stdout
    assert "groups of 2 ranks share each sample's tokens; 2 data-parallel ranks" in (run_dir / "logs" / "rank0.log").read_text()
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    assert (ds_config["sequence_parallel_size"], ds_config["train_batch_size"]) == (2, 8 * 2)
    want, got = metrics(tmp_path / "runs" / "dp2"), metrics(run_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 7))
    for a, b in zip(want, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (a["step"], a["grad_norm"], b["grad_norm"])
    assert len(got[0]["host_rss_bytes"]) == 4
    # Samples counted once per group: the same samples per step as the reference (the speeds' numerators).
    for a, b in zip(want, got):
        assert round(a["samples_per_s"] * a["step_time_s"]) == round(b["samples_per_s"] * b["step_time_s"]) == 16

    # Resume: a copy continued from step 3 on the same 4 ranks and degree gives steps 4-6 the uninterrupted run's figures.
    again = tmp_path / "runs" / "sp2-again"
    shutil.copytree(run_dir, again)
    config = make("sp2-again", hardware={"gpus": 4}, parallel={"sequence_parallel_size": 2}, **common)
    assert_ok(zeropipe("train", config, "--resume", str(again / "checkpoints" / "step_00000003")))
    resumed = metrics(again)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for a, b in zip(got[3:], resumed[3:]):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]
