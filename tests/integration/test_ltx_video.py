"""LTX-Video end to end: a tiny pipeline (T5 text, 8x-in-time 3D VAE, token-sequence transformer) trained by 2 real DeepSpeed CPU ranks on real mp4 files."""

from __future__ import annotations

import json

import av
import pytest
import torch
import yaml

from tests.integration.conftest import assert_a_second_run_would_encode_nothing, assert_ok, zeropipe, zeropipe_here
from zeropipe.data.videos import generate_moving_shapes_dataset

pytestmark = pytest.mark.integration

PROMPT = "a red circle moving left on a blue background"


def draw(pipeline) -> torch.Tensor:
    pipeline.set_progress_bar_config(disable=True)
    frames = pipeline(PROMPT, num_frames=9, height=32, width=32, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0)).frames
    return torch.from_numpy(frames)


def test_ltx_video_lora_with_parameter_offload_samples_reuses_caches_and_exports_both_lora_layouts(tmp_path):
    """LoRA on 2 ranks, ZeRO-3 with parameters and optimizer offloaded: 8k+1-frame clips, loss falls, mp4 samples, cache reuse, both LoRA files load."""
    data = generate_moving_shapes_dataset(tmp_path / "videos", 12, seed=1, resolution=32, frames=9, fps=25.0)
    config = {
        "run": {"name": "ltx-lora", "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"pipeline": "tiny-ltx-video"}, "lora": {"r": 8, "alpha": 16}},
        "data": {
            "path": str(data), "images": {"resolution": 32, "bucket_step": 16},
            "video": {"frame_buckets": [1, 9]}, "cache": {"dir": str(tmp_path / "cache")},
        },
        "train": {"max_steps": 12, "micro_batch_size": 2, "lr": 3e-2, "warmup_steps": 1, "log_every": 2},
        "deepspeed": {"zero_stage": 3, "precision": "fp32", "offload_optimizer": "cpu", "offload_param": "cpu"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": [PROMPT], "sample_steps": 2, "sample_every": 12, "guidance_scale": 3.0},
    }
    path = tmp_path / "ltx.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    # 13 frames is not 8k+1: refused before any rank starts, with the lengths LTX-Video's VAE takes.
    refused = zeropipe("train", path, "data.video.frame_buckets=[1,13]", cwd=tmp_path)
    assert refused.returncode != 0 and "Traceback" not in refused.stdout + refused.stderr
    assert "clip lengths must be 8k+1 frames (e.g. 1, 9, 17, 25)" in refused.stdout + refused.stderr

    result = zeropipe("train", path, cwd=tmp_path)
    assert_ok(result)
    assert "clips per length: 3 of 1 frame(s), 9 of 9 frame(s) at 25 fps" in result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "ltx-lora"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["fixed_batch_loss_end"] < 0.97 * summary["fixed_batch_loss_start"], summary
    assert 0 < summary["parameters"]["trainable"] < 0.5 * summary["parameters"]["total"]
    rows = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [12]
    with av.open(str(run_dir / "samples" / rows[0]["video"])) as container:
        assert sum(1 for _ in container.decode(container.streams.video[0])) == 9

    assert_a_second_run_would_encode_nothing(run_dir, tmp_path / "again")

    out = tmp_path / "lora"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from safetensors.torch import load_file

    comfy = load_file(str(out / "lora_comfyui.safetensors"))
    assert "diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight" in comfy and "diffusion_model.transformer_blocks.1.ff.net.2.lora_B.weight" in comfy
    assert all(".lora_" in key for key in comfy)  # alpha / r is folded into lora_B, as diffusion-pipe writes them

    from diffusers import LTXPipeline

    base = LTXPipeline.from_pretrained(str(run_dir / "pipeline"))
    before = draw(base)
    base.load_lora_weights(str(out))
    with_diffusers_lora = draw(base)
    comfy_pipeline = LTXPipeline.from_pretrained(str(run_dir / "pipeline"))
    comfy_pipeline.load_lora_weights(str(out), weight_name="lora_comfyui.safetensors")  # diffusers' converter for non-diffusers LTX LoRAs
    assert with_diffusers_lora.shape == (1, 9, 32, 32, 3) and (with_diffusers_lora - before).abs().max() > 1e-3
    assert torch.allclose(draw(comfy_pipeline), with_diffusers_lora, atol=1e-4)
