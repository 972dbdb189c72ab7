"""HunyuanVideo end to end: a tiny pipeline (Llama + CLIP text, causal 3D VAE) trained by 2 real DeepSpeed CPU ranks on real mp4 files."""

from __future__ import annotations

import json
from pathlib import Path

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
    frames = pipeline(PROMPT, num_frames=5, height=32, width=32, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0)).frames
    return torch.from_numpy(frames)


def test_hunyuan_video_lora_with_offload_samples_reuses_caches_and_exports_both_lora_layouts(tmp_path):
    """LoRA on 2 ranks, ZeRO-3 with the optimizer offloaded: loss falls, mp4 samples, a second run loads no encoder, both LoRA files load."""
    data = generate_moving_shapes_dataset(tmp_path / "videos", 12, seed=1, resolution=32, frames=9, fps=24.0)
    config = {
        "run": {"name": "hv-lora", "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"pipeline": "tiny-hunyuan-video"}, "lora": {"r": 8, "alpha": 16}},
        "data": {
            "path": str(data), "images": {"resolution": 32, "bucket_step": 16},
            "video": {"frame_buckets": [1, 9]}, "cache": {"dir": str(tmp_path / "cache")},
        },
        "train": {"max_steps": 12, "micro_batch_size": 2, "lr": 3e-2, "warmup_steps": 1, "log_every": 2},
        "deepspeed": {"zero_stage": 3, "precision": "fp32", "offload_optimizer": "cpu"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": [PROMPT], "sample_steps": 2, "sample_every": 12, "guidance_scale": 6.0},
    }
    path = tmp_path / "hv.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    result = zeropipe("train", path, cwd=tmp_path)
    assert_ok(result)
    assert "clips per length: 3 of 1 frame(s), 9 of 9 frame(s) at 24 fps" in result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "hv-lora"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["fixed_batch_loss_end"] < 0.97 * summary["fixed_batch_loss_start"], summary
    assert 0 < summary["parameters"]["trainable"] < 0.5 * summary["parameters"]["total"]
    # The sample at step 12: an H.264 mp4 of 9 frames, drawn with the embedded guidance.
    rows = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [12]
    with av.open(str(run_dir / "samples" / rows[0]["video"])) as container:
        assert sum(1 for _ in container.decode(container.streams.video[0])) == 9

    # Same clips, same model: a second run finds everything in the caches (no rank would load the VAE, Llama or CLIP).
    assert_a_second_run_would_encode_nothing(run_dir, tmp_path / "again")

    out = tmp_path / "lora"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from safetensors.torch import load_file

    comfy = load_file(str(out / "lora_comfyui.safetensors"))
    # The original layout fuses q, k, v (and the single blocks' MLP input) into one layer: rank 3r (4r), alpha folded in.
    assert comfy["diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight"].shape == (24, 32)
    assert comfy["diffusion_model.double_blocks.0.txt_attn_qkv.lora_B.weight"].shape == (96, 24)
    assert comfy["diffusion_model.single_blocks.0.linear1.lora_A.weight"].shape == (32, 32)
    assert {"diffusion_model.double_blocks.0.img_mlp.fc2.lora_A.weight", "diffusion_model.single_blocks.0.linear2.lora_B.weight"} <= set(comfy)
    assert all(key.startswith(("diffusion_model.double_blocks.", "diffusion_model.single_blocks.")) for key in comfy)

    from diffusers import HunyuanVideoPipeline

    diffusers_lora = load_file(str(out / "pytorch_lora_weights.safetensors"))
    # The fused update is exactly the sum of the separate ones: q's rows of B_qkv @ A_qkv are (alpha / r) B_q @ A_q.
    fused = comfy["diffusion_model.double_blocks.0.img_attn_qkv.lora_B.weight"] @ comfy["diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight"]
    to_q = diffusers_lora["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"] @ diffusers_lora["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"]
    assert torch.allclose(fused[:32], 2.0 * to_q, atol=1e-6)

    base = HunyuanVideoPipeline.from_pretrained(str(run_dir / "pipeline"))
    before = draw(base)
    base.load_lora_weights(str(out))
    after = draw(base)
    assert after.shape == (1, 5, 32, 32, 3) and (after - before).abs().max() > 1e-3
