"""Diffusion training end to end: real 2-rank DeepSpeed runs on CPU with tiny pipelines built from config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.conftest import assert_ok, metrics, zeropipe, zeropipe_here
from zeropipe.data.images import generate_shapes_dataset

pytestmark = pytest.mark.integration


def diffusion_config(tmp_path: Path, name: str, pipeline: str = "tiny-sdxl", **sections) -> Path:
    config = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"pipeline": pipeline}},
        "data": {"synthetic": {"task": "shapes", "examples": 48}, "images": {"resolution": 32, "bucket_step": 8}},
        "train": {"max_steps": 12, "micro_batch_size": 4, "lr": 1e-3, "warmup_steps": 1, "log_every": 4},
        "deepspeed": {"zero_stage": 2, "precision": "auto"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": ["a red circle on a blue background"], "sample_steps": 4},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text("# Run it: zeropipe train " + path.name + "\n" + yaml.safe_dump(config, sort_keys=False))
    return path


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_learned(run_dir: Path, by: float = 0.1) -> None:
    """The loss on a fixed batch (fixed noise and timesteps) fell by at least the fraction ``by``."""
    result = summary(run_dir)
    assert result["fixed_batch_loss_end"] < (1 - by) * result["fixed_batch_loss_start"], result


def test_sdxl_full_finetune_with_bad_images_caches_samples_and_exports(tmp_path):
    """Full fine-tune under ZeRO-2 on a kohya folder with two broken images; a second run hits the caches; the export loads in diffusers."""
    images = generate_shapes_dataset(tmp_path / "images", 40, seed=1, resolution=32)
    concept = images / "1_shapes"
    truncated = concept / "broken.png"
    truncated.write_bytes((concept / "00000.png").read_bytes()[:60])
    (concept / "notes.jpg").write_text("not an image")
    config = diffusion_config(
        tmp_path, "sdxl", data={"path": str(images), "synthetic": None, "max_bad_fraction": 0.1, "images": {"resolution": 32, "bucket_step": 8, "flip": 0.5}},
        generate={"prompts": ["a red circle on a blue background", "a green square on a white background"], "sample_every": 6, "sample_steps": 4},
        train={"max_steps": 14, "micro_batch_size": 4, "lr": 1e-3, "warmup_steps": 1, "save_every": 7},
    )
    first = zeropipe("train", config, cwd=tmp_path)
    assert_ok(first)
    run_dir = tmp_path / "runs" / "sdxl"
    assert "skipped 2 unusable image(s)" in (first.stdout + first.stderr) and "broken.png" in (first.stdout + first.stderr) and "notes.jpg" in (first.stdout + first.stderr)
    assert "0 of 40 image(s) cached already, 40 to encode" in (first.stdout + first.stderr)
    assert_learned(run_dir)
    # Samples at step 6, 12 and the end, in the layout the UI reads.
    rows = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    assert {row["step"] for row in rows} == {6, 12, 14} and all((run_dir / "samples" / row["file"]).is_file() for row in rows)
    from PIL import Image

    assert Image.open(run_dir / "samples" / rows[-1]["file"]).size == (32, 32)

    # Same images, same model (rebuilt from the same config and seed: the same weights): every latent and caption comes from the cache and no rank loads the VAE or a text encoder.
    second_config = tmp_path / "sdxl-again.yaml"
    second_config.write_text(config.read_text().replace("name: sdxl", "name: sdxl-again").replace("sample_every: 6", "sample_every: null"))
    second = zeropipe("train", second_config, "train.max_steps=4", cwd=tmp_path)
    assert_ok(second)
    assert "40 of 40 image(s) cached already, 0 to encode" in (second.stdout + second.stderr)
    assert "caches complete: the training ranks will not load the VAE or the text encoders" in (second.stdout + second.stderr)
    rows = metrics(tmp_path / "runs" / "sdxl-again")
    assert rows and all(row["frozen_components_loaded"] == [] for row in rows)
    assert "cached" not in (tmp_path / "runs" / "sdxl-again" / "logs" / "rank1.log").read_text()

    # Caches off (a cache folder of its own, so that no caption embedding is found there): the ranks
    # hold the VAE and the text encoders and encode each micro-batch, and train exactly as from the caches.
    uncached_config = tmp_path / "sdxl-uncached.yaml"
    uncached_config.write_text(second_config.read_text().replace("name: sdxl-again", "name: sdxl-uncached"))
    uncached = zeropipe(
        "train", uncached_config, "train.max_steps=4", "data.cache.latents=false", "data.cache.text=false", f"data.cache.dir={tmp_path / 'cache-off'}", cwd=tmp_path
    )
    assert_ok(uncached)
    uncached_rows = metrics(tmp_path / "runs" / "sdxl-uncached")
    assert uncached_rows and all(row["frozen_components_loaded"] == ["vae", "text_encoders"] for row in uncached_rows)
    assert [row["loss"] for row in uncached_rows] == pytest.approx([row["loss"] for row in rows], rel=1e-5)

    out = tmp_path / "export"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(out))
    assert type(pipeline).__name__ == "StableDiffusionXLPipeline"
    # The exported UNet holds the trained weights, not the initial ones.
    trained = pipeline.unet.state_dict()
    initial = DiffusionPipeline.from_pretrained(str(run_dir / "pipeline")).unet.state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)
    image = pipeline("a red circle on a blue background", num_inference_steps=3, height=32, width=32, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (32, 32)


def test_sdxl_lora_under_zero3_exports_a_diffusers_lora(tmp_path):
    """LoRA under ZeRO-3: only adapters train; the exported file loads with load_lora_weights and changes the images."""
    config = diffusion_config(
        tmp_path, "lora", model={"config": {"pipeline": "tiny-sdxl"}, "lora": {"r": 8, "alpha": 16}},
        deepspeed={"zero_stage": 3, "precision": "auto"}, train={"max_steps": 12, "micro_batch_size": 4, "lr": 2e-2, "warmup_steps": 1},
    )
    result = zeropipe("train", config, cwd=tmp_path)
    assert_ok(result)
    run_dir = tmp_path / "runs" / "lora"
    # Adapters on the attention projections of a random UNet: a smaller but steady fall.
    assert_learned(run_dir, by=0.03)
    counts = summary(run_dir)["parameters"]
    assert 0 < counts["trainable"] < 0.2 * counts["total"]
    out = tmp_path / "lora-export"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    from diffusers import DiffusionPipeline

    def draw(pipeline):
        return pipeline("a red circle", num_inference_steps=2, height=32, width=32, output_type="np", generator=torch.Generator().manual_seed(0)).images

    pipeline = DiffusionPipeline.from_pretrained(str(run_dir / "pipeline"))
    before = draw(pipeline)
    pipeline.load_lora_weights(str(out))
    after = draw(pipeline)
    assert after.shape == before.shape and abs(after - before).max() > 1e-4
    # --merge: the adapter fused into a full pipeline draws what base + adapter draws.
    merged_dir = tmp_path / "merged"
    assert_ok(zeropipe_here("export", run_dir, "--out", merged_dir, "--merge", "--dtype", "fp32"))
    merged = draw(DiffusionPipeline.from_pretrained(str(merged_dir)))
    assert abs(merged - after).max() < 1e-3


@pytest.mark.parametrize("pipeline", ["tiny-flux", "tiny-sd3"])
def test_transformer_family_trains_with_flow_matching(tmp_path, pipeline):
    """SD3 and Flux layouts: rectified flow with logit-normal timesteps; the fixed-batch loss falls."""
    config = diffusion_config(
        tmp_path, pipeline, pipeline=pipeline, generate={"prompts": ["a red circle"], "sample_steps": 3},
        train={"max_steps": 16, "micro_batch_size": 4, "lr": 2e-3, "warmup_steps": 1, "log_every": 4},
    )
    result = zeropipe("train", config, cwd=tmp_path)
    assert_ok(result)
    run_dir = tmp_path / "runs" / pipeline
    assert_learned(run_dir)
    assert (run_dir / "samples" / "index.jsonl").is_file()
