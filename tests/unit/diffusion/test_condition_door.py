"""A diffusion architecture is a small core plus parts: the shared code loops over parts, and a new kind of condition is one class.

The toy entry with a new condition kind (a loudness per image, standing in for audio) lives in
tests/integration/plugins/toy_condition.py and touches no shared module; here its condition
changes the cache key, the cached entry and the denoiser's output.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from zeropipe.config.schema import RunConfig
from zeropipe.families.diffusion import cache
from zeropipe.families.diffusion import entries as architectures
from zeropipe.families.diffusion.entries import PredictContext, register, unregister
from zeropipe.data.images import generate_shapes_dataset
from zeropipe.families.diffusion.parts import Inputs
from zeropipe.families.diffusion.prepare import fill_caches, prepare_diffusion_data, read_plan
from zeropipe.rundir import RunDir

PACKAGE = Path(__file__).resolve().parents[3] / "src" / "zeropipe"
# The shared diffusion code: what runs for every entry and must ask its parts, never which kind an entry is.
SHARED = ("families/diffusion/task.py", "families/diffusion/prepare.py", "families/diffusion/pipelines.py", "families/diffusion/export.py", "families/diffusion/family.py", "families/diffusion/spec.py")
# The feature flags the entries had before the parts, and the codec's facts: no shared branch may read them.
FLAGS = {
    "video", "frame_conditioned", "control_images", "control_in_prompt", "samples_with_vae", "image_encoders", "prompt_processors",
    "shifted_latents", "vae_while_sampling", "frame_multiple", "frame_rate", "shifted",
}
PART_CLASSES = {
    "FirstFrame", "FirstFrameEmbeddings", "ControlImage", "ReferenceImages", "PromptText", "PromptWithControlImage", "PromptWithReferenceImages", "ImageLatents", "VideoLatents",
}


def flag_branches(source: str) -> list[int]:
    """Lines of conditions (if, x if c else y, comprehension filters, and/or) that read an entry flag or ask which part an entry has."""
    found = []
    for node in ast.walk(ast.parse(source)):
        tests = []
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests += node.ifs
        elif isinstance(node, ast.BoolOp):
            tests += node.values
        for test in tests:
            for inner in ast.walk(test):
                if isinstance(inner, ast.Attribute) and inner.attr in FLAGS | {"has_part"}:
                    found.append(inner.lineno)
                if isinstance(inner, ast.Call) and getattr(inner.func, "id", None) == "isinstance" and any(
                    isinstance(name, ast.Name) and name.id in PART_CLASSES for name in ast.walk(inner)
                ):
                    found.append(inner.lineno)
    return sorted(set(found))


def test_shared_diffusion_code_branches_on_no_entry_flag():
    found = {path: flag_branches((PACKAGE / path).read_text()) for path in SHARED}
    assert not any(found.values()), {path: lines for path, lines in found.items() if lines}


def test_the_flag_finder_finds_flags_and_part_checks():
    """The check above can fail: the branches the shared code had before the parts are found."""
    assert flag_branches("if self.arch.frame_conditioned:\n    pass\n") == [1]
    assert flag_branches("x = 1 if arch.record.video else 2\n") == [1]
    assert flag_branches("keys = [k for k in keys if arch.control_in_prompt]\n") == [1]
    assert flag_branches("if any(isinstance(part, ControlImage) for part in arch.record.parts):\n    pass\n") == [1]
    assert flag_branches("for part in arch.record.conditions:\n    part.encode(batch)\n") == []


def test_every_builtin_entry_declares_a_codec_a_prompt_part_and_its_conditions():
    entries = architectures.architectures()
    assert {name for name, arch in entries.items() if arch.record.codec.video} == {"wan", "wan-i2v", "hunyuan-video", "ltx-video", "wan-ti2v", "wan-ti2v-i2v", "hunyuan-video-1.5", "hunyuan-video-1.5-i2v", "skyreels-v2", "skyreels-v2-i2v", "ltx2", "kandinsky5-t2v", "kandinsky5-i2v", "cosmos-predict2-video2world",
        "wan-vace", "minimax-h3", "ltx-2.5",
        "minimax-h3-i2v",
        "kandinsky6",
        "kandinsky6-i2v",
        "wan-animate-2", "wan-animate-2-distilled",
        "cosmos3"}
    conditions = {name: [part.entry for part in arch.record.conditions] for name, arch in entries.items() if arch.record.conditions}
    assert conditions == {
        "wan-i2v": ["condition", "image_embeds"], "qwen-image-edit": ["control"], "flux-kontext": ["control"],
        "qwen-image-edit-plus": ["references"], "flux2": ["references"], "flux2-klein": ["references"],
        "wan-ti2v-i2v": ["condition"], "hunyuan-video-1.5-i2v": ["condition", "image_embeds"], "skyreels-v2-i2v": ["condition", "image_embeds"], "kandinsky5-i2v": ["condition"],
        "ltx2": ["audio"], "cosmos-predict2-video2world": ["condition"],
        "qwen-image-layered": ["layers"],
        "wan-vace": ["vace"],
        "minimax-h3": ["audio"],
        "minimax-h3-i2v": ["audio", "condition"],
        "ltx-2.5": ["audio"],
        "kandinsky6": ["audio"],
        "kandinsky6-i2v": ["audio", "condition"],
        "wan-animate-2": ["animate", "animate_clip"], "wan-animate-2-distilled": ["animate", "animate_clip"],
    }
    assert [name for name, arch in entries.items() if arch.record.text.processors] == ["qwen-image-edit", "qwen-image-edit-plus", "ltx2", "qwen-image-2.1", "flux3", "flux3-distilled",
                                                                                           "minimax-h3", "minimax-h3-i2v", "ltx-2.5"]  # FLUX.3, MiniMax-H3: Qwen3-VL through its text-encoder block


@pytest.fixture
def toy():
    import sys

    plugins = str(Path(__file__).resolve().parents[2] / "integration" / "plugins")
    sys.path.insert(0, plugins)
    try:
        import toy_condition
    finally:
        sys.path.remove(plugins)
    register(toy_condition.ARCHITECTURE)
    yield toy_condition
    unregister(toy_condition.ARCHITECTURE.record.name)


def loud_data(folder: Path, levels: list[float]) -> Path:
    generate_shapes_dataset(folder, len(levels), seed=2, resolution=32)
    for number, level in enumerate(levels):
        (folder / "1_shapes" / f"{number:05d}.loudness").write_text(f"{level}\n")
    return folder


def loud_config(tmp_path: Path, data: Path) -> RunConfig:
    return RunConfig.model_validate({
        "run": {"name": "loud", "output_dir": str(tmp_path / "runs")},
        "model": {"config": {"pipeline": "tiny-toy-loud-unet"}, "lora": {"r": 4}},
        "data": {"path": str(data), "images": {"resolution": 32, "bucket_step": 16, "bucketing": False, "flip": 0}, "cache": {"dir": str(tmp_path / "cache")}},
        "generate": {"prompts": ["a red circle"]},
    })


def test_a_new_condition_kind_keys_the_cache_fills_it_and_changes_the_denoisers_output(tmp_path, toy):
    data = loud_data(tmp_path / "data", [0.2, 0.9])
    config, run = loud_config(tmp_path, data), RunDir(tmp_path / "runs" / "loud")
    cpu = torch.device("cpu")

    prepare_diffusion_data(config, run, reuse=False)
    first = read_plan(run)
    assert first.architecture == "toy-loud-unet" and first.missing_latents == [0, 1]
    fill_caches(run, cpu, torch.float32)
    before = [cache.load_entry(first.cache_dir, "latents", keys[0]) for keys in first.latent_keys]
    assert not torch.equal(before[0]["loudness"], before[1]["loudness"])  # encoded by the setup process, per item

    # A new loudness for the first image: its key and entry change, the second image's stay and are reused.
    (data / "1_shapes" / "00000.loudness").write_text("0.55\n")
    prepare_diffusion_data(config, run, reuse=True)
    second = read_plan(run)
    assert second.latent_keys[0] != first.latent_keys[0] and second.latent_keys[1] == first.latent_keys[1]
    assert second.missing_latents == [0]
    fill_caches(run, cpu, torch.float32)
    after = cache.load_entry(second.cache_dir, "latents", second.latent_keys[0][0])
    # The same image (encoded alone now, two at a time before: equal to float rounding), another loudness.
    assert torch.allclose(after["mean"], before[0]["mean"], atol=1e-5) and not torch.equal(after["loudness"], before[0]["loudness"])

    # What the condition gives the denoiser changes its output, the prompt and the latents the same.
    arch, condition = toy.ARCHITECTURE, toy.ARCHITECTURE.record.conditions[0]
    unet = arch.model_class().from_pretrained(str(run.pipeline / "unet")).eval()
    batch = Inputs(cpu, torch.float32, normalize=lambda latents: latents)
    prompt = {"prompt_embeds": torch.randn(1, 77, 32, generator=torch.Generator().manual_seed(0))}
    latents, timesteps = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1)), torch.tensor([500])
    context = PredictContext(cpu, torch.float32, 2, 1.0)
    with torch.no_grad():
        outputs = [arch.call.predict(unet, latents, timesteps, {**prompt, **condition.inputs([entry["loudness"]], batch)}, context) for entry in (before[0], after)]
    assert outputs[0].shape == latents.shape and (outputs[0] - outputs[1]).abs().max() > 1e-4
