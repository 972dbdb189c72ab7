"""Edit training: a tiny Qwen-Image-Edit pipeline learns to colour grey control images, trained by 2 real DeepSpeed CPU ranks.

The targets are the generated shapes; each control image is its target in grey (a JPEG, so
it is matched by file name alone). LoRA under ZeRO-3 with optimizer offload: the loss on a
fixed batch falls, a sample edits a data control image, the data step of a second run
reuses every cache entry but those of the one control image that changed, and the exported LoRA loads into
``QwenImageEditPipeline`` and changes what its transformer predicts for a control image.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image, ImageOps

from tests.integration.conftest import assert_ok, zeropipe, zeropipe_here
from zeropipe.config.schema import RunConfig
from zeropipe.data.images import generate_shapes_dataset
from zeropipe.families.diffusion.prepare import prepare_diffusion_data
from zeropipe.rundir import RunDir

pytestmark = pytest.mark.integration

EXAMPLES = 8


def edit_dataset(tmp_path: Path) -> tuple[Path, Path]:
    targets, controls = tmp_path / "targets", tmp_path / "controls"
    generate_shapes_dataset(targets, EXAMPLES, seed=5, resolution=32)
    for image in sorted((targets / "1_shapes").glob("*.png")):
        grey = ImageOps.grayscale(Image.open(image)).convert("RGB")
        (controls / "1_shapes").mkdir(parents=True, exist_ok=True)
        grey.save(controls / "1_shapes" / f"{image.stem}.jpg", quality=95)
    return targets, controls


def edit_config(tmp_path: Path, name: str, targets: Path, controls: Path) -> Path:
    prompt = (targets / "1_shapes" / "00000.txt").read_text().strip()
    config = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"pipeline": "tiny-qwen-image-edit"}, "lora": {"r": 8, "alpha": 16}},
        "data": {
            "path": str(targets), "control_path": str(controls), "images": {"resolution": 32, "bucket_step": 16, "bucketing": False},
            "cache": {"dir": str(tmp_path / "cache")},
        },
        "train": {"max_steps": 16, "micro_batch_size": 2, "lr": 2e-2, "warmup_steps": 1, "log_every": 2},
        "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu", "precision": "fp32"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": [prompt], "sample_steps": 2, "sample_every": 16},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"# Run it: zeropipe train {path.name}\n" + yaml.safe_dump(config, sort_keys=False))
    return path


def test_qwen_image_edit_lora_learns_from_control_images_reuses_caches_and_exports(tmp_path):
    targets, controls = edit_dataset(tmp_path)
    result = zeropipe("train", edit_config(tmp_path, "edit", targets, controls), cwd=tmp_path)
    assert_ok(result)
    output = result.stdout + result.stderr
    assert f"edit training: {EXAMPLES} target image(s), each with its control image from {controls}" in output
    run_dir = tmp_path / "runs" / "edit"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["fixed_batch_loss_end"] < 0.97 * summary["fixed_batch_loss_start"], summary
    # The sample edits the control image of the item whose caption it is.
    rows = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    assert [(row["step"], row["control"]) for row in rows] == [(16, str((controls / "1_shapes" / "00000.jpg").resolve()))]
    assert Image.open(run_dir / "samples" / rows[0]["file"]).size == (32, 32)

    # One control image changes: the launcher's data step (the one a second run takes, here in-process to save a
    # run's start-up) reuses every cache entry but that target's latents and its two text entries (its caption and the empty one).
    grey = Image.open(controls / "1_shapes" / "00003.jpg")
    ImageOps.invert(grey).save(controls / "1_shapes" / "00003.jpg", quality=95)
    again = yaml.safe_load((run_dir / "config.yaml").read_text())
    again["model"] = {"path": str(run_dir / "pipeline"), "lora": again["model"]["lora"]}
    (tmp_path / "again").mkdir()
    prepared = prepare_diffusion_data(RunConfig.model_validate(again), RunDir(tmp_path / "again"), reuse=False)
    pairs = 2 * EXAMPLES  # each target's caption and empty caption with its control image (the sample prompt's pair is the first target's)
    assert f"latent cache {tmp_path / 'cache'}: {EXAMPLES - 1} of {EXAMPLES} image(s) cached already, 1 to encode" in prepared.notes
    assert f"text cache: {pairs - 2} of {pairs} (caption, control image) pair(s) cached already, 2 to encode" in prepared.notes
    assert prepared.node_setup == "zeropipe.families.diffusion.prepare:fill_caches"

    out = tmp_path / "lora"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from diffusers import QwenImageEditPipeline

    from zeropipe.families.diffusion.entries import architecture_named

    arch = architecture_named("qwen-image-edit")
    # No processor: transformers builds Qwen2VLProcessor only with torchvision; the prompt is given as embeddings.
    pipeline = QwenImageEditPipeline.from_pretrained(str(run_dir / "pipeline"), processor=None)
    embeds, mask = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(1)), torch.ones(1, 12, dtype=torch.long)
    kwargs = {
        "height": 32, "width": 32, "num_inference_steps": 2,
        **arch.sampling.sample_kwargs({"prompt_embeds": embeds, "prompt_embeds_mask": mask}, {"prompt_embeds": embeds, "prompt_embeds_mask": mask}, 1.0, 1.0),
    }
    control = Image.open(controls / "1_shapes" / "00000.jpg")

    def draw(image):
        return arch.sampling.draw(pipeline, {**kwargs, "generator": torch.Generator().manual_seed(0), "image": image})

    before = draw(control)
    assert (draw(ImageOps.invert(control)) - before).abs().max() > 1e-3  # the control image conditions the sample
    pipeline.load_lora_weights(str(out))
    assert (draw(control) - before).abs().max() > 1e-3
    from safetensors.torch import load_file

    comfy = load_file(str(out / "lora_comfyui.safetensors"))
    assert "diffusion_model.transformer_blocks.0.attn.add_k_proj.lora_A.weight" in comfy


def test_flux_kontext_lora_learns_from_control_images_and_its_pipeline_samples_them(tmp_path):
    """The same door for Flux Kontext: control latents cached with the target's, captions cached alone (its text encoders do not see the image)."""
    targets, controls = edit_dataset(tmp_path)
    config = edit_config(tmp_path, "kontext", targets, controls)
    config.write_text(config.read_text().replace("pipeline: tiny-qwen-image-edit", "pipeline: tiny-flux-kontext"))
    result = zeropipe("train", config, cwd=tmp_path)
    assert_ok(result)
    run_dir = tmp_path / "runs" / "kontext"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["fixed_batch_loss_end"] < 0.97 * summary["fixed_batch_loss_start"], summary
    rows = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    assert [(row["step"], row["control"]) for row in rows] == [(16, str((controls / "1_shapes" / "00000.jpg").resolve()))]
    assert Image.open(run_dir / "samples" / rows[0]["file"]).size == (32, 32)

    out = tmp_path / "lora"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from diffusers import FluxKontextPipeline

    pipeline = FluxKontextPipeline.from_pretrained(str(run_dir / "pipeline"))
    pipeline.set_progress_bar_config(disable=True)
    control = Image.open(controls / "1_shapes" / "00000.jpg")

    def draw():
        return pipeline(
            prompt="a red circle", image=control, height=32, width=32, max_area=32 * 32, _auto_resize=False, num_inference_steps=2,
            output_type="np", generator=torch.Generator().manual_seed(0),
        ).images

    before = draw()
    pipeline.load_lora_weights(str(out))
    assert abs(draw() - before).max() > 1e-3
