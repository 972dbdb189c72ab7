"""ZP019: bf16 on a CPU that emulates it, or offload on CPU ranks, is warned about with the fix.

The machine is described (a plan on CPU ranks with or without bf16 in hardware), not this one,
so the answers do not depend on where the tests run.
"""

from __future__ import annotations

import pytest

from zeropipe.check.rules import run_rules
from zeropipe.check.run import build_context
from zeropipe.config.load import validate_config
from zeropipe.plan.hardware import GIB, Hardware

RANKS = 2


@pytest.fixture
def findings_for(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')

    def build(deepspeed: dict, bf16_native: bool, accelerator: str = "cpu"):
        raw = {
            "model": {"config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}},
            "data": {"path": str(data), "max_seq_len": 64},
            "deepspeed": deepspeed,
            "hardware": {"gpus": RANKS},
        }
        ram = 16 * GIB
        hardware = Hardware(RANKS, ram // RANKS, 1, ram, None, "cpu", cpu_bf16_native=bf16_native)
        context = build_context(validate_config(raw), world_size=RANKS, accelerator=accelerator, hardware=hardware)
        return [f for f in run_rules(context) if f.rule == "ZP019"]

    return build


def test_bf16_on_a_cpu_that_emulates_it_is_a_warning_with_the_fix(findings_for):
    [finding] = findings_for({"zero_stage": 2, "precision": "bf16"}, bf16_native=False)
    assert finding.severity == "warning" and finding.key == "deepspeed.precision"
    assert "18-56x slower than fp32" in finding.message
    assert finding.fix.startswith("set deepspeed.precision: auto (fp32 on this CPU)")


def test_bf16_where_the_cpu_runs_it_natively_is_fine(findings_for):
    assert findings_for({"zero_stage": 2, "precision": "bf16"}, bf16_native=True) == []


def test_offload_on_cpu_ranks_is_a_warning_with_the_fix(findings_for):
    [finding] = findings_for({"zero_stage": 3, "precision": "fp32", "offload_optimizer": "cpu", "offload_param": "cpu"}, bf16_native=False)
    assert finding.key == "deepspeed.offload_optimizer"
    assert "offload_optimizer and offload_param on CPU ranks saves no memory" in finding.message
    assert finding.fix.startswith("set deepspeed.offload_optimizer: none and deepspeed.offload_param: none")


def test_auto_precision_and_no_offload_are_not_warned_about(findings_for):
    # precision auto resolves to fp32 on a CPU without bf16: nothing to say.
    assert findings_for({"zero_stage": 2}, bf16_native=False) == []


def test_a_deliberate_choice_is_accepted(tmp_path):
    from zeropipe.check.run import check_config

    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    raw = {
        "model": {"config": {"model_type": "llama", "hidden_size": 64}},
        "data": {"path": str(data)},
        "deepspeed": {"zero_stage": 2, "offload_optimizer": "cpu"},
        "hardware": {"gpus": RANKS, "accelerator": "cpu"},
    }
    assert "ZP019" in {f.rule for f in check_config(validate_config(raw), world_size=RANKS, accelerator="cpu")}
    raw["run"] = {"accept_warnings": ["ZP019"]}
    assert "ZP019" not in {f.rule for f in check_config(validate_config(raw), world_size=RANKS, accelerator="cpu")}


def test_gpu_runs_are_not_concerned(findings_for):
    assert findings_for({"zero_stage": 3, "precision": "bf16", "offload_optimizer": "cpu"}, bf16_native=False, accelerator="cuda") == []
