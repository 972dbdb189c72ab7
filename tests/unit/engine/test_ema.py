"""train.ema's update rule, checked against a single-process reference and diffusers' own EMAModel on the same per-step weights."""

from __future__ import annotations

import pytest
import logging

import torch
from diffusers.training_utils import EMAModel

from zeropipe.engine.ema import EmaWeights


def training(steps: int):
    """A small fp32 model trained with AdamW: yields its parameters after each optimizer step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    params = list(model.parameters())
    yield params  # before the first step: what EmaWeights starts from
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        yield params


def reference_decay(n: int, decay: float, warmup: str, power: float) -> float:
    # The n-th update (from 1): diffusers' EMAModel.get_decay with update_after_step=0, inv_gamma=1.
    t = n - 1
    if t <= 0:
        return 0.0
    return min(decay, {"ratio": (1 + t) / (10 + t), "power": 1 - (1 + t) ** -power, "none": decay}[warmup])


@pytest.mark.parametrize("warmup", ["ratio", "power", "none"])
@pytest.mark.parametrize("every", [1, 3])
def test_the_ema_equals_the_reference_computed_from_the_per_step_weights(warmup, every):
    steps, decay, power = 40, 0.9, 0.75
    trained = training(steps)
    masters = next(trained)
    ema = EmaWeights(masters, None, decay, warmup, power)
    reference, updates = [p.detach().clone() for p in masters], 0
    for step, params in enumerate(trained, start=1):
        if step % every:
            continue
        ema.update()
        updates += 1
        d = reference_decay(updates, decay, warmup, power)
        reference = [d * r + (1 - d) * p.detach() for r, p in zip(reference, params)]
    assert updates == steps // every and ema.updates == updates
    assert max((r - p.detach()).abs().max().item() for r, p in zip(reference, masters)) > 1e-3, "EMA and weights would coincide: the test proves nothing"
    for mine, theirs in zip(ema.tensors, reference):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("warmup", ["ratio", "power"])
def test_the_warmup_forms_are_diffusers_emamodel(warmup):
    trained = training(30)
    masters = next(trained)
    ema = EmaWeights(masters, None, 0.95, warmup, 2 / 3)
    theirs = EMAModel(masters, decay=0.95, use_ema_warmup=warmup == "power", power=2 / 3)
    for params in trained:
        ema.update()
        theirs.step(params)
    for mine, shadow in zip(ema.tensors, theirs.shadow_params):
        torch.testing.assert_close(mine, shadow, rtol=0, atol=1e-6)


def test_a_saved_ema_continues_exactly_and_another_partitioning_restarts_it(tmp_path, caplog):
    trained = training(12)
    masters = next(trained)
    uninterrupted = EmaWeights(masters, None, 0.9)
    resumed = None
    for step, _ in enumerate(trained, start=1):
        uninterrupted.update()
        if resumed is not None:
            resumed.update()
        if step == 5:
            uninterrupted.save(tmp_path, rank=1, world_size=2)
            resumed = EmaWeights(masters, None, 0.9)
            assert resumed.load(tmp_path, rank=1, world_size=2)
    assert resumed.updates == uninterrupted.updates == 12
    for a, b in zip(resumed.tensors, uninterrupted.tensors):
        assert torch.equal(a, b)

    other = EmaWeights(masters, None, 0.9)
    # Another test in the same process may have set the logger's level (a rank's logging set-up): capture it here.
    with caplog.at_level(logging.INFO, logger="zeropipe"):
        caplog.set_level(logging.INFO)
        assert not other.load(tmp_path, rank=1, world_size=4)
        assert other.updates == 0 and "partitioned for 2 ranks, this run has 4" in caplog.text
        assert not other.load(tmp_path, rank=0, world_size=2)
        assert "holds no EMA" in caplog.text
