"""The image DiTs users train after Flux (Chroma, Qwen-Image, Z-Image, FLUX.2): tiny pipelines trained by 2 real DeepSpeed CPU ranks.

One test per model: LoRA under ZeRO-3 (with optimizer offload to host RAM), the loss on a
fixed batch falls, sample images are written during training, a second run takes every
latent and caption from the caches, and the exported LoRA loads with the pipeline's own
``load_lora_weights`` and changes its images; the ComfyUI/original-layout file changes the
original layers exactly as the diffusers LoRA changes diffusers' ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.integration.conftest import assert_a_second_run_would_encode_nothing, assert_ok, zeropipe, zeropipe_here
from zeropipe.data.images import generate_shapes_dataset

pytestmark = pytest.mark.integration

PROMPT = "a red circle on a blue background"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"


def image_config(tmp_path: Path, name: str, pipeline: str, **sections) -> Path:
    config = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"pipeline": pipeline}, "lora": {"r": 8, "alpha": 16}},
        "data": {"synthetic": {"task": "shapes", "examples": 24}, "images": {"resolution": 32, "bucket_step": 16}, "cache": {"dir": str(tmp_path / "cache")}},
        "train": {"max_steps": 10, "micro_batch_size": 4, "lr": 2e-2, "warmup_steps": 1, "log_every": 2},
        "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu", "precision": "fp32"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": [PROMPT], "sample_steps": 3, "sample_every": 5},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text("# Run it: zeropipe train " + path.name + "\n" + yaml.safe_dump(config, sort_keys=False))
    return path


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def train_lora_with_samples_and_cache_reuse(tmp_path: Path, name: str, pipeline: str) -> Path:
    """The shared part of each model's test: LoRA trains under ZeRO-3 + offload, samples, and a second run would encode nothing."""
    config = image_config(tmp_path, name, pipeline)
    result = zeropipe("train", config, cwd=tmp_path)
    assert_ok(result)
    run_dir = tmp_path / "runs" / name
    result_summary = summary(run_dir)
    assert result_summary["fixed_batch_loss_end"] < 0.97 * result_summary["fixed_batch_loss_start"], result_summary
    assert 0 < result_summary["parameters"]["trainable"] < 0.5 * result_summary["parameters"]["total"]
    rows = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [5, 10]
    from PIL import Image

    assert all(Image.open(run_dir / "samples" / row["file"]).size == (32, 32) for row in rows)

    assert_a_second_run_would_encode_nothing(run_dir, tmp_path / f"{name}-again")
    return run_dir


def draw(pipeline, **kwargs) -> torch.Tensor:
    pipeline.set_progress_bar_config(disable=True)
    images = pipeline(prompt=PROMPT, height=32, width=32, num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0), **kwargs).images
    return torch.from_numpy(images)


def fused_lora_deltas(pipeline_cls, pipeline_dir: Path, lora_dir: Path) -> dict[str, torch.Tensor]:
    """What the diffusers LoRA adds to each transformer weight: fused into the weights by diffusers, minus the base."""
    pipeline = pipeline_cls.from_pretrained(str(pipeline_dir))
    base = {key: value.clone() for key, value in pipeline.transformer.state_dict().items()}
    pipeline.load_lora_weights(str(lora_dir))
    pipeline.fuse_lora(lora_scale=1.0)
    pipeline.unload_lora_weights()
    fused = pipeline.transformer.state_dict()
    return {key.removesuffix(".weight"): fused[key] - base[key] for key in base if key.endswith(".weight") and not torch.equal(fused[key], base[key])}


def test_chroma_lora_zero3_offload_samples_reuses_caches_and_exports_diffusers_and_comfyui_loras(tmp_path):
    run_dir = train_lora_with_samples_and_cache_reuse(tmp_path, "chroma", "tiny-chroma")
    out = tmp_path / "lora"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from diffusers import ChromaPipeline
    from safetensors.torch import load_file

    pipeline = ChromaPipeline.from_pretrained(str(run_dir / "pipeline"))
    before = draw(pipeline)
    pipeline.load_lora_weights(str(out))
    after = draw(pipeline)
    assert after.shape == (1, 32, 32, 3) and (after - before).abs().max() > 1e-3

    # ComfyUI's layout: q, k, v fused (and the single blocks' q, k, v, MLP input). ComfyUI adds
    # alpha / rank x up @ down to the fused original weight; split into its parts in the
    # original order, that must be what the diffusers LoRA adds to diffusers' separate layers.
    comfy = load_file(str(out / "lora_comfyui.safetensors"))
    assert {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight", "lora_unet_double_blocks_0_txt_attn_proj.alpha", "lora_unet_single_blocks_0_linear1.lora_up.weight"} <= set(comfy)
    expected = fused_lora_deltas(ChromaPipeline, run_dir / "pipeline", out)
    parts = {"double_blocks.0.img_attn.qkv": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v"],
             "double_blocks.0.txt_attn.qkv": ["transformer_blocks.0.attn.add_q_proj", "transformer_blocks.0.attn.add_k_proj", "transformer_blocks.0.attn.add_v_proj"],
             "double_blocks.0.img_attn.proj": ["transformer_blocks.0.attn.to_out.0"], "double_blocks.0.txt_attn.proj": ["transformer_blocks.0.attn.to_add_out"],
             "single_blocks.0.linear1": ["single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k", "single_transformer_blocks.0.attn.to_v", "single_transformer_blocks.0.proj_mlp"]}
    checked = set()
    for original, modules in parts.items():
        name = "lora_unet_" + original.replace(".", "_")
        down, up = comfy[f"{name}.lora_down.weight"], comfy[f"{name}.lora_up.weight"]
        delta = float(comfy[f"{name}.alpha"]) / down.shape[0] * up @ down
        inner = 32  # the tiny transformer: 2 heads x 16
        sizes = [inner] * len(modules) if len(modules) < 4 else [inner, inner, inner, delta.shape[0] - 3 * inner]
        for module, piece in zip(modules, torch.split(delta, sizes)):
            if module.endswith("proj_mlp"):  # not a LoRA target: its rows stay zero
                assert module not in expected and piece.abs().max() == 0
                continue
            torch.testing.assert_close(piece, expected[module], rtol=1e-4, atol=1e-6)
            checked.add(module)
    assert checked == {module for module in expected if module.startswith(("transformer_blocks.0.", "single_transformer_blocks.0."))}


def test_qwen_image_lora_zero3_offload_samples_reuses_caches_and_exports_diffusers_and_comfyui_loras(tmp_path):
    """Qwen-Image's layout: a one-frame video VAE, Qwen2.5-VL prompts of their own length with a mask, true CFG samples."""
    run_dir = train_lora_with_samples_and_cache_reuse(tmp_path, "qwen", "tiny-qwen-image")
    out = tmp_path / "lora"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from diffusers import QwenImagePipeline
    from safetensors.torch import load_file

    pipeline = QwenImagePipeline.from_pretrained(str(run_dir / "pipeline"))
    before = draw(pipeline)
    pipeline.load_lora_weights(str(out))
    after = draw(pipeline)
    assert after.shape == (1, 32, 32, 3) and (after - before).abs().max() > 1e-3

    comfy = load_file(str(out / "lora_comfyui.safetensors"))
    assert "diffusion_model.transformer_blocks.0.attn.add_k_proj.lora_A.weight" in comfy and float(comfy["diffusion_model.transformer_blocks.1.attn.to_q.alpha"]) == 16.0
    comfy_pipeline = QwenImagePipeline.from_pretrained(str(run_dir / "pipeline"))
    comfy_pipeline.load_lora_weights(str(out), weight_name="lora_comfyui.safetensors")  # diffusers' converter for non-diffusers Qwen-Image LoRAs
    assert torch.allclose(draw(comfy_pipeline), after, atol=1e-4)


def test_z_image_lora_zero3_offload_samples_reuses_caches_and_exports_diffusers_and_comfyui_loras(tmp_path):
    """Z-Image's layout: list inputs, reversed time and negated flow, Qwen3 chat-template prompts of their own length."""
    run_dir = train_lora_with_samples_and_cache_reuse(tmp_path, "zimage", "tiny-z-image")
    out = tmp_path / "lora"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from diffusers import ZImagePipeline
    from safetensors.torch import load_file

    pipeline = ZImagePipeline.from_pretrained(str(run_dir / "pipeline"))
    before = draw(pipeline)
    pipeline.load_lora_weights(str(out))
    after = draw(pipeline)
    assert after.shape == (1, 32, 32, 3) and (after - before).abs().max() > 1e-3

    comfy = load_file(str(out / "lora_comfyui.safetensors"))
    assert {"diffusion_model.layers.0.attention.to_q.lora_A.weight", "diffusion_model.noise_refiner.0.feed_forward.w2.lora_B.weight",
            "diffusion_model.context_refiner.0.attention.to_out.0.alpha"} <= set(comfy)
    comfy_pipeline = ZImagePipeline.from_pretrained(str(run_dir / "pipeline"))
    comfy_pipeline.load_lora_weights(str(out), weight_name="lora_comfyui.safetensors")  # diffusers' converter for non-diffusers Z-Image LoRAs
    assert torch.allclose(draw(comfy_pipeline), after, atol=1e-4)


def test_flux2_lora_zero3_offload_samples_reuses_caches_and_exports_diffusers_and_comfyui_loras(tmp_path):
    """FLUX.2 [dev]'s layout: 2x2-patched latents normalised by the VAE's batch norm, stacked Mistral layers, embedded guidance; BFL-named LoRA."""
    run_dir = train_lora_with_samples_and_cache_reuse(tmp_path, "flux2", "tiny-flux2")
    out = tmp_path / "lora"
    assert_ok(zeropipe_here("export", run_dir, "--out", out, "--dtype", "fp32"))
    from diffusers import Flux2Pipeline
    from safetensors.torch import load_file

    layers = (1, 2, 3)  # the tiny Mistral's quarters (the pipeline's default 10, 20, 30 are Mistral Small's 40 layers')
    pipeline = Flux2Pipeline.from_pretrained(str(run_dir / "pipeline"))
    before = draw(pipeline, text_encoder_out_layers=layers)
    pipeline.load_lora_weights(str(out))
    after = draw(pipeline, text_encoder_out_layers=layers)
    assert after.shape == (1, 32, 32, 3) and (after - before).abs().max() > 1e-3

    # BFL's names under diffusion_model. (q/k/v fused), read back by diffusers' converter of such LoRAs: the same images.
    comfy = load_file(str(out / "lora_comfyui.safetensors"))
    assert {"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight", "diffusion_model.double_blocks.0.txt_attn.proj.lora_B.weight",
            "diffusion_model.single_blocks.0.linear1.lora_A.weight", "diffusion_model.single_blocks.0.linear2.lora_B.weight"} <= set(comfy)
    comfy_pipeline = Flux2Pipeline.from_pretrained(str(run_dir / "pipeline"))
    comfy_pipeline.load_lora_weights(str(out), weight_name="lora_comfyui.safetensors")
    assert torch.allclose(draw(comfy_pipeline, text_encoder_out_layers=layers), after, atol=1e-4)


def real_layout(catalog: str, pipeline: str, out: Path) -> Path:
    """A diffusers directory of a real model's layout (model_index.json and each component's config, no weights), from the planner's catalog."""
    entry = json.loads((Path(__file__).resolve().parents[2] / "src" / "zeropipe" / "plan" / "catalog" / f"{catalog}.json").read_text())
    index = {"_class_name": pipeline, "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    for component in (entry["trained"], *entry["frozen"]):
        name = component["name"].split(" ")[0]
        index[name] = [component["library"], component["class"]]
        (out / name).mkdir(parents=True)
        (out / name / "config.json").write_text(json.dumps(component["config"]))
    (out / "scheduler").mkdir()
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000}))
    (out / "model_index.json").write_text(json.dumps(index))
    return out


@pytest.mark.parametrize(
    "example,catalog,pipeline,per_gpu_gib",
    [
        ("chroma", "chroma1-hd", "ChromaPipeline", 16), ("qwen-image", "qwen-image", "QwenImagePipeline", 18), ("z-image", "z-image-turbo", "ZImagePipeline", 12),
        ("qwen-image-edit", "qwen-image-edit", "QwenImageEditPipeline", 16),
        ("ideogram4", "ideogram-4", "Ideogram4Pipeline", 12),
        ("qwen-image-2.1", "qwen-image-2.1", "QwenImage21Pipeline", 12),
    ],
)
def test_each_model_example_needs_only_its_paths_and_fits_5_gpus_of_24gb_with_64gb_of_ram(tmp_path, example, catalog, pipeline, per_gpu_gib):
    """The example with model.path and data.path pointed at a real model's layout and a folder of images: accepted, and its own settings fit."""
    from zeropipe.config.load import load_config
    from zeropipe.families import model_spec
    from zeropipe.launch.resolve import resolve_run
    from zeropipe.plan import parse_hardware, plan_run

    path = EXAMPLES / f"{example}.yaml"
    assert path.read_text().startswith(f"# Run it:  zeropipe train examples/models/{example}.yaml")
    model_dir = real_layout(catalog, pipeline, tmp_path / catalog)
    images = generate_shapes_dataset(tmp_path / "images", 4, seed=1, resolution=64)
    # precision: auto is bf16 on the GPUs the example is written for (fp32 on this CPU).
    overrides = [f"model.path={model_dir}", f"data.path={images}", "deepspeed.precision=bf16"]
    if "control_path:" in path.read_text():  # edit training: the targets' control images (the same pictures will do for the plan)
        overrides.append(f"data.control_path={images}")
    config = resolve_run(load_config(path, overrides), fill_auto_knobs=False).config
    result = plan_run(config, parse_hardware("5x24GB", "64GB"), model_spec(config))
    assert result.configured is not None and result.configured.fits, result.configured and result.configured.why_not
    # Training's peak per GPU; the node's setup process (the text encoders filling the caches,
    # before any rank starts) is its own phase, planned and within the GPU too (fits, above).
    from zeropipe.plan.memory import CACHE_FILLING, peak_bytes

    training = [t for t in result.configured.per_gpu_terms if t.phase != CACHE_FILLING]
    assert peak_bytes(training) < per_gpu_gib * 2**30
    # With the caches on, no training rank holds the text encoder or the VAE.
    assert {model.name for model in result.spec.cached_models} == {"text_encoder", "vae"} and not result.spec.frozen_models


def test_the_flux2_example_fits_5_gpus_of_24gb_with_64gb_of_ram_on_an_fp8_base_and_says_why_not_in_bf16(tmp_path):
    """FLUX.2 [dev]'s example with its paths pointed at the real layout: its fp8 base fits one 5x24 GB / 64 GB box; in bf16 the host RAM while 5 ranks build their shares is the limit."""
    from zeropipe.config.load import load_config
    from zeropipe.families import model_spec
    from zeropipe.launch.resolve import resolve_run
    from zeropipe.plan import parse_hardware, plan_run

    path = EXAMPLES / "flux2.yaml"
    assert path.read_text().startswith("# Run it:  zeropipe train examples/models/flux2.yaml")
    model_dir = real_layout("flux.2-dev", "Flux2Pipeline", tmp_path / "flux2")
    images = generate_shapes_dataset(tmp_path / "images", 4, seed=1, resolution=64)

    def configured(*overrides, nodes=1):
        config = resolve_run(load_config(path, [f"model.path={model_dir}", f"data.path={images}", "deepspeed.precision=bf16", *overrides]), fill_auto_knobs=False).config
        spec = model_spec(config)
        assert {model.name for model in spec.cached_models} == {"text_encoder", "vae"} and not spec.frozen_models
        return plan_run(config, parse_hardware("5x24GB", "64GB", nodes=nodes), spec).configured

    fp8 = configured()
    assert fp8.fits and fp8.per_gpu_bytes < 17 * 2**30 and fp8.per_node_bytes < 48 * 2**30
    with_64gb = configured("model.quantization=null")
    assert not with_64gb.fits and "host RAM" in with_64gb.why_not and "model loading peak" in with_64gb.why_not
    # Two such boxes (what the example's comment offers for a bf16 base): each node loads half as much.
    two_nodes = configured("model.quantization=null", nodes=2)
    assert two_nodes.fits and two_nodes.per_node_bytes < 48 * 2**30
