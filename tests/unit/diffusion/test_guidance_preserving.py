"""The guidance-preserving objective part (``parts/guidance.py``) on a real tiny FLUX.1 [dev]-style denoiser.

The figure that it keeps a guidance-distilled teacher's guided output is ``benchmarks/guidance_preserving.py``'s
(BENCHMARKS.md); here: the loss is the raw velocity's error, the unconditional pass gives no gradient, the
condition a micro-batch carries splits back into the two conditionings, and the setting is refused by name where
it cannot apply.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from zeropipe.config.schema import RunConfig
from zeropipe.families.diffusion.bases.flux import ARCHITECTURE as FLUX
from zeropipe.families.diffusion.core import Architecture, PredictContext
from zeropipe.families.diffusion.entries import architecture_for_preset
from zeropipe.families.diffusion.objectives import FlowObjective, weighted_mse
from zeropipe.families.diffusion.parts import GuidedPrompt, part_problems
from zeropipe.families.diffusion.parts.guidance import KEY, SCALE, UNCONDITIONAL, guided_loss, split_unconditional

CPU = torch.device("cpu")


class GuidedFluxCall(type(FLUX.call)):
    """FLUX.1 [dev]'s denoiser call selecting the objective as a guidance-distilled entry does (with the GuidedPrompt part)."""

    def loss(self, model, noised, condition, context):
        guided = guided_loss(self.entry, model, noised, condition, context)
        return guided if guided is not None else super().loss(model, noised, condition, context)


GUIDED = Architecture(record=replace(FLUX.record, text=GuidedPrompt()), call=GuidedFluxCall(), prompts=FLUX.prompts, sampling=FLUX.sampling, layouts=FLUX.layouts, assembly=FLUX.assembly)


@pytest.fixture(scope="module")
def tiny_dev():
    """The tiny FLUX preset's transformer with guidance embedding (as FLUX.1 [dev]), and a conditioning of two prompts and of the empty one.

    The conditioning tensors are drawn, not encoded: the objective reads them only through the entry's ``predict``.
    """
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(2)
    model = FluxTransformer2DModel(**{**FLUX.record.preset["transformer"], "guidance_embeds": True})
    prompt = {"prompt_embeds": torch.randn(2, 12, 64), "pooled_prompt_embeds": torch.randn(2, 32)}
    empty = {"prompt_embeds": torch.randn(1, 12, 64).expand(2, -1, -1), "pooled_prompt_embeds": torch.randn(1, 32).expand(2, -1)}
    return model, prompt, empty


def micro_batch(prompt, empty, scale):
    """A micro-batch's condition as GuidedPrompt.batch hands it over with the setting on."""
    return {**prompt, **{UNCONDITIONAL + key: value for key, value in empty.items()}, SCALE: torch.tensor(scale)}


def test_the_loss_fits_the_raw_velocity_and_only_the_conditional_pass_has_gradient(tiny_dev):
    model, prompt, empty = tiny_dev
    context = PredictContext(CPU, torch.float32, 8, guidance=4.0)
    torch.manual_seed(0)
    latents = torch.randn(2, 4, 8, 8)  # the tiny VAE's 4 channels, a 64-pixel image
    noised = FlowObjective({"shift": 1.0}, RunConfig.model_validate({"model": {"config": {"pipeline": "tiny-flux"}}, "data": {"path": "."}}).model.diffusion).noise(latents)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    loss = GUIDED.call.loss(model, noised, micro_batch(prompt, empty, 4.0), context)
    got = grads(loss)
    # By hand: the guided call with gradient, the unconditional one as a constant, the CFG equation solved for the raw velocity.
    guided = GUIDED.call.predict(model, noised.model_input, noised.timesteps, prompt, context)
    with torch.no_grad():
        unguided = GUIDED.call.predict(model, noised.model_input, noised.timesteps, empty, context)
    expected = weighted_mse((guided + 3.0 * unguided) / 4.0, noised.target, None)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    assert torch.allclose(got, grads(expected), atol=1e-6)
    # Not plain flow matching (the setting off: the entry's own loss), and not the same step either.
    plain = GUIDED.call.loss(model, noised, prompt, context)
    assert float(plain) == pytest.approx(float(weighted_mse(guided, noised.target, None)), rel=1e-5)
    assert abs(float(plain) - float(loss)) > 1e-3
    assert not torch.allclose(grads(plain), got, atol=1e-6)


def test_a_micro_batch_splits_back_into_the_prompts_and_the_empty_prompts_conditioning(tiny_dev):
    _, prompt, empty = tiny_dev
    own, unconditional, scale = split_unconditional(micro_batch(prompt, empty, 3.5))
    assert scale == 3.5 and own.keys() == prompt.keys() == unconditional.keys()
    assert all(torch.equal(own[k], prompt[k]) and torch.equal(unconditional[k], empty[k]) for k in prompt)
    assert split_unconditional(prompt) == (prompt, None, None)


def test_the_setting_is_refused_by_name_where_it_cannot_apply(tmp_path):
    def problems(arch, pipeline, value):
        config = RunConfig.model_validate({"model": {"config": {"pipeline": pipeline}, "diffusion": {"guidance_preserving": value}}, "data": {"path": str(tmp_path)}})
        return part_problems(config, arch)

    assert problems(GUIDED, "tiny-flux", 4.0) == []
    [(key, message)] = problems(FLUX, "tiny-flux", 4.0)  # an entry that does not select the objective
    assert key == KEY and "does not offer" in message and "remove" in message
    [(key, message)] = problems(GUIDED, "tiny-flux", 1.0)
    assert key == KEY and "bakes in no guidance" in message
    sdxl = architecture_for_preset("tiny-sdxl")
    guided_sdxl = Architecture(record=replace(sdxl.record, text=GuidedPrompt()), call=sdxl.call, prompts=sdxl.prompts, sampling=sdxl.sampling, layouts=sdxl.layouts, assembly=sdxl.assembly)
    [(key, message)] = problems(guided_sdxl, "tiny-sdxl", 4.0)
    assert key == KEY and "flow matching" in message and "ddpm" in message
