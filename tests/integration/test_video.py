"""Video diffusion end to end: tiny Wan pipelines trained by 2 real DeepSpeed CPU ranks on real mp4 files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import av
import pytest
import torch
import yaml

from tests.integration.conftest import assert_ok, metrics, zeropipe, zeropipe_here
from zeropipe.data.videos import generate_moving_shapes_dataset

pytestmark = pytest.mark.integration

PROMPT = "a red circle moving left on a blue background"


def video_config(tmp_path: Path, name: str, data_dir: Path, **sections) -> Path:
    config = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"pipeline": "tiny-wan"}},
        "data": {
            "path": str(data_dir), "max_bad_fraction": 0.2, "images": {"resolution": 32, "bucket_step": 16},
            "video": {"frame_buckets": [1, 9]}, "cache": {"dir": str(tmp_path / "cache")},
        },
        "train": {"max_steps": 10, "micro_batch_size": 2, "lr": 2e-3, "warmup_steps": 1, "log_every": 2},
        "deepspeed": {"zero_stage": 3, "precision": "fp32"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": [PROMPT], "sample_steps": 3},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    if "path" in config["model"]:  # a pipeline directory instead of the tiny preset
        config["model"].pop("config")
    path = tmp_path / f"{name}.yaml"
    path.write_text("# Run it: zeropipe train " + path.name + "\n" + yaml.safe_dump(config, sort_keys=False))
    return path


def clips(tmp_path: Path, examples: int = 16, broken: bool = False) -> Path:
    folder = generate_moving_shapes_dataset(tmp_path / "videos", examples, seed=1, resolution=32, frames=9)
    if broken:
        (folder / "truncated.mp4").write_bytes((folder / "clip_00000.mp4").read_bytes()[:400])
        (folder / "truncated.txt").write_text("a clip cut short")
        (folder / "notes.webm").write_text("not a video")
    return folder


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def draw(pipeline) -> torch.Tensor:
    pipeline.set_progress_bar_config(disable=True)
    return torch.from_numpy(pipeline(PROMPT, num_frames=5, height=32, width=32, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0)).frames)


def test_wan_lora_under_zero3_skips_broken_videos_samples_mp4_and_exports_both_lora_layouts(tmp_path):
    """T2V LoRA on 2 ranks, ZeRO-3: broken videos named and skipped, loss falls, mp4 samples, diffusers and ComfyUI LoRAs load."""
    config = video_config(
        tmp_path, "wan-lora", clips(tmp_path, broken=True), model={"config": {"pipeline": "tiny-wan"}, "lora": {"r": 8, "alpha": 16}},
        train={"max_steps": 10, "micro_batch_size": 2, "lr": 2e-2, "warmup_steps": 1, "log_every": 2}, generate={"prompts": [PROMPT], "sample_steps": 3, "sample_every": 5},
    )
    result = zeropipe("train", config, cwd=tmp_path)
    assert_ok(result)
    output = result.stdout + result.stderr
    assert "skipped 2 unusable file(s)" in output and "truncated.mp4" in output and "notes.webm" in output
    assert "clips per length: 4 of 1 frame(s), 12 of 9 frame(s) at 16 fps" in output
    run_dir = tmp_path / "runs" / "wan-lora"
    # One process per node filled the caches (one VAE and one text encoder, whatever the number of
    # GPUs) and ended before the ranks started; the ranks encoded nothing.
    setup_log = (run_dir / "logs" / "node_setup.log").read_text()
    assert "caches filled: 16 clip(s) and 18 caption(s) encoded on cpu (text encoders in float32)" in setup_log
    filled_at = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ INFO caches filled", setup_log)[1]
    for rank in (0, 1):
        rank_log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "cached" not in rank_log and "caches filled" not in rank_log
        assert re.search(rf"==== zeropipe rank {rank}/2 started (\S+ \S+) ====", rank_log)[1] >= filled_at
    result_summary = summary(run_dir)
    assert result_summary["fixed_batch_loss_end"] < 0.97 * result_summary["fixed_batch_loss_start"], result_summary
    assert 0 < result_summary["parameters"]["trainable"] < 0.5 * result_summary["parameters"]["total"]

    # Samples at step 5 and 10: H.264 mp4 files of 9 frames, and an animated WebP the gallery shows.
    rows = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [5, 10]
    for row in rows:
        with av.open(str(run_dir / "samples" / row["video"])) as container:
            stream = container.streams.video[0]
            assert stream.codec_context.name == "h264" and sum(1 for _ in container.decode(stream)) == row["frames"] == 9
        from PIL import Image

        assert Image.open(run_dir / "samples" / row["file"]).n_frames == 9

    out = tmp_path / "lora"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from safetensors.torch import load_file

    comfy = load_file(str(out / "lora_comfyui.safetensors"))
    assert "diffusion_model.blocks.0.self_attn.q.lora_A.weight" in comfy and "diffusion_model.blocks.1.ffn.2.lora_B.weight" in comfy
    assert all(key.startswith("diffusion_model.blocks.") for key in comfy)
    assert float(comfy["diffusion_model.blocks.0.cross_attn.k.alpha"]) == 16.0

    from diffusers import WanPipeline

    base = WanPipeline.from_pretrained(str(run_dir / "pipeline"))
    before = draw(base)
    base.load_lora_weights(str(out))
    with_diffusers_lora = draw(base)
    comfy_pipeline = WanPipeline.from_pretrained(str(run_dir / "pipeline"))
    comfy_pipeline.load_lora_weights(str(out), weight_name="lora_comfyui.safetensors")  # diffusers' converter for non-diffusers Wan LoRAs
    with_comfy_lora = draw(comfy_pipeline)
    assert (with_diffusers_lora - before).abs().max() > 1e-3
    assert torch.allclose(with_comfy_lora, with_diffusers_lora, atol=1e-4)


def test_wan22_low_noise_expert_from_a_comfyui_file_full_finetune_under_zero3_reuses_caches_and_exports_its_folder(tmp_path):
    """Wan 2.2 A14B as its users have it: the diffusers folder plus the low-noise expert as a ComfyUI-layout file.

    model.diffusion.expert low_noise trains transformer_2/ on t <= the boundary, its weights streamed
    from the single file into ZeRO-3 partitions (full fine-tune, checkpointing); the export writes
    transformer_2/; a second run loads no encoder.
    """
    from tests.unit.diffusion.test_single_file import write_original_checkpoint
    from tests.unit.diffusion.test_wan import two_expert_pipeline

    a14b = two_expert_pipeline(tmp_path / "pipelines")
    low_noise_file = tmp_path / "wan2.2_t2v_low_noise_tiny_fp32.safetensors"
    file_weights = write_original_checkpoint(low_noise_file, seed=11)
    data = clips(tmp_path, examples=12)
    config = video_config(
        tmp_path, "wan-full", data,
        model={"path": str(a14b), "gradient_checkpointing": True, "diffusion": {"expert": "low_noise", "denoiser_file": str(low_noise_file)}},
        deepspeed={"zero_stage": 3, "precision": "fp32"}, train={"max_steps": 16, "micro_batch_size": 2, "lr": 5e-3, "warmup_steps": 1, "log_every": 2},
    )
    result = zeropipe("train", config, cwd=tmp_path)
    assert_ok(result)
    assert "training the low-noise expert (transformer_2/) on noise levels 0 to 0.875" in result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "wan-full"
    rank_log = (run_dir / "logs" / "rank0.log").read_text()
    assert f"from {low_noise_file}" in rank_log and "(its ZeRO-3 partitions)" in rank_log
    result_summary = summary(run_dir)
    assert result_summary["fixed_batch_loss_end"] < 0.9 * result_summary["fixed_batch_loss_start"], result_summary
    rows = metrics(run_dir)
    assert rows and all(row["timestep_max"] <= 875.0 for row in rows) and min(row["timestep_min"] for row in rows) < 500

    # Same files, same model: every latent and caption comes from the cache, no rank loads the VAE or UMT5.
    again = tmp_path / "again.yaml"
    again.write_text(config.read_text().replace("name: wan-full", "name: wan-again"))
    second = zeropipe("train", again, "train.max_steps=2", "generate.prompts=null", cwd=tmp_path)
    assert_ok(second)
    assert "caches complete: the training ranks will not load the VAE or the text encoders" in second.stdout + second.stderr
    assert all(row["frozen_components_loaded"] == [] for row in metrics(tmp_path / "runs" / "wan-again"))
    assert "cached" not in (tmp_path / "runs" / "wan-again" / "logs" / "rank1.log").read_text()
    assert not (tmp_path / "runs" / "wan-again" / "logs" / "node_setup.log").exists()  # nothing to encode: no caching process

    # The export replaces transformer_2/ with the trained low-noise expert, grown from the file's
    # weights (not the folder's), and keeps transformer/ (the high-noise expert) as it was.
    out = tmp_path / "export"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from diffusers import WanPipeline

    pipeline = WanPipeline.from_pretrained(str(out))
    base = WanPipeline.from_pretrained(str(a14b))
    assert pipeline.config.boundary_ratio == 0.875
    trained, folder_weights = pipeline.transformer_2.state_dict(), base.transformer_2.state_dict()

    def distance(weights):
        return sum(float((trained[key] - weights[key]).abs().sum()) for key in file_weights)

    assert any(not torch.equal(trained[key], file_weights[key]) for key in file_weights)
    assert distance(file_weights) < 0.5 * distance(folder_weights)
    high_noise, initial_high = pipeline.transformer.state_dict(), base.transformer.state_dict()
    assert all(torch.equal(high_noise[key], initial_high[key]) for key in high_noise)
    assert draw(pipeline).shape == (1, 5, 32, 32, 3)


def test_a_mostly_broken_video_folder_is_refused_before_any_rank_starts(tmp_path):
    folder = tmp_path / "videos"
    generate_moving_shapes_dataset(folder, 3, seed=1, resolution=32, frames=9, still_every=0)
    for number in range(4):
        (folder / f"broken_{number}.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(200))
    config = video_config(tmp_path, "broken", folder)
    result = zeropipe("train", config, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output
    assert "4 of 7 files in" in output and "broken_0.mp4" in output and "raise data.max_bad_fraction" in output
    assert not (tmp_path / "runs" / "broken" / "logs" / "rank0.log").exists()


def test_wan21_image_to_video_lora_with_clip_embeddings_samples_from_a_first_frame_and_exports(tmp_path):
    """I2V (Wan 2.1 I2V layout: first-frame latents and CLIP image embeddings): LoRA under ZeRO-3, loss falls, samples drawn from a dataset clip's first frame, the LoRA loads."""
    from tests.unit.diffusion.test_wan import wan21_i2v_pipeline

    folder = wan21_i2v_pipeline(tmp_path / "pipelines")
    config = video_config(
        tmp_path, "wan-i2v", clips(tmp_path, examples=12), model={"path": str(folder), "lora": {"r": 8, "alpha": 16}},
        data={"video": {"frame_buckets": [9]}}, train={"max_steps": 10, "micro_batch_size": 2, "lr": 2e-2, "warmup_steps": 1, "log_every": 2},
        generate={"prompts": [PROMPT], "sample_steps": 2, "sample_every": 10},
    )
    result = zeropipe("train", config, cwd=tmp_path)
    assert_ok(result)
    output = result.stdout + result.stderr
    # Stills cannot train image-to-video (their only frame is the condition): with no 1-frame bucket they are left out, and said so.
    assert "3 file(s) are shorter than the shortest frame bucket (9)" in output
    run_dir = tmp_path / "runs" / "wan-i2v"
    result_summary = summary(run_dir)
    assert result_summary["fixed_batch_loss_end"] < 0.97 * result_summary["fixed_batch_loss_start"], result_summary
    # The first frame's CLIP embeddings (the image encoder's penultimate hidden states) are cached with each clip's latents.
    from safetensors.torch import load_file

    entries = [load_file(str(path)) for path in (tmp_path / "cache" / "latents").rglob("*.safetensors")]
    assert len(entries) == 9 and all(entry["image_embeds"].shape == (17, 32) and "condition" in entry for entry in entries)
    # A sample video drawn from a dataset clip's first frame.
    rows = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [10] and rows[0]["frames"] == 9 and rows[0]["first_frame"].endswith(".mp4")
    with av.open(str(run_dir / "samples" / rows[0]["video"])) as container:
        assert sum(1 for _ in container.decode(container.streams.video[0])) == 9

    out = tmp_path / "lora"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    def draw_from_image(pipeline):
        pipeline.set_progress_bar_config(disable=True)
        image = Image.new("RGB", (32, 32), (40, 80, 220))
        frames = pipeline(image=image, prompt=PROMPT, num_frames=5, height=32, width=32, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0)).frames
        return torch.from_numpy(frames)

    pipeline = WanImageToVideoPipeline.from_pretrained(str(folder))
    before = draw_from_image(pipeline)
    pipeline.load_lora_weights(str(out))
    after = draw_from_image(pipeline)
    assert after.shape == (1, 5, 32, 32, 3) and (after - before).abs().max() > 1e-3
    comfy = WanImageToVideoPipeline.from_pretrained(str(folder))
    comfy.load_lora_weights(str(out), weight_name="lora_comfyui.safetensors")
    assert torch.allclose(draw_from_image(comfy), after, atol=1e-4)
