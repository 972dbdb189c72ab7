"""train.activation_offload on a real DeepSpeed run: the per-step losses are those of the same run without it.

One CPU rank each way (the offload hooks act inside each rank's forward and backward; nothing
about them differs across ranks), fp32, ZeRO-3 with LoRA: the setting where checkpointing meets
both DeepSpeed's parameter hooks and frozen block inputs. On a CPU rank the inputs are copied into
fresh host tensors and read back from them in backward, so the round trip is exercised as on a GPU.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import assert_ok, metrics, zeropipe

pytestmark = pytest.mark.integration


def test_activation_offload_gives_the_same_losses(tmp_run):
    tmp_path, make = tmp_run
    losses = {}
    for offload in (False, True):
        name = "offload" if offload else "on-gpu"
        config = make(
            name,
            model={"gradient_checkpointing": True, "lora": {"r": 4, "alpha": 8}},
            train={"max_steps": 6, "log_every": 1, "activation_offload": offload},
            deepspeed={"zero_stage": 3, "precision": "fp32"},
            hardware={"gpus": 1},
            generate={"prompts": []},
        )
        assert_ok(zeropipe("train", config))
        rows = metrics(tmp_path / "runs" / name)
        losses[name] = [row["loss"] for row in rows if "loss" in row]
        moved = [row.get("activation_offload_bytes") for row in rows]
        if offload:
            # Each step copied the two layers' inputs: 2 layers x tokens x 32 hidden x 4 bytes (fp32), tokens as padded.
            assert all(m and m % (2 * 32 * 4) == 0 and m <= 2 * 8 * 32 * 32 * 4 for m in moved), moved
        else:
            assert moved == [None] * len(rows)
    assert len(losses["offload"]) == 6
    assert losses["offload"] == pytest.approx(losses["on-gpu"], abs=1e-6, rel=0)
    assert losses["offload"][-1] < losses["offload"][0]
