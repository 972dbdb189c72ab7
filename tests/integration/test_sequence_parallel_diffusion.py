"""Ulysses sequence parallelism for a video DiT on CPU ranks: a tiny Wan LoRA trained by 4 ranks as 2 groups
of 2 (SP=2 x DP=2, ZeRO-3, fp32) takes the per-step losses and gradient norms of 2 plain data-parallel
ranks on the same global batch, resumes exactly, draws its samples across the groups and exports the
LoRA the data-parallel run exports. The groups exchange tokens: each rank holds half of every clip's
latent tokens between the first block and the output (diffusers' context-parallel plan of Wan)."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.integration.conftest import assert_ok, metrics, zeropipe, zeropipe_here
from tests.integration.test_video import clips, video_config

pytestmark = pytest.mark.integration

TRAIN = {"max_steps": 6, "save_every": 3, "keep_last": 5, "micro_batch_size": 2, "lr": 2e-2, "warmup_steps": 1, "log_every": 3}


def test_wan_sp2_x_dp2_matches_two_data_parallel_ranks_resumes_exactly_and_exports_the_same_lora(tmp_path):
    data = clips(tmp_path, examples=8)
    common = {"model": {"config": {"pipeline": "tiny-wan"}, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}}, "train": TRAIN, "generate": {"prompts": ["a red circle"], "sample_steps": 2}}
    reference = video_config(tmp_path, "dp2", data, **common)
    sp = video_config(tmp_path, "sp2", data, hardware={"gpus": 4}, parallel={"sequence_parallel_size": 2}, **common)
    assert_ok(zeropipe("train", reference, cwd=tmp_path))
    result = zeropipe("train", sp, cwd=tmp_path)
    assert_ok(result)
    run_dir = tmp_path / "runs" / "sp2"
    assert "groups of 2 ranks share each sample's tokens (diffusers' context-parallel plan of WanTransformer3DModel" in (run_dir / "logs" / "rank0.log").read_text()
    want, got = metrics(tmp_path / "runs" / "dp2"), metrics(run_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 7))
    for a, b in zip(want, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (a["step"], a["grad_norm"], b["grad_norm"])
        # Clips counted once per group: 4 a step, as the reference's.
        assert round(a["samples_per_s"] * a["step_time_s"]) == round(b["samples_per_s"] * b["step_time_s"]) == 4
    assert len(got[0]["host_rss_bytes"]) == 4
    # Samples drawn together by each group (every rank runs the denoiser on the same latents), written by rank 0.
    assert list((run_dir / "samples").glob("step_*/*.mp4"))

    # Resume: a copy continued from step 3 gives steps 4-6 the uninterrupted SP run's figures.
    again = tmp_path / "runs" / "sp2-again"
    shutil.copytree(run_dir, again)
    config = video_config(tmp_path, "sp2-again", data, hardware={"gpus": 4}, parallel={"sequence_parallel_size": 2}, **common)
    assert_ok(zeropipe("train", config, "--resume", str(again / "checkpoints" / "step_00000003"), cwd=tmp_path))
    resumed = metrics(again)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for a, b in zip(got[3:], resumed[3:]):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]

    # The exports: the same LoRA as the data-parallel run's (fp32, to rounding).
    from safetensors.torch import load_file

    exported = {}
    for name in ("dp2", "sp2"):
        out = tmp_path / f"lora-{name}"
        assert_ok(zeropipe_here("export", tmp_path / "runs" / name, "--out", out, "--dtype", "fp32"))
        exported[name] = load_file(str(out / "pytorch_lora_weights.safetensors"))
    assert exported["sp2"].keys() == exported["dp2"].keys() and exported["sp2"]
    for key, tensor in exported["dp2"].items():
        assert torch.allclose(exported["sp2"][key], tensor, rtol=1e-4, atol=1e-6), key
