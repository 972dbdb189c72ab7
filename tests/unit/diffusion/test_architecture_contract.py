"""The contract every registered diffusion architecture keeps, one parametrized test per entry.

Each registered entry (``zeropipe.families.diffusion.entries``: the built-ins and any plug-in registered
before collection) goes through the run's own code in this process, on its tiny preset:

- the launcher's data step (``prepare_run``: the tiny pipeline built, buckets, cache keys) and the
  node's cache filling (``fill_caches``);
- a cache round trip: a second data step finds every latent and text entry (nothing to encode),
  and entries written again into another cache folder are read back identical;
- one rank of the real trainer (``engine.trainer.Trainer``, DeepSpeed ZeRO-3 on the CPU with gloo,
  world size 1) trains the LoRA a few steps through the entry's ``predict`` and draws one sample
  through the entry's sampling (``RankTask.generate_samples``);
- the exports (``families.export_run``): the LoRA file is read by diffusers' loader (the pipeline's
  ``load_lora_weights``, or the denoiser's ``load_lora_adapter`` where the pipeline has no loader)
  and changes the denoiser's output; the merged export is a full pipeline directory that the
  entry's pipeline class loads, whose denoiser gives the output of base + LoRA.

A real 2-rank run of each *kind* of part stays in tests/integration; here a new entry costs
seconds. Every assertion names the entry.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from zeropipe.families.diffusion import entries as architectures

ENTRIES = sorted(architectures.architectures())
PROMPT_COUNT = 1
EXAMPLES = 4
RESOLUTION = 32


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def grey_controls(targets: Path, controls: Path) -> None:
    """A control image per target: the target in grey (what edit entries learn to colour)."""
    from PIL import Image, ImageOps

    for image in sorted(targets.rglob("*.png")):
        out = controls / image.relative_to(targets).with_suffix(".jpg")
        out.parent.mkdir(parents=True, exist_ok=True)
        ImageOps.grayscale(Image.open(image)).convert("RGB").save(out, quality=95)


def data_section(arch, tmp_path: Path) -> dict:
    """The data an entry trains on: generated shapes (clips for a video codec), and what each of its parts reads (``config_keys``).

    A part reading a setting this test cannot provide fails here by name: teach ``PROVIDERS`` its data.
    """
    data = {"images": {"resolution": RESOLUTION, "bucket_step": RESOLUTION, "bucketing": False, "flip": 0}, "cache": {"dir": str(tmp_path / "cache")}}
    if arch.codec.video:
        data["video"] = {"frame_buckets": [1 + arch.codec.frame_multiple]}
    keys = sorted({key for part in arch.parts for key in part.config_keys()})
    unknown = [key for key in keys if key not in PROVIDERS]
    assert not unknown, f"{arch.name}: its parts read {unknown}, which the contract test does not provide yet: add them to PROVIDERS"
    # A few files of generated shapes (data.synthetic's smallest set is 10: more encoding than a contract needs).
    # Written by the entry's codec, as data.synthetic would be: shapes, moving-shape clips, or LTX-2's clips with a tone as their sound.
    from types import SimpleNamespace

    targets = tmp_path / "targets"
    frames = [1 + arch.codec.frame_multiple] if arch.codec.video else [1]
    synthetic = SimpleNamespace(data=SimpleNamespace(synthetic=SimpleNamespace(examples=EXAMPLES, seed=5), images=SimpleNamespace(resolution=RESOLUTION), video=SimpleNamespace(frame_buckets=frames)))
    _, write = arch.codec.synthetic_folder(tmp_path, synthetic)
    write(targets)
    data["path"] = str(targets)
    for key in keys:
        PROVIDERS[key](data, targets, tmp_path)
    return data


def control_images(data: dict, targets: Path, tmp_path: Path) -> None:
    grey_controls(targets, tmp_path / "controls")
    data["control_path"] = str(tmp_path / "controls")


def reference_images(data: dict, targets: Path, tmp_path: Path) -> None:
    """Two reference images per target, a folder each (diffusion-pipe's control_paths): the target in grey, and its background alone.

    They replace data.control_path where an entry's part reads both (FLUX.2), and the images are 64 px, the smallest
    reference image FLUX.2's pipeline takes (its samples give it the references at the training size).
    """
    from PIL import Image

    grey, background = tmp_path / "reference-grey", tmp_path / "reference-background"
    grey_controls(targets, grey)
    for image in sorted(targets.rglob("*.png")):
        out = background / image.relative_to(targets)
        out.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(image) as opened:
            Image.new("RGB", opened.size, opened.convert("RGB").getpixel((0, 0))).save(out)
    data.pop("control_path", None)
    data["control_paths"] = [str(grey), str(background)]
    data["images"]["resolution"] = max(data["images"]["resolution"], 64)
    data["images"]["bucket_step"] = data["images"]["resolution"]


PROVIDERS = {"data.control_path": control_images, "data.control_paths": reference_images}


def run_config(arch, tmp_path: Path, name: str, data: dict, **overrides) -> dict:
    config = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"pipeline": arch.preset_name}, "lora": {"r": 4, "alpha": 8}},
        "data": data,
        "train": {"max_steps": 2, "micro_batch_size": 2, "lr": 5e-2, "schedule": "constant", "log_every": 1},
        "deepspeed": {"zero_stage": 3, "precision": "fp32"},
        "hardware": {"gpus": 1, "accelerator": "cpu"},
        "generate": {"prompts": ["a red circle"], "sample_steps": 2},
    }
    for section, values in overrides.items():
        config[section].update(values)
    return config


def prepare(raw: dict):
    """The launcher's own steps: resolve, check the entry's parts, lay out the run directory and plan its data."""
    import yaml

    from zeropipe.config.load import validate_config
    from zeropipe.launch.prepare import prepare_run
    from zeropipe.launch.resolve import resolve_run

    return prepare_run(resolve_run(validate_config(yaml.safe_load(yaml.safe_dump(raw)))))


def cache_files(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    from zeropipe.families.diffusion import cache

    return {path.stem: cache.load_entry(folder, kind, path.stem) for kind in ("latents", "text") for path in sorted((folder / kind).rglob("*.safetensors"))}


def one_rank(run_path: Path, monkeypatch):
    """The rank's trainer of a prepared run, in this process: world size 1, gloo on the CPU."""
    from zeropipe.engine.trainer import Trainer
    from zeropipe.families import family_of
    from zeropipe.rundir import RunDir

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ZEROPIPE_LAUNCHER_PID", raising=False)
    return Trainer(run_path, family_of(RunDir(run_path).read_config().model).rank_task)


def denoiser_output(arch, model, batch) -> torch.Tensor:
    latents, timesteps, condition, context = batch
    with torch.no_grad():
        return arch.predict(model.eval(), latents, timesteps, condition, context).float()


@pytest.fixture(autouse=True)
def cpu_deepspeed(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ENTRIES)
def test_an_entry_caches_trains_under_zero3_samples_and_exports_what_diffusers_loads(tmp_path, monkeypatch, name):
    from zeropipe.families import export_run
    from zeropipe.families.diffusion.prepare import fill_caches, prepare_diffusion_data, read_plan
    from zeropipe.rundir import RunDir

    arch = architectures.architecture_named(name)
    assert arch.preset_name, f"{name}: every entry has a tiny preset (its tests and demos build it from config)"
    cpu = torch.device("cpu")

    # ---- the launcher's data step and the node's caches
    data = data_section(arch, tmp_path)
    prepared = prepare(run_config(arch, tmp_path, "contract", data))
    run = prepared.run
    plan = read_plan(run)
    assert plan.architecture == name and plan.missing_latents, f"{name}: the data step planned no latents to encode"
    fill_caches(run, cpu, torch.float32)
    written = cache_files(Path(plan.cache_dir))
    assert written, f"{name}: the node's setup wrote no cache entry"

    # ---- cache round trip: a second run finds every entry; written again elsewhere, the entries read back identical
    again = run_config(arch, tmp_path, "again", data)
    again["model"] = {"path": str(run.pipeline), "lora": again["model"]["lora"]}
    again_run = RunDir(tmp_path / "runs" / "again")
    again_run.path.mkdir(parents=True)
    from zeropipe.config.load import validate_config

    prepare_diffusion_data(validate_config(again), again_run, reuse=True)
    second = read_plan(again_run)
    assert second.missing_latents == [] and arch.text.missing(second) == 0, f"{name}: a second run would encode {second.missing_latents} and {arch.text.missing(second)} caption(s) again"
    elsewhere = dict(again, data={**again["data"], "cache": {"dir": str(tmp_path / "cache-elsewhere")}})
    prepare_diffusion_data(validate_config(elsewhere), again_run, reuse=False)
    fill_caches(again_run, cpu, torch.float32)
    rewritten = cache_files(tmp_path / "cache-elsewhere")
    assert set(rewritten) <= set(written) and rewritten, f"{name}: the same inputs gave other cache keys"
    for key, tensors in rewritten.items():
        assert set(tensors) == set(written[key]), f"{name}: cache entry {key} holds {sorted(tensors)}, before {sorted(written[key])}"
        for field, value in tensors.items():
            torch.testing.assert_close(value, written[key][field], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: cache entry {key}[{field}] read back differently: {m}")

    # ---- one rank of the trainer: ZeRO-3, two LoRA steps through the entry's predict, one sample; then the exports
    batch = train_one_rank(name, arch, run, monkeypatch)
    lora_dir = export_run(run.path, tmp_path / "lora", dtype="fp32")
    from safetensors.torch import load_file

    layers = load_file(str(lora_dir / "pytorch_lora_weights.safetensors"))
    ups = {key: value for key, value in layers.items() if "lora_B" in key or "lora.up" in key}
    trained = [key for key, value in ups.items() if value.abs().max() > 0]
    # LoRA B starts at zero: a trained one got gradients through predict. A few may get none because the
    # model discards their output (Qwen-Image's last block's text stream), never most of them.
    assert ups and len(trained) > len(ups) / 2, f"{name}: {len(ups) - len(trained)} of {len(ups)} LoRA up-projections never trained (unused by predict?): {sorted(set(ups) - set(trained))[:4]}"
    assert_exports_load(name, arch, run, batch, lora_dir, tmp_path)


def train_one_rank(name: str, arch, run, monkeypatch, zero_stage: int = 3):
    """The rank's own path (setup, the fixed-batch loss, two steps, samples, cleanup); returns a fixed micro-batch to compare denoisers on."""
    trainer = one_rank(run.path, monkeypatch)
    trainer.setup()
    assert trainer.engine.zero_optimization_stage() == zero_stage, f"{name}: not trained under ZeRO-{zero_stage}"
    task = trainer.task
    task.before_train()
    trainer.train()
    task.after_train()
    # Two steps do not make every entry's loss fall (SD3's rose on a fixed batch); that it learns is each
    # kind's 2-rank run in tests/integration. Here: the adapters got gradients and change the output (below).
    assert torch.isfinite(torch.tensor([task.fixed_loss_start, task.fixed_loss_end])).all(), f"{name}: fixed-batch loss {task.fixed_loss_start} -> {task.fixed_loss_end}"
    assert trainer.step == 2 and all(torch.isfinite(torch.tensor(row["loss"])) for row in run.read_metrics()), f"{name}: {run.read_metrics()}"
    torch.manual_seed(0)
    latents, condition = task.assemble([0], augment=False)
    noised = task.objective.noise(latents, generator=torch.Generator().manual_seed(1))
    batch = (noised.model_input.detach(), noised.timesteps.detach(), {key: value.detach() for key, value in condition.items()}, task.predict_context)
    task.generate_samples()
    samples = sorted(p.name for p in (run.path / "samples").rglob("*") if p.is_file() and p.name != "index.jsonl")
    assert samples, f"{name}: no sample written"
    trainer.cleanup()
    return batch


def assert_exports_load(name: str, arch, run, batch, adapter_dir: Path, tmp_path: Path) -> None:
    """The adapter export read by diffusers' loader changes the denoiser; the merged export, a pipeline folder, gives base + adapter."""
    from zeropipe.families import export_run
    from zeropipe.families.diffusion.draw import export_info, load_adapter_export

    merged_dir = export_run(run.path, tmp_path / "merged", merge=True, dtype="fp32")
    pipeline_cls = arch.pipeline()
    # A prompt processor the entry makes itself (arch.text.processors: Qwen-Image-Edit's and Qwen-Image 2.1's, which
    # transformers builds only with torchvision) is given as the entry's text pipeline gets it (Qwen-Image 2.1's pipeline reads it
    # in its constructor).
    from zeropipe.families.diffusion.pipelines import prompt_processors

    own = {**arch.pipeline_kwargs(), **{name: part for name, part in prompt_processors(run.pipeline, arch).items() if name in arch.text.processors}}
    base = pipeline_cls.from_pretrained(str(run.pipeline), **own)
    before = denoiser_output(arch, getattr(base, arch.denoiser), batch)
    # The loader Draw uses: the pipeline's load_lora_weights, or the denoiser's load_lora_adapter where the pipeline
    # has none (diffusers 0.42: HunyuanVideo 1.5, Cosmos 2, HunyuanImage) or does not read the kind (LoKr).
    load_adapter_export(base, adapter_dir, export_info(adapter_dir))
    with_adapter = denoiser_output(arch, getattr(base, arch.denoiser), batch)
    assert (with_adapter - before).abs().max() > 1e-5, f"{name}: the adapter loaded by diffusers does not change the denoiser's output"

    full = pipeline_cls.from_pretrained(str(merged_dir), **own)
    merged = denoiser_output(arch, getattr(full, arch.denoiser), batch)
    torch.testing.assert_close(merged, with_adapter, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: the merged export's denoiser differs from base + adapter: {m}")


# The adapter kinds beyond LoRA (model.lora.kind), on a UNet and on transformers whose pipelines load them differently:
# SD 1.x's pipeline reads DoRA; LoKr goes through the denoiser's load_lora_adapter (Flux, Z-Image); LoHa, which no
# diffusers loader reads, is refused unmerged and exported merged (ZeRO-2: see check ZP021).
ADAPTER_CASES = [("sd15", "dora"), ("flux", "lokr"), ("z-image", "lokr"), ("qwen-image", "loha")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,kind", ADAPTER_CASES, ids=[f"{name}-{kind}" for name, kind in ADAPTER_CASES])
def test_dora_lokr_and_loha_train_under_zero3_and_export_what_diffusers_loads(tmp_path, monkeypatch, name, kind):
    from zeropipe.errors import CheckpointError
    from zeropipe.families import export_run
    from zeropipe.families.diffusion.prepare import fill_caches

    arch = architectures.architecture_named(name)
    config = run_config(arch, tmp_path, f"{name}-{kind}", data_section(arch, tmp_path))
    config["model"]["lora"] = {"kind": kind, "r": 4, "alpha": 8}
    # peft's LoHa cannot be added to a ZeRO-3 partitioned model (check ZP021 refuses it): ZeRO-2.
    stage = 2 if kind == "loha" else 3
    config["deepspeed"]["zero_stage"] = stage
    run = prepare(config).run
    fill_caches(run, torch.device("cpu"), torch.float32)
    batch = train_one_rank(name, arch, run, monkeypatch, stage)
    adapter = tmp_path / "adapter"
    if kind == "loha":  # diffusers 0.42 has no LoHa loader: refused with the exports that do load; merged below
        with pytest.raises(CheckpointError, match="no loader for a LoHa adapter.*--merge"):
            export_run(run.path, adapter, dtype="fp32")
        from zeropipe.families.diffusion.draw import export_info

        merged = export_run(run.path, tmp_path / "merged", merge=True, dtype="fp32")
        assert export_info(merged)["kind"] == "merged"
        base = arch.pipeline().from_pretrained(str(run.pipeline))
        full = arch.pipeline().from_pretrained(str(merged))
        assert (denoiser_output(arch, getattr(full, arch.denoiser), batch) - denoiser_output(arch, getattr(base, arch.denoiser), batch)).abs().max() > 1e-5
        return
    export_run(run.path, adapter, dtype="fp32")
    from safetensors.torch import load_file

    keys = set(load_file(str(adapter / "pytorch_lora_weights.safetensors")))
    marker = {"dora": "lora_magnitude_vector", "lokr": ".lokr_w"}[kind]
    assert any(marker in key for key in keys), f"{name} {kind}: no {marker} in {sorted(keys)[:4]}"
    assert_exports_load(f"{name} {kind}", arch, run, batch, adapter, tmp_path)
    comfy = adapter / "lora_comfyui.safetensors"
    # The original (ComfyUI) layout of a LoKr where the entry has one (Z-Image: ai-toolkit's, diffusers' converter reads it).
    assert comfy.exists() == (arch.original_lokr_layout({}, 1.0) is not None and kind == "lokr"), f"{name} {kind}: {sorted(p.name for p in adapter.iterdir())}"
    if comfy.exists():
        assert all(key.startswith("diffusion_model.") and ".lokr_w" in key for key in load_file(str(comfy)))
        via_diffusers, via_comfy = (arch.pipeline().from_pretrained(str(run.pipeline)) for _ in range(2))
        via_diffusers.load_lora_weights(str(adapter))
        via_comfy.load_lora_weights(str(adapter), weight_name="lora_comfyui.safetensors")
        torch.testing.assert_close(denoiser_output(arch, via_comfy.transformer, batch), denoiser_output(arch, via_diffusers.transformer, batch), rtol=1e-4, atol=1e-5)

    # Resume: the launcher's resume of the run, one more step; the rank starts from the checkpoint's adapter weights.
    from peft.utils import get_peft_model_state_dict

    from zeropipe.launch.prepare import prepare_run
    from zeropipe.launch.resolve import resolve_run

    config["train"]["max_steps"] = 3
    import yaml

    from zeropipe.config.load import validate_config

    prepare_run(resolve_run(validate_config(yaml.safe_load(yaml.safe_dump(config)))), resume=True, new_schedule=True)  # a constant rate: the same schedule
    trainer = one_rank(run.path, monkeypatch)
    trainer.setup()
    assert trainer.step == 2, f"{name} {kind}: resumed at step {trainer.step}"
    import deepspeed

    module = trainer.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        resumed = {key: value.detach().clone() for key, value in get_peft_model_state_dict(module).items()}
    exported = load_file(str(adapter / "pytorch_lora_weights.safetensors"))
    assert resumed and all(torch.equal(value, exported[f"{arch.denoiser}.{key}"]) for key, value in resumed.items()), f"{name} {kind}: the resumed adapter is not the checkpoint's"
    trainer.task.before_train()
    trainer.train()
    trainer.task.after_train()
    assert trainer.step == 3
    trainer.cleanup()
