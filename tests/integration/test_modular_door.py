"""The door for modular pipelines, end to end on one CPU rank under ZeRO-3 (the unit checks: tests/unit/diffusion/test_modular_door.py)."""

from __future__ import annotations

import json

import pytest

from tests.unit.diffusion.test_modular_door import MODULAR
from zeropipe.config.pipeline_index import read_pipeline_index
from zeropipe.families.diffusion.entries import register, unregister

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_a_modular_entry_caches_trains_under_zero3_and_samples(tmp_path, monkeypatch):
    """The declared wiring through the door, end to end on one rank: the tiny preset written in the modular layout, the
    launcher's data step and the node's cache filling (prompts through the text-encoder block), two LoRA steps under
    ZeRO-3 (DeepSpeed on a CPU rank), and samples drawn through the shared sampler, not the pipeline's call."""
    from tests.diffusion_contract import cached_run, train_one_rank

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    register(MODULAR)
    try:
        run = cached_run("z-image-modular", MODULAR, tmp_path, round_trip=False)
        assert read_pipeline_index(run.pipeline).modular
        train_one_rank("z-image-modular", MODULAR, run, monkeypatch)
    finally:
        unregister("z-image-modular")
    rows = (run.path / "samples" / "index.jsonl").read_text().splitlines()
    assert rows and all((run.path / "samples" / json.loads(row)["file"]).is_file() for row in rows)


@pytest.mark.timeout(600)
def test_flux3_trains_under_zero3_and_its_lora_export_loads(tmp_path, monkeypatch):
    """FLUX.3 (a modular-only pipeline): two LoRA steps under ZeRO-3 on its tiny preset, samples through the shared
    sampler, and the LoRA export in diffusers' layout read by diffusers' own loader changes the transformer's output."""
    import torch

    from diffusers import Flux3Transformer2DModel

    from tests.diffusion_contract import cached_run, denoiser_output, train_one_rank
    from zeropipe.families import export_run
    from zeropipe.families.diffusion.entries import architecture_named

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    arch = architecture_named("flux3")
    run = cached_run("flux3", arch, tmp_path, round_trip=False)
    batch = train_one_rank("flux3", arch, run, monkeypatch)
    adapter = export_run(run.path, tmp_path / "lora")
    files = sorted(path.name for path in adapter.iterdir())
    assert "pytorch_lora_weights.safetensors" in files, files
    base = Flux3Transformer2DModel.from_pretrained(str(run.pipeline / "transformer"), torch_dtype=torch.float32)
    before = denoiser_output(arch, base, batch)
    base.load_lora_adapter(str(adapter), weight_name="pytorch_lora_weights.safetensors", prefix="transformer")
    assert (denoiser_output(arch, base, batch) - before).abs().max() > 1e-5, "the exported LoRA, loaded by diffusers, does not change FLUX.3's output"
