"""Multi-reference edit training: a tiny Qwen-Image-Edit-Plus pipeline learns from two reference images per target, trained by 2 real DeepSpeed CPU ranks.

The targets are the generated shapes; reference 1 is the target in grey, reference 2 its
background colour alone, each in its own folder (diffusion-pipe's ``control_paths``). LoRA
under ZeRO-3: the loss on a fixed batch falls, a sample is one pipeline call with the item's
two references, the data step of a second run reuses every cache entry but those of the target
whose second reference changed, and the exported LoRA loads into ``QwenImageEditPlusPipeline``
and changes what it draws, which its second reference changes too.
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

EXAMPLES = 6


def reference_dataset(tmp_path: Path) -> tuple[Path, Path, Path]:
    targets, greys, backgrounds = tmp_path / "targets", tmp_path / "greys", tmp_path / "backgrounds"
    generate_shapes_dataset(targets, EXAMPLES, seed=5, resolution=32)
    for image in sorted((targets / "1_shapes").glob("*.png")):
        picture = Image.open(image).convert("RGB")
        for folder, made in ((greys, ImageOps.grayscale(picture).convert("RGB")), (backgrounds, Image.new("RGB", picture.size, picture.getpixel((0, 0))))):
            (folder / "1_shapes").mkdir(parents=True, exist_ok=True)
            made.save(folder / "1_shapes" / f"{image.stem}.png")
    return targets, greys, backgrounds


def test_qwen_image_edit_plus_lora_learns_from_two_references_samples_reuses_caches_and_exports(tmp_path):
    targets, greys, backgrounds = reference_dataset(tmp_path)
    prompt = (targets / "1_shapes" / "00000.txt").read_text().strip()
    config = {
        "run": {"name": "plus", "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"pipeline": "tiny-qwen-image-edit-plus"}, "lora": {"r": 8, "alpha": 16}},
        "data": {
            "path": str(targets), "control_paths": [str(greys), str(backgrounds)],
            "images": {"resolution": 32, "bucket_step": 16, "bucketing": False}, "cache": {"dir": str(tmp_path / "cache")},
        },
        "train": {"max_steps": 16, "micro_batch_size": 2, "lr": 2e-2, "warmup_steps": 1, "log_every": 2},
        "deepspeed": {"zero_stage": 3, "precision": "fp32"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": [prompt], "sample_steps": 2, "sample_every": 16},
    }
    path = tmp_path / "plus.yaml"
    path.write_text(f"# Run it: zeropipe train {path.name}\n" + yaml.safe_dump(config, sort_keys=False))
    result = zeropipe("train", path, cwd=tmp_path)
    assert_ok(result)
    output = result.stdout + result.stderr
    assert f"multi-reference edit training: {EXAMPLES} target image(s), each with 2 reference image(s) from {greys}, {backgrounds}" in output
    run_dir = tmp_path / "runs" / "plus"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["fixed_batch_loss_end"] < 0.97 * summary["fixed_batch_loss_start"], summary
    # The sample is one pipeline call with the two references of the item whose caption it is.
    rows = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    first = [str((folder / "1_shapes" / "00000.png").resolve()) for folder in (greys, backgrounds)]
    assert [(row["step"], row["references"]) for row in rows] == [(16, first)]
    assert Image.open(run_dir / "samples" / rows[0]["file"]).size == (32, 32)

    # The second reference of one target changes: the next data step re-encodes that target's latents and its two text entries only.
    ImageOps.invert(Image.open(backgrounds / "1_shapes" / "00003.png")).save(backgrounds / "1_shapes" / "00003.png")
    again = yaml.safe_load((run_dir / "config.yaml").read_text())
    again["model"] = {"path": str(run_dir / "pipeline"), "lora": again["model"]["lora"]}
    (tmp_path / "again").mkdir()
    prepared = prepare_diffusion_data(RunConfig.model_validate(again), RunDir(tmp_path / "again"), reuse=False)
    pairs = 2 * EXAMPLES  # each target's caption and the empty caption with its references (the sample prompt's pair is the first target's)
    assert f"latent cache {tmp_path / 'cache'}: {EXAMPLES - 1} of {EXAMPLES} image(s) cached already, 1 to encode" in prepared.notes
    assert f"text cache: {pairs - 2} of {pairs} (caption, reference images) pair(s) cached already, 2 to encode" in prepared.notes

    out = tmp_path / "lora"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from diffusers import QwenImageEditPlusPipeline

    from zeropipe.families.diffusion.entries import architecture_named

    arch = architecture_named("qwen-image-edit-plus")
    # No processor: transformers builds Qwen2VLProcessor only with torchvision; the prompt is given as embeddings.
    pipeline = QwenImageEditPlusPipeline.from_pretrained(str(run_dir / "pipeline"), processor=None)
    embeds, mask = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(1)), torch.ones(1, 12, dtype=torch.long)
    condition = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
    kwargs = {"height": 32, "width": 32, "num_inference_steps": 2, **arch.sampling.sample_kwargs(condition, condition, 1.0, 1.0)}
    references = [Image.open(folder / "1_shapes" / "00000.png") for folder in (greys, backgrounds)]

    def draw(images):
        return arch.sampling.draw(pipeline, {**kwargs, "generator": torch.Generator().manual_seed(0), "image": images})

    before = draw(references)
    assert (draw([references[0], ImageOps.invert(references[1])]) - before).abs().max() > 1e-3  # the second reference conditions the sample
    pipeline.load_lora_weights(str(out))
    assert (draw(references) - before).abs().max() > 1e-3
    from safetensors.torch import load_file

    assert "diffusion_model.transformer_blocks.0.attn.add_k_proj.lora_A.weight" in load_file(str(out / "lora_comfyui.safetensors"))
