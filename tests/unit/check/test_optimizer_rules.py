"""train.optimizer against the ZeRO stage and offload: check refuses what would not run (or not be the same algorithm)."""

from __future__ import annotations

import pytest
import yaml

from zeropipe.check.run import check_config
from zeropipe.config.load import load_config
from zeropipe.families import model_spec
from zeropipe.plan.memory import optimizer_bytes_per_parameter


def config_file(tmp_path, **train_and_deepspeed):
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    raw = {"model": {"config": {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}},
           "data": {"path": str(data)}, "train": {"max_steps": 2, **train_and_deepspeed.pop("train", {})},
           "deepspeed": train_and_deepspeed.pop("deepspeed", {}), "hardware": {"gpus": 2}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(("optimizer", "deepspeed", "says"), [
    ("adafactor", {"zero_stage": 2}, "adafactor cannot run under ZeRO-2: Adafactor factors each weight matrix"),
    ("prodigy", {"zero_stage": 3}, "prodigy cannot run under ZeRO-3: Prodigy estimates its step size"),
    ("adamw8bit", {"zero_stage": 2, "offload_optimizer": "cpu"}, "adamw8bit cannot run with deepspeed.offload_optimizer: cpu"),
    ("muon", {"zero_stage": 3, "offload_optimizer": "cpu"}, "muon cannot run with deepspeed.offload_optimizer: cpu"),
])
def test_check_refuses_an_optimizer_its_stage_or_offload_cannot_run(tmp_path, optimizer, deepspeed, says):
    findings = check_config(load_config(config_file(tmp_path, train={"optimizer": optimizer}, deepspeed=deepspeed)), world_size=2, accelerator="cpu")
    ours = [f for f in findings if f.rule == "ZP041"]
    assert ours and ours[0].severity == "error" and says in ours[0].message, [f.message for f in findings]
    assert "deepspeed.zero_stage" in ours[0].fix or "offload_optimizer: none" in ours[0].fix


@pytest.mark.parametrize(("optimizer", "stage"), [("muon", 3), ("adamw8bit", 3), ("adafactor", 0), ("prodigy", 0), ("adamw", 3)])
def test_check_passes_what_runs(tmp_path, optimizer, stage):
    findings = check_config(load_config(config_file(tmp_path, train={"optimizer": optimizer}, deepspeed={"zero_stage": stage})), world_size=2, accelerator="cpu")
    assert not [f for f in findings if f.rule == "ZP041"]


def test_the_planner_counts_each_optimizers_state(tmp_path):
    """K per trainable weight: fp32 master (4, under ZeRO) + the optimizer's state."""
    assert optimizer_bytes_per_parameter("bf16", 3) == 12
    assert optimizer_bytes_per_parameter("bf16", 3, "adamw8bit") == 6
    assert optimizer_bytes_per_parameter("bf16", 2, "muon") == 8
    assert optimizer_bytes_per_parameter("fp32", 0, "prodigy") == 16
    spec = model_spec(load_config(config_file(tmp_path, train={"optimizer": "adamw8bit"})))
    assert spec.optimizer == "adamw8bit"
