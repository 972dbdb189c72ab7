"""A diffusion LoRA on a bitsandbytes nf4 base, one real rank under ZeRO-2 in this process (gloo, world size 1).

bitsandbytes 0.50's CPU backend runs Linear4bit forward and backward; the denoiser's block linears
are filled as nf4 layers while streaming (models.bnb_base). ZeRO-3 cannot hold them, and says so.
"""

from __future__ import annotations

import pytest
import torch

from tests.diffusion_contract import assert_exports_load, data_section, prepare, run_config, train_one_rank
from zeropipe.families.diffusion import entries as architectures


@pytest.fixture(autouse=True)
def cpu_deepspeed(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def test_wan_lora_trains_on_an_nf4_base_under_zero2_and_exports_what_diffusers_loads(tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    from zeropipe.families import export_run
    from zeropipe.families.diffusion.prepare import fill_caches

    arch = architectures.architecture_named("wan")
    data = data_section(arch, tmp_path)
    config = run_config(arch, tmp_path, "nf4", data, deepspeed={"zero_stage": 2}, model={"quantization": "nf4"})
    run = prepare(config).run
    fill_caches(run, torch.device("cpu"), torch.float32)

    import bitsandbytes as bnb

    from zeropipe.engine.trainer import Trainer

    built = {}
    original = Trainer.setup

    def setup(self):  # the model the rank trains, looked at after the real setup
        original(self)
        built["layers"] = [m for m in self.engine.module.modules() if isinstance(m, bnb.nn.Linear4bit)]

    monkeypatch.setattr(Trainer, "setup", setup)
    batch = train_one_rank("wan", arch, run, monkeypatch, zero_stage=2)
    assert built["layers"] and all(layer.weight.dtype == torch.uint8 for layer in built["layers"]), "the block linears are not nf4"
    lora_dir = export_run(run.path, tmp_path / "lora", dtype="fp32")
    assert_exports_load("wan", arch, run, batch, lora_dir, tmp_path)


def test_a_bitsandbytes_diffusion_base_under_zero3_is_refused_with_the_reason():
    from zeropipe.config.load import validate_config
    from zeropipe.families import family_named

    raw = {"model": {"config": {"pipeline": "tiny-flux"}, "lora": {"r": 4}, "quantization": "nf4"}, "data": {"synthetic": {"task": "shapes"}}}
    family = family_named("diffusion")
    assert family.config_problems(validate_config({**raw, "deepspeed": {"zero_stage": 2}})) == []
    (problem,) = [p for p in family.config_problems(validate_config({**raw, "deepspeed": {"zero_stage": 3}})) if p[0] == "deepspeed.zero_stage"]
    assert "neither partitions nor gathers" in problem[1] and "set deepspeed.zero_stage: 2" in problem[1] and "fp8" in problem[1]
    # The planner counts the block linears in 4 bits, int8 at one byte per weight.
    spec = family.model_spec(validate_config({**raw, "deepspeed": {"zero_stage": 2}}))
    assert spec.quantized is not None and spec.quantized.params_4bit == spec.block_linear_params > 0
    int8 = family.model_spec(validate_config({**raw, "model": {**raw["model"], "quantization": "int8"}, "deepspeed": {"zero_stage": 2}}))
    assert int8.fp8_base is not None and int8.fp8_base.params_fp8 == spec.block_linear_params
