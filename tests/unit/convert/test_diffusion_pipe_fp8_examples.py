"""diffusion-pipe's own fp8 examples (examples/wan_14b_min_vram.toml, examples/qwen_image_24gb_vram.toml, stored in
tests/fixtures/peers) converted and trained as converted, on tiny stand-ins of the models they name.

The files are read as they are; only what must point at this machine is replaced: the dataset TOML (a folder
of generated images), the checkpoint path (a tiny diffusers pipeline of the same architecture, built from the
entry's preset; Wan 14B's ``ckpt_path`` names an *original* Wan folder, which ZeRO-Pipe does not read: convert
says so and names the diffusers release to point at, asserted below), and, on the converted YAML, the run's
size (one step at 32 px on one CPU rank) and where it writes. Everything else trains as converted: the fp8 base
(``transformer_dtype = 'float8'``), ZeRO-3 with parameters offloaded to host RAM (from ``blocks_to_swap``),
gradient checkpointing, LoRA r=32, bf16. Each run's base is checked to be stored as fp8 bytes partitioned by
ZeRO-3, and its exported LoRA is loaded by diffusers onto the full-precision pipeline.
"""

from __future__ import annotations

import pytest
import tomllib
import torch
import yaml

from tests.unit.convert.test_convert_issue27 import DP, peer_main, unmapped
from tests.diffusion_contract import denoiser_output, one_rank, prepare
from zeropipe.convert import convert_file
from zeropipe.families.diffusion.entries import architecture_named
from zeropipe.data.images import generate_shapes_dataset
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline

# example, its [model] key that names the checkpoint, the entry it trains, what convert must report rather than drop
EXAMPLES = [
    ("wan_14b_min_vram.toml", "ckpt_path", "wan", ("blocks_to_swap", "activation_checkpointing", "optimizer.stabilize", "adapter (target modules)")),
    ("qwen_image_24gb_vram.toml", "diffusers_path", "qwen-image", ("blocks_to_swap", "optimizer.type", "adapter (target modules)")),
]


@pytest.fixture(autouse=True)
def cpu_deepspeed(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def test_an_original_wan_folder_named_by_ckpt_path_is_reported_with_the_diffusers_release_to_use(tmp_path):
    """wan_14b_min_vram.toml as written points at Wan2.1-T2V-14B (the original release): not silently taken as a pipeline."""
    images = generate_shapes_dataset(tmp_path / "images", 1, seed=0, resolution=32)
    (tmp_path / "dataset.toml").write_text(f"[[directory]]\npath = '{images}'\n")
    original = tmp_path / "Wan2.1-T2V-14B"
    original.mkdir()
    conversion = convert_file(peer_main(tmp_path, "wan_14b_min_vram.toml", str(tmp_path / "dataset.toml"), ckpt_path=str(original)))
    assert "Wan-AI/Wan2.1-T2V-14B-Diffusers" in unmapped(conversion)["model.ckpt_path"]
    config = conversion.raw()
    assert config["model"]["quantization"]["format"] == "fp8"
    # Trained as converted, it stops before any process starts, naming the key.
    from zeropipe.config.load import validate_config
    from zeropipe.errors import ConfigError

    config["run"]["output_dir"] = str(tmp_path / "runs")
    with pytest.raises(ConfigError, match="model.path: .*Wan2.1-T2V-14B is neither"):
        validate_config(config)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("example", "key", "name", "reported"), EXAMPLES, ids=[e[2] for e in EXAMPLES])
def test_diffusion_pipes_fp8_example_trains_as_converted_with_the_fp8_base_under_zero3(tmp_path, monkeypatch, example, key, name, reported):
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from zeropipe.families import export_run
    from zeropipe.families.diffusion.prepare import fill_caches
    from zeropipe.models.quantized import QuantizedLinear

    arch = architecture_named(name)
    pipeline = tmp_path / "model"
    build_tiny_pipeline({"pipeline": arch.record.preset_name}, pipeline, seed=1)
    images = generate_shapes_dataset(tmp_path / "images", 4, seed=0, resolution=32)
    (tmp_path / "dataset.toml").write_text(f"resolutions = [32]\n[[directory]]\npath = '{images}'\n")
    assert (DP / example).read_text().count("transformer_dtype = 'float8'") == 1
    conversion = convert_file(peer_main(tmp_path, example, str(tmp_path / "dataset.toml"), **{key: str(pipeline)}))
    assert conversion.blocking == []
    why = unmapped(conversion)
    missing = [option for option in reported if option not in why]
    assert not missing, f"{example}: convert dropped {missing} without a word; it reported {sorted(why)}"
    assert "offload_param: cpu" in why["blocks_to_swap"]
    # Every key of the file is accounted for: in a converted key's comment, the list of unmapped keys or convert's notes
    # (pipeline_stages = 1 is data parallel, what ZeRO already is).
    said = " ".join([entry.comment or "" for entry in conversion.entries.values()] + [f"{k} {w}" for k, w in conversion.unmapped] + list(conversion.already))
    source = tomllib.loads((DP / example).read_text())
    keys = [f"{section}.{key}" if isinstance(table, dict) else section for section, table in source.items() for key in (table if isinstance(table, dict) else [None])]
    silent = [key for key in keys if key.split(".")[-1] not in said and key != "pipeline_stages"]
    assert not silent, f"{example}: convert says nothing about {silent}"

    config = conversion.raw()
    assert config["model"]["quantization"]["format"] == "fp8" and config["model"]["path"] == str(pipeline)
    assert config["deepspeed"]["zero_stage"] == 3 and config["deepspeed"]["offload_param"] == "cpu" and config["deepspeed"]["precision"] == "bf16"
    # This machine's run: one CPU rank, one step, written under tmp_path, no sample images.
    config["run"] = {**config.get("run", {}), "name": name, "output_dir": str(tmp_path / "runs"), "seed": 3}
    config["train"] = {**config["train"], "max_steps": 1, "log_every": 1}
    config["train"].pop("epochs", None)
    config["train"].pop("warmup_steps", None)  # Wan's 10 warmup steps would leave the learning rate at 0 for a 1-step run
    config["data"]["cache"] = {"dir": str(tmp_path / "cache")}
    config["hardware"] = {"gpus": 1, "accelerator": "cpu"}
    config["generate"] = {"prompts": []}
    run = prepare(yaml.safe_load(yaml.safe_dump(config))).run
    fill_caches(run, torch.device("cpu"), torch.float32)

    trainer = one_rank(run.path, monkeypatch)
    trainer.setup()
    assert trainer.engine.zero_optimization_stage() == 3
    quantized = [module for module in trainer.engine.module.modules() if isinstance(module, QuantizedLinear)]
    assert quantized, f"{name}: no layer of the base is stored quantized"
    # The stored weight is the fp8 bytes (uint8), and ZeRO-3's partition of it is those bytes: one per weight.
    assert all(m.weight.dtype == torch.uint8 and m.weight.ds_tensor.dtype == torch.uint8 and m.weight.ds_tensor.numel() >= m.weight.ds_numel for m in quantized)
    stored = sum(m.weight.ds_numel for m in quantized)
    base = sum(p.ds_numel for p in trainer.engine.module.parameters() if not p.requires_grad)  # the LoRA r=32 outweighs a tiny base
    assert stored > base / 2, f"{name}: only {stored} of the base's {base} weights stored in fp8"
    task = trainer.task
    task.before_train()
    trainer.train()
    task.after_train()
    losses = [row["loss"] for row in run.read_metrics() if "loss" in row]
    assert trainer.step == 1 and len(losses) == 1 and torch.isfinite(torch.tensor(losses)).all(), losses
    torch.manual_seed(0)
    latents, condition = task.assemble([0], augment=False)
    noised = task.objective.noise(latents, generator=torch.Generator().manual_seed(1))
    batch = (noised.model_input.detach().float(), noised.timesteps.detach(), {k: v.detach().float() if v.is_floating_point() else v for k, v in condition.items()},
             task.predict_context)
    trainer.cleanup()

    # The LoRA, exported, loads with diffusers onto the full-precision (fp32) pipeline and changes its denoiser.
    adapter = export_run(run.path, tmp_path / "lora", dtype="fp32")
    layers = load_file(str(adapter / "pytorch_lora_weights.safetensors"))
    assert any(value.abs().max() > 0 for key, value in layers.items() if "lora_B" in key), f"{name}: LoRA B is still zero: nothing trained"
    full = arch.pipeline().from_pretrained(str(pipeline), torch_dtype=torch.float32)
    denoiser = getattr(full, arch.record.denoiser)
    before = denoiser_output(arch, denoiser, batch)
    full.load_lora_weights(str(adapter))
    loaded = get_peft_model_state_dict(denoiser, adapter_name=next(iter(denoiser.peft_config)))
    assert len(loaded) == len(layers), f"{name}: diffusers loaded {len(loaded)} of the file's {len(layers)} tensors"
    after = denoiser_output(arch, denoiser, batch)
    assert torch.isfinite(after).all() and (after - before).abs().max() > 0, f"{name}: the exported LoRA does not change the full-precision denoiser"
