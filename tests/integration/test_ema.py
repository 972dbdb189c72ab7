"""train.ema on 2 ranks under ZeRO-3: each rank's partition of the EMA, gathered, is the EMA of the trained weights, and resumes exactly."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.integration.conftest import assert_ok, metrics, tiny_run_config, write_config, zeropipe, zeropipe_here
from zeropipe.checkpoint.consolidate import consolidated_ema_state_dict, consolidated_state_dict
from zeropipe.checkpoint.manager import CheckpointInfo, tag_for

pytestmark = pytest.mark.integration

STEPS, DECAY = 4, 0.8


def checkpoint(run_dir, step: int) -> CheckpointInfo:
    return CheckpointInfo(tag_for(step), step, run_dir / "checkpoints" / tag_for(step))


def test_zero3_ema_equals_the_reference_from_the_per_step_weights_and_resumes_exactly(tmp_path):
    # fp32 CPU ranks, a checkpoint after every step: the checkpoints' consolidated weights are the
    # per-step master weights, from which a single process computes the reference EMA.
    config = tiny_run_config(
        tmp_path,
        name="ema",
        train={"max_steps": STEPS, "save_every": 1, "keep_last": STEPS, "log_every": 1, "ema": {"decay": DECAY, "warmup": "none"}},
        deepspeed={"zero_stage": 3, "precision": "fp32"},
        generate={"prompts": []},
    )
    path = write_config(tmp_path, config)
    assert_ok(zeropipe("train", path))
    run_dir = tmp_path / "runs" / "ema"
    assert sorted(p.name for p in checkpoint(run_dir, STEPS).path.glob("ema_rank*.pt")) == ["ema_rank0.pt", "ema_rank1.pt"]

    reference = None
    for step in range(1, STEPS + 1):
        weights = consolidated_state_dict(checkpoint(run_dir, step))
        decay = 0.0 if reference is None else DECAY  # the first update copies the weights (diffusers' EMAModel)
        reference = {name: decay * reference[name] + (1 - decay) * w if reference else w.clone() for name, w in weights.items()}
        if step in (2, STEPS):
            ema = consolidated_ema_state_dict(checkpoint(run_dir, step))
            assert ema.keys() == weights.keys()
            for name in weights:
                torch.testing.assert_close(ema[name], reference[name], rtol=0, atol=1e-6, msg=f"step {step}: {name}")
    assert max((ema[n] - weights[n]).abs().max().item() for n in weights) > 1e-4, "EMA and weights coincide: the test proves nothing"

    # Exported beside the plain weights: both load with from_pretrained, the EMA export holds the EMA.
    from transformers import AutoModelForCausalLM

    for flag, expected in (("--ema", ema), (None, weights)):
        out = tmp_path / ("export-ema" if flag else "export")
        assert_ok(zeropipe_here("export", run_dir, "--out", out, *([flag] if flag else [])))
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor), (flag, name)

    # Resumed from step 2 in a copy of the run: the same EMA at the end as the uninterrupted run's.
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    result = zeropipe("train", path, "--resume", cut / "checkpoints" / tag_for(2))
    assert_ok(result)
    assert [row["step"] for row in metrics(cut)] == list(range(1, STEPS + 1))
    resumed = consolidated_ema_state_dict(checkpoint(cut, STEPS))
    for name in ema:
        assert torch.equal(resumed[name], ema[name]), name
