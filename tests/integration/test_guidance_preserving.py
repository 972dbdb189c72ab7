"""The guidance-preserving objective through the real trainer: one rank under DeepSpeed ZeRO-3, a guidance-distilled entry.

The objective calls the denoiser twice per micro-batch, the second time without gradient (the model's own
unconditional prediction): under ZeRO-3 both calls gather the partitioned weights. A FLUX.1 [dev]-style
entry (the tiny FLUX preset with guidance embedding) selecting the objective, as a plug-in registers one,
trains its LoRA two steps with ``model.diffusion.guidance_preserving: 4``, and its adapters got gradients.
The figure that the objective keeps the guided output is benchmarks/guidance_preserving.py's.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.diffusion_contract import cached_run, train_one_rank
from zeropipe.families.diffusion import entries
from zeropipe.families.diffusion.bases.flux import ARCHITECTURE as FLUX
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import GuidedPrompt
from zeropipe.families.diffusion.parts.guidance import guided_loss

pytestmark = pytest.mark.integration


GUIDED_LOSSES: list[float] = []  # the objective's losses the rank computed (it runs in this process)


class GuidedFluxCall(type(FLUX.call)):
    def loss(self, model, noised, condition, context):
        guided = guided_loss(self.entry, model, noised, condition, context)
        if guided is None:
            return super().loss(model, noised, condition, context)
        GUIDED_LOSSES.append(float(guided.detach()))
        return guided


@pytest.fixture
def guided_flux(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    preset = {**FLUX.record.preset, "transformer": {**FLUX.record.preset["transformer"], "guidance_embeds": True}}
    record = replace(FLUX.record, name="flux-guided", preset_name="tiny-flux-guided", preset=preset, text=GuidedPrompt())
    arch = Architecture(record=record, call=GuidedFluxCall(), prompts=FLUX.prompts, sampling=FLUX.sampling, layouts=FLUX.layouts, assembly=FLUX.assembly)
    entries.register(arch)
    yield arch
    entries.unregister(arch.record.name)


@pytest.mark.timeout(300)
def test_a_guidance_distilled_entry_trains_its_lora_with_the_objective_under_zero3(tmp_path, monkeypatch, guided_flux):
    import tests.diffusion_contract as contract
    from safetensors.torch import load_file

    from zeropipe.families import export_run

    config_of = contract.run_config

    def with_objective(*args, **kwargs):
        config = config_of(*args, **kwargs)
        config["model"]["diffusion"] = {"guidance_preserving": 4.0, "guidance": 4.0}
        return config

    monkeypatch.setattr(contract, "run_config", with_objective)
    run = cached_run("flux-guided", guided_flux, tmp_path, round_trip=False)
    assert run.read_config().model.diffusion.guidance_preserving == 4.0
    GUIDED_LOSSES.clear()
    train_one_rank("flux-guided", guided_flux, run, monkeypatch)
    # Two steps of micro-batch 2, and the fixed-batch loss before and after: every loss the rank took was the objective's.
    assert len(GUIDED_LOSSES) >= 4 and all(torch.isfinite(torch.tensor(GUIDED_LOSSES))), GUIDED_LOSSES
    layers = load_file(str(export_run(run.path, tmp_path / "lora", dtype="fp32") / "pytorch_lora_weights.safetensors"))
    ups = [value for key, value in layers.items() if "lora_B" in key]
    assert ups and sum(bool(value.abs().max() > 0) for value in ups) > len(ups) / 2
