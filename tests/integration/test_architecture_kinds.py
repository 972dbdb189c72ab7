"""A full ZeRO-3 run of one registered diffusion entry per kind of part, and of the adapter kinds beyond LoRA.

The declared wiring of *every* entry is checked without DeepSpeed in tests/unit/diffusion/test_architecture_contract.py.
Here, for the fewest entries that between them have every kind of part the registry has (image and video codecs,
video with sound, text, edit/control images, reference images, a first frame, audio... by part class:
``one_entry_per_kind``, recomputed as entries are registered), the run's own code in this process:

- the launcher's data step and the node's cache filling (``prepare_run``, ``fill_caches``; the cache round trip
  is every entry's, in the unit check);
- one rank of the real trainer (``engine.trainer.Trainer``, DeepSpeed ZeRO-3 on the CPU with gloo, world
  size 1): two LoRA steps through the entry's ``predict`` (finite fixed-batch and step losses, step 2 reached,
  ZeRO stage 3), and one sample through the entry's sampling (``RankTask.generate_samples``);
- the exports (``families.export_run``): most LoRA up-projections trained; the LoRA file read by diffusers'
  loader changes the denoiser's output; the merged export is a pipeline folder the entry's pipeline class
  loads, whose denoiser gives base + LoRA.

Every assertion names the entry.
"""

from __future__ import annotations

import pytest
import torch

from tests.diffusion_contract import assert_exports_load, cached_run, data_section, denoiser_output, one_entry_per_kind, one_rank, prepare, run_config, train_one_rank
from zeropipe.families.diffusion import entries as architectures

pytestmark = pytest.mark.integration

KIND_ENTRIES = one_entry_per_kind(sorted(architectures.architectures()))


@pytest.fixture(autouse=True)
def cpu_deepspeed(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", KIND_ENTRIES)
def test_an_entry_of_each_kind_caches_trains_under_zero3_samples_and_exports_what_diffusers_loads(tmp_path, monkeypatch, name):
    from safetensors.torch import load_file

    from zeropipe.families import export_run

    arch = architectures.architecture_named(name)
    run = cached_run(name, arch, tmp_path, round_trip=False)  # the round trip: every entry's, in the unit check
    batch = train_one_rank(name, arch, run, monkeypatch)
    lora_dir = export_run(run.path, tmp_path / "lora", dtype="fp32")
    layers = load_file(str(lora_dir / "pytorch_lora_weights.safetensors"))
    ups = {key: value for key, value in layers.items() if "lora_B" in key or "lora.up" in key}
    trained = [key for key, value in ups.items() if value.abs().max() > 0]
    # LoRA B starts at zero: a trained one got gradients through predict. A few may get none because the
    # model discards their output (Qwen-Image's last block's text stream), never most of them.
    assert ups and len(trained) > len(ups) / 2, f"{name}: {len(ups) - len(trained)} of {len(ups)} LoRA up-projections never trained (unused by predict?): {sorted(set(ups) - set(trained))[:4]}"
    assert_exports_load(name, arch, run, batch, lora_dir, tmp_path)


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
        assert (denoiser_output(arch, getattr(full, arch.record.denoiser), batch) - denoiser_output(arch, getattr(base, arch.record.denoiser), batch)).abs().max() > 1e-5
        return
    export_run(run.path, adapter, dtype="fp32")
    from safetensors.torch import load_file

    keys = set(load_file(str(adapter / "pytorch_lora_weights.safetensors")))
    marker = {"dora": "lora_magnitude_vector", "lokr": ".lokr_w"}[kind]
    assert any(marker in key for key in keys), f"{name} {kind}: no {marker} in {sorted(keys)[:4]}"
    assert_exports_load(f"{name} {kind}", arch, run, batch, adapter, tmp_path)
    comfy = adapter / "lora_comfyui.safetensors"
    # The original (ComfyUI) layout of a LoKr where the entry has one (Z-Image: ai-toolkit's, diffusers' converter reads it).
    assert comfy.exists() == (arch.layouts.original_lokr_layout({}, 1.0) is not None and kind == "lokr"), f"{name} {kind}: {sorted(p.name for p in adapter.iterdir())}"
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
    assert resumed and all(torch.equal(value, exported[f"{arch.record.denoiser}.{key}"]) for key, value in resumed.items()), f"{name} {kind}: the resumed adapter is not the checkpoint's"
    trainer.task.before_train()
    trainer.train()
    trainer.task.after_train()
    assert trainer.step == 3
    trainer.cleanup()
