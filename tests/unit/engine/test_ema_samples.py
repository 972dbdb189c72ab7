"""train.ema.sample_from_ema: inside ``EmaWeights.in_module`` the module computes with the EMA weights, and after it with the trained ones, exactly.

One tiny Llama through ``deepspeed.initialize`` (world size 1, gloo, fp32) at each ZeRO stage: the EMA's
expected value is computed here from the weights after each step; the next step after the block equals
the step of an engine that never sampled.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.engine.test_optimizers import LR, STEPS, batch, distributed, run_config, tiny_model  # noqa: F401 (distributed: a fixture)
from zeropipe.config.deepspeed import build_deepspeed_config
from zeropipe.config.schema import EmaSection
from zeropipe.engine.ema import EmaWeights

DECAY = 0.5


def engine_for(config, model: torch.nn.Module):
    """A DeepSpeed engine over torch's AdamW (a client optimizer: no DeepSpeed op to compile for this check)."""
    import deepspeed

    ds = build_deepspeed_config(config, world_size=1, total_steps=STEPS, hidden_size=32).config
    ds.pop("optimizer", None)
    parameters = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters, optimizer=torch.optim.AdamW(parameters, lr=LR), config=ds)
    return engine


def weights_of(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def step(engine, ids) -> float:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


@pytest.mark.parametrize("stage", [0, 2, 3])  # ZeRO-1 publishes as ZeRO-2 does (update_lp_params)
def test_samples_see_the_ema_and_training_goes_on_with_the_trained_weights(tmp_path, distributed, stage):  # noqa: F811
    config = run_config(tmp_path, "adamw", stage)
    ids = batch()
    engine = engine_for(config, tiny_model())
    ema = EmaWeights.for_engine(engine, EmaSection(decay=DECAY, warmup="none"))
    history = []
    for _ in range(2):
        step(engine, ids)
        ema.update()
        history.append(weights_of(engine))
    expected = {name: DECAY * history[0][name] + (1 - DECAY) * history[1][name] for name in history[1]}  # the first update copies the weights
    assert max((expected[n] - history[1][n]).abs().max().item() for n in expected) > 1e-4, "EMA and weights coincide: the test proves nothing"

    with ema.in_module(engine):
        inside = weights_of(engine)
    after = weights_of(engine)
    for name in expected:
        torch.testing.assert_close(inside[name], expected[name], rtol=0, atol=1e-6, msg=f"stage {stage}: {name} inside the block")
        assert torch.equal(after[name], history[1][name]), f"stage {stage}: {name} after the block"

    # The optimizer went on from the trained weights: the third step equals that of an engine that never sampled.
    reference = engine_for(config, tiny_model())
    for _ in range(2):
        step(reference, ids)
    assert step(engine, ids) == step(reference, ids)
    for name, tensor in weights_of(reference).items():
        assert torch.equal(weights_of(engine)[name], tensor), f"stage {stage}: {name} after the third step"
