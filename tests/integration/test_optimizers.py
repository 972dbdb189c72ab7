"""train.optimizer on 2 CPU ranks through `zeropipe train`: DeepSpeed's Muon under ZeRO-3 trains, records what ran and
resumes exactly from a checkpoint; bitsandbytes' AdamW8bit (a client optimizer the ranks build) trains under ZeRO-2.

The per-optimizer arithmetic (each against its library alone, and each one's resume) is in
tests/unit/engine/test_optimizers.py; these runs show the launcher, the check, the ranks' JSON and
the checkpoints carry the choice across two ranks.
"""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from tests.integration.conftest import assert_ok, metrics, tiny_run_config, write_config, zeropipe

STEPS, SAVE_AT = 6, 3


@pytest.mark.integration
@pytest.mark.parametrize(("optimizer", "stage"), [("muon", 3), ("adamw8bit", 2)])
def test_optimizer_trains_on_two_ranks_and_resumes_exactly(tmp_path, optimizer, stage, monkeypatch):
    # DeepSpeed's Muon compiles its Newton-Schulz steps with torch.compile: minutes of C++ builds on 2 CPU cores.
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    config = write_config(tmp_path, tiny_run_config(
        tmp_path, name="reference",
        train={"optimizer": optimizer, "max_steps": STEPS, "save_every": SAVE_AT, "keep_last": 5, "lr": 3e-3, "log_every": 1},
        deepspeed={"zero_stage": stage, "precision": "fp32"}, generate={"prompts": []},
    ))
    assert_ok(zeropipe("train", config))
    run_dir = tmp_path / "runs" / "reference"
    reference = metrics(run_dir)
    assert reference[-1]["loss"] < reference[0]["loss"]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["optimizer"] == optimizer
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ("optimizer" not in ds) if optimizer == "adamw8bit" else ds["optimizer"]["type"] == "Muon"

    if optimizer == "adamw8bit":
        return  # its resume, like every optimizer's, is held bit-exact in the unit test; one 2-rank resume is enough here
    resumed_dir = tmp_path / "runs" / "resumed"
    shutil.copytree(run_dir, resumed_dir)
    assert_ok(zeropipe("train", config, "run.name=resumed", "--resume", resumed_dir / "checkpoints" / f"step_{SAVE_AT:08d}"))
    resumed = {row["step"]: row["loss"] for row in metrics(resumed_dir)}
    for row in reference[SAVE_AT:]:
        assert resumed[row["step"]] == pytest.approx(row["loss"], rel=1e-6, abs=1e-7), (optimizer, row["step"])
