"""LTX-2 end to end: video with its sound, trained jointly by 2 real DeepSpeed CPU ranks on mp4 files with audio tracks.

The clips are written here with PyAV: moving shapes with a sine tone (a low one for circles, a
high one for squares), plus one clip without an audio track, which LTX-2's own trainer leaves out
of audio-video training and so does this run.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction

import av
import numpy as np
import pytest
import yaml

from tests.integration.conftest import assert_ok, zeropipe, zeropipe_here
from zeropipe.data.videos import moving_shape_frames

pytestmark = pytest.mark.integration

PROMPT = "a red circle moving left on a blue background"
RATE = 16000


def write_clip(path, frames: np.ndarray, fps: float, tone: float | None) -> None:
    """An H.264 mp4 of uint8 frames (T, H, W, 3), with a stereo AAC sine tone of ``tone`` Hz over its length (none: no audio stream)."""
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        audio = container.add_stream("aac", rate=RATE, layout="stereo") if tone else None
        for pixels in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(video.encode())
        if audio is not None:
            t = np.arange(int(RATE * len(frames) / fps)) / RATE
            wave = (0.5 * np.sin(2 * np.pi * tone * t)).astype(np.float32)
            frame = av.AudioFrame.from_ndarray(np.stack([wave, wave]), format="fltp", layout="stereo")
            frame.sample_rate, frame.pts = RATE, 0
            container.mux(audio.encode(frame))
            container.mux(audio.encode())


def test_ltx2_lora_trains_video_and_audio_samples_a_clip_with_sound_and_exports_both_lora_layouts_and_the_merged_pipeline(tmp_path):
    data = tmp_path / "clips"
    data.mkdir()
    rng = random.Random(1)
    for number in range(5):
        shape, colour, background = ("circle", "square")[number % 2], ("red", "green")[number % 3 == 0], ("blue", "yellow")[number % 2]
        direction = ("left", "right")[number % 2]
        frames = moving_shape_frames(shape, colour, background, direction, (32, 32), 9, rng)
        silent = number == 4
        write_clip(data / f"clip_{number}.mp4", frames, 24.0, None if silent else (220.0 if shape == "circle" else 880.0))
        (data / f"clip_{number}.txt").write_text(f"a {colour} {shape} moving {direction} on a {background} background")
    config = {
        "run": {"name": "ltx2-lora", "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"pipeline": "tiny-ltx2"}, "lora": {"r": 8, "alpha": 16}},
        "data": {"path": str(data), "images": {"resolution": 32, "bucket_step": 16}, "video": {"frame_buckets": [9]}, "cache": {"dir": str(tmp_path / "cache")}},
        "train": {"max_steps": 8, "micro_batch_size": 2, "lr": 3e-2, "warmup_steps": 1, "log_every": 2},
        "deepspeed": {"zero_stage": 3, "precision": "fp32"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": [PROMPT], "sample_steps": 2, "sample_every": 8, "guidance_scale": 3.0},
    }
    path = tmp_path / "ltx2.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    result = zeropipe("train", path, cwd=tmp_path)
    assert_ok(result)
    output = result.stdout + result.stderr
    assert "1 file(s) have no audio track and do not train" in output and "clip_4.mp4" in output
    assert "clips per length: 5 of 9 frame(s) at 24 fps" in output and "4 to encode" in output

    run_dir = tmp_path / "runs" / "ltx2-lora"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["fixed_batch_loss_end"] < 0.97 * summary["fixed_batch_loss_start"], summary

    # The sample is an mp4 whose audio stream is the drawn sound, not silence.
    rows = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [8]
    sample = run_dir / "samples" / rows[0]["video"]
    with av.open(str(sample)) as container:
        assert sum(1 for _ in container.decode(container.streams.video[0])) == 9
        assert container.streams.audio, "the sample has no audio stream"
    with av.open(str(sample)) as container:
        sound = np.concatenate([frame.to_ndarray() for frame in container.decode(container.streams.audio[0])], axis=1)
    assert sound.shape[0] == 2 and sound.shape[1] >= 0.3 * RATE
    assert np.sqrt(np.mean(sound**2)) > 1e-4, "the sample's audio stream is silent"

    out = tmp_path / "lora"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from safetensors.torch import load_file

    lora = load_file(str(out / "pytorch_lora_weights.safetensors"))
    # The last block's audio feed-forward reaches only the audio output: its LoRA moved because of the audio loss term alone.
    audio_only = [key for key in lora if "transformer_blocks.1.audio_ff." in key and "lora_B" in key]
    assert audio_only and all(lora[key].abs().max() > 0 for key in audio_only), audio_only
    comfy = load_file(str(out / "lora_comfyui.safetensors"))
    assert "diffusion_model.transformer_blocks.0.audio_attn1.to_q.lora_A.weight" in comfy and all(".lora_" in key for key in comfy)

    import torch
    from diffusers import LTX2Pipeline

    def draw(pipeline):
        pipeline.set_progress_bar_config(disable=True)
        video, audio = pipeline(
            PROMPT, num_frames=9, height=32, width=32, frame_rate=24.0, num_inference_steps=2, output_type="pt", return_dict=False,
            generator=torch.Generator().manual_seed(0), stg_scale=0.0, audio_stg_scale=0.0, spatio_temporal_guidance_blocks=None, max_sequence_length=64,
        )
        return video, audio

    base = LTX2Pipeline.from_pretrained(str(run_dir / "pipeline"))
    video_before, audio_before = draw(base)
    base.load_lora_weights(str(out))
    video_lora, audio_lora = draw(base)
    assert (video_lora - video_before).abs().max() > 1e-4 and (audio_lora - audio_before).abs().max() > 1e-5
    comfy_pipeline = LTX2Pipeline.from_pretrained(str(run_dir / "pipeline"))
    comfy_pipeline.load_lora_weights(str(out), weight_name="lora_comfyui.safetensors")  # diffusers' converter of LTX-2's original layout
    video_comfy, audio_comfy = draw(comfy_pipeline)
    assert torch.allclose(video_comfy, video_lora, atol=1e-4) and torch.allclose(audio_comfy, audio_lora, atol=1e-4)

    # The adapter merged into the transformer: a whole diffusers folder that draws what base + LoRA draws.
    merged = tmp_path / "merged"
    assert_ok(zeropipe_here("export", run_dir, "--out", merged, "--merge", "--dtype", "fp32"))
    video_merged, audio_merged = draw(LTX2Pipeline.from_pretrained(str(merged)))
    assert torch.allclose(video_merged, video_lora, atol=1e-4) and torch.allclose(audio_merged, audio_lora, atol=1e-4)
