"""The diffusion contract's furniture: the data an entry trains on, its run config, one in-process rank, the export checks.

Shared by the per-entry declared-wiring check (tests/unit/diffusion/test_architecture_contract.py, every
registered entry, no DeepSpeed) and the full ZeRO-3 runs of one entry per kind of part
(tests/integration/test_architecture_kinds.py).
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from zeropipe.families.diffusion import entries as architectures

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
    if arch.record.codec.video:
        data["video"] = {"frame_buckets": [arch.record.codec.clip_length(1)]}
    keys = sorted({key for part in arch.record.parts for key in part.config_keys()})
    unknown = [key for key in keys if key not in PROVIDERS]
    assert not unknown, f"{arch.record.name}: its parts read {unknown}, which the contract test does not provide yet: add them to PROVIDERS"
    # A few files of generated shapes (data.synthetic's smallest set is 10: more encoding than a contract needs).
    # Written by the entry's codec, as data.synthetic would be: shapes, moving-shape clips, or LTX-2's clips with a tone as their sound.
    from types import SimpleNamespace

    targets = tmp_path / "targets"
    frames = [arch.record.codec.clip_length(1)] if arch.record.codec.video else [1]
    synthetic = SimpleNamespace(data=SimpleNamespace(synthetic=SimpleNamespace(examples=EXAMPLES, seed=5), images=SimpleNamespace(resolution=RESOLUTION), video=SimpleNamespace(frame_buckets=frames)))
    _, write = arch.record.codec.synthetic_folder(tmp_path, synthetic)
    write(targets)
    data["path"] = str(targets)
    for key in keys:
        PROVIDERS[key](data, targets, tmp_path)
    return data


def animate_pairs(targets: Path, controls: Path) -> None:
    """Per target clip, a reference image (its first frame) and a driving clip (the clip itself): Wan Animate 2's pair of files."""
    import shutil

    from zeropipe.data.images import first_frame_image
    from zeropipe.data.videos import load_clip_for_bucket, probe_video

    for clip in sorted(targets.rglob("*.mp4")):
        out = controls / clip.relative_to(targets)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(clip, out)
        width, height, _, fps = probe_video(clip)
        first_frame_image(load_clip_for_bucket(clip, (width, height, 1), 0, fps, fps).pixels).save(out.with_suffix(".png"))


def control_images(data: dict, targets: Path, tmp_path: Path) -> None:
    grey_controls(targets, tmp_path / "controls")
    animate_pairs(targets, tmp_path / "controls")
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


def guidance_preserving(data: dict, targets: Path, tmp_path: Path) -> None:
    """Nothing: the setting is optional; the contract runs the entry's own loss, tests/integration/test_guidance_preserving.py the objective."""


PROVIDERS = {"data.control_path": control_images, "data.control_paths": reference_images, "model.diffusion.guidance_preserving": guidance_preserving}


def run_config(arch, tmp_path: Path, name: str, data: dict, **overrides) -> dict:
    config = {
        "run": {"name": name, "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"pipeline": arch.record.preset_name}, "lora": {"r": 4, "alpha": 8}},
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
        return arch.call.predict(model.eval(), latents, timesteps, condition, context).float()


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


def load_pipeline(arch, pipeline_cls, folder: Path, own: dict):
    """The entry's pipeline from a folder as diffusers loads it; a modular pipeline (MiniMax-H3) loads no component until asked: its denoiser."""
    from zeropipe.families.diffusion.pipelines import is_modular

    if not is_modular(pipeline_cls):
        return pipeline_cls.from_pretrained(str(folder), **own)
    pipeline = pipeline_cls.from_pretrained(str(folder))
    pipeline.load_components(names=[arch.record.denoiser], torch_dtype=torch.float32)
    return pipeline


def assert_exports_load(name: str, arch, run, batch, adapter_dir: Path, tmp_path: Path) -> None:
    """The adapter export read by diffusers' loader changes the denoiser; the merged export, a pipeline folder, gives base + adapter."""
    from zeropipe.families import export_run
    from zeropipe.families.diffusion.draw import export_info, load_adapter_export

    merged_dir = export_run(run.path, tmp_path / "merged", merge=True, dtype="fp32")
    pipeline_cls = arch.pipeline()
    # A prompt processor the entry makes itself (arch.record.text.processors: Qwen-Image-Edit's and Qwen-Image 2.1's, which
    # transformers builds only with torchvision) is given as the entry's text pipeline gets it (Qwen-Image 2.1's pipeline reads it
    # in its constructor).
    from zeropipe.families.diffusion.pipelines import prompt_processors

    own = {**arch.record.pipeline_kwargs, **{name: part for name, part in prompt_processors(run.pipeline, arch).items() if name in arch.record.text.processors}}
    base = load_pipeline(arch, pipeline_cls, run.pipeline, own)
    before = denoiser_output(arch, getattr(base, arch.record.denoiser), batch)
    # The loader Draw uses: the pipeline's load_lora_weights, or the denoiser's load_lora_adapter where the pipeline
    # has none (diffusers 0.42: HunyuanVideo 1.5, Cosmos 2, HunyuanImage) or does not read the kind (LoKr).
    load_adapter_export(base, adapter_dir, export_info(adapter_dir))
    with_adapter = denoiser_output(arch, getattr(base, arch.record.denoiser), batch)
    assert (with_adapter - before).abs().max() > 1e-5, f"{name}: the adapter loaded by diffusers does not change the denoiser's output"

    full = load_pipeline(arch, pipeline_cls, merged_dir, own)
    merged = denoiser_output(arch, getattr(full, arch.record.denoiser), batch)
    torch.testing.assert_close(merged, with_adapter, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: the merged export's denoiser differs from base + adapter: {m}")




def cached_run(name: str, arch, tmp_path: Path, round_trip: bool = True):
    """The launcher's data step and the node's cache filling for an entry's tiny preset, and (``round_trip``) the cache round trip.

    A second data step finds every latent and text entry (nothing to encode again); the entries written
    again into another cache folder read back identical. Returns the prepared run.
    """
    from zeropipe.config.load import validate_config
    from zeropipe.families.diffusion.prepare import fill_caches, prepare_diffusion_data, read_plan
    from zeropipe.rundir import RunDir

    cpu = torch.device("cpu")
    data = data_section(arch, tmp_path)
    run = prepare(run_config(arch, tmp_path, "contract", data)).run
    plan = read_plan(run)
    assert plan.architecture == name and plan.missing_latents, f"{name}: the data step planned no latents to encode"
    fill_caches(run, cpu, torch.float32)
    written = cache_files(Path(plan.cache_dir))
    assert written, f"{name}: the node's setup wrote no cache entry"
    if not round_trip:
        return run

    again = run_config(arch, tmp_path, "again", data)
    again["model"] = {"path": str(run.pipeline), "lora": again["model"]["lora"]}
    again_run = RunDir(tmp_path / "runs" / "again")
    again_run.path.mkdir(parents=True)
    prepare_diffusion_data(validate_config(again), again_run, reuse=True)
    second = read_plan(again_run)
    assert second.missing_latents == [] and arch.record.text.missing(second) == 0, f"{name}: a second run would encode {second.missing_latents} and {arch.record.text.missing(second)} caption(s) again"
    elsewhere = dict(again, data={**again["data"], "cache": {"dir": str(tmp_path / "cache-elsewhere")}})
    prepare_diffusion_data(validate_config(elsewhere), again_run, reuse=False)
    fill_caches(again_run, cpu, torch.float32)
    rewritten = cache_files(tmp_path / "cache-elsewhere")
    assert set(rewritten) <= set(written) and rewritten, f"{name}: the same inputs gave other cache keys"
    for key, tensors in rewritten.items():
        assert set(tensors) == set(written[key]), f"{name}: cache entry {key} holds {sorted(tensors)}, before {sorted(written[key])}"
        for field, value in tensors.items():
            torch.testing.assert_close(value, written[key][field], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: cache entry {key}[{field}] read back differently: {m}")
    return run


def part_kinds(arch) -> set[str]:
    """What kinds of part an entry has: an image or a video codec (video with sound is the AudioTrack condition), its
    objective (DDPM or flow), its prompt part and each condition, by class. Codec classes are not kinds: each entry's
    codec is one of the two, checked per entry by the declared-wiring test."""
    return {type(part).__name__ for part in (arch.record.text, *arch.record.conditions)} | {"video" if arch.record.codec.video else "image", f"objective:{arch.record.objective}"}


def one_entry_per_kind(names: list[str]) -> list[str]:
    """The fewest entries (greedily, in name order) that between them have every kind of part the registered entries have."""
    kinds = {name: part_kinds(architectures.architecture_named(name)) for name in names}
    uncovered = set().union(*kinds.values()) if kinds else set()
    chosen: list[str] = []
    while uncovered:
        best = max(sorted(kinds), key=lambda name: len(kinds[name] & uncovered))
        chosen.append(best)
        uncovered -= kinds[best]
    return sorted(chosen)
