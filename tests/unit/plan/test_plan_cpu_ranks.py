"""On CPU ranks the plan follows the hardware: bf16 only where the CPU runs it natively, no offload.

A CPU without avx512_bf16/AMX emulates bf16 (18-56x slower than fp32), so ``precision: auto``
trains in fp32 there and the planner must not recommend bf16 either. A CPU rank's "GPU" memory
is host RAM already: offloading moves bytes from host RAM to host RAM and adds copies, so it is
never recommended there. GPUs keep every option. The machines are described, not detected, so
the answers do not depend on where the tests run.
"""

from __future__ import annotations

import json

import pytest

from zeropipe.config.schema import LoraSection
from zeropipe.doctor.facts import cpu_runs_bf16_natively
from zeropipe.families import model_spec
from zeropipe.plan import detect_hardware, parse_hardware, plan_run, recommend
from zeropipe.plan.hardware import GIB, Hardware
from zeropipe.plan.model_spec import spec_from_catalog, spec_from_path
from zeropipe.plan.render import render_plan
from zeropipe.plan.search import candidate_choices

# 24 layers x 1024 (0.4B parameters): the Llama shape issue 20 measured on CPU ranks.
MID_LLAMA = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
}


def cpu_machine(ranks: int, ram_gib: int, bf16_native: bool) -> Hardware:
    ram = ram_gib * GIB
    return Hardware(ranks, ram // ranks, 1, ram, None, "cpu", cpu_bf16_native=bf16_native)


@pytest.fixture(scope="module")
def mid_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("mid-llama") / "config.json"
    path.write_text(json.dumps(MID_LLAMA))
    return spec_from_path(str(path))


def test_an_avx2_cpu_is_never_recommended_bf16(mid_llama):
    # The old planner recommended ZeRO-1 in bf16 here: 18-56x slower than the fp32 it ran in.
    result = recommend(mid_llama, cpu_machine(4, 24, bf16_native=False), seq_len=512)
    best = result.require_best()
    assert best.choice.precision == "fp32"
    assert {c.choice.precision for c in result.candidates} == {"fp32"}
    assert result.fragment()["deepspeed"]["precision"] == "fp32"
    # The plan says why it keeps fp32.
    assert any("fp32 only tried" in note and "no bf16 in hardware (no avx512_bf16/AMX)" in note for note in result.notes), result.notes
    assert "18-56x slower than fp32" in render_plan(result)


def test_a_cpu_with_bf16_in_hardware_may_be_recommended_bf16(mid_llama):
    result = recommend(mid_llama, cpu_machine(4, 24, bf16_native=True), seq_len=512)
    assert {c.choice.precision for c in result.candidates} == {"bf16", "fp32"}
    # bf16 halves the weights and activations: with it in hardware it is the cheaper fit.
    assert result.require_best().choice.precision == "bf16"
    assert any("bf16 and fp32 tried" in note and "runs bf16 natively" in note for note in result.notes), result.notes


@pytest.mark.parametrize("bf16_native", [False, True])
def test_cpu_ranks_are_never_recommended_offload(bf16_native):
    # Llama-3.1-8B LoRA on 4 CPU ranks with 64 GiB: the old planner "fit" it only by offloading
    # the parameters to host RAM, which on CPU ranks is where they already are.
    spec = spec_from_catalog("llama-3.1-8b", LoraSection(r=16))
    result = recommend(spec, cpu_machine(4, 64, bf16_native), seq_len=512)
    assert result.candidates
    assert not any(c.choice.offload_optimizer or c.choice.offload_param for c in result.candidates)
    assert result.best is None or not (result.best.choice.offload_optimizer or result.best.choice.offload_param)
    assert any("no offload tried" in note and "host RAM already" in note for note in result.notes), result.notes
    # With the RAM for it, the answer has no offload either.
    roomy = recommend(spec, cpu_machine(4, 128, bf16_native), seq_len=512).require_best()
    assert not (roomy.choice.offload_optimizer or roomy.choice.offload_param)


def test_gpus_keep_every_precision_and_offload():
    hardware = parse_hardware("5x24GB", "64GB", gpu_name="NVIDIA GeForce RTX 4090")
    choices = candidate_choices(hardware, seq_len=512)
    assert {c.precision for c in choices} == {"bf16", "fp32"}
    assert {(c.offload_optimizer, c.offload_param) for c in choices if c.zero_stage == 3} == {
        (False, False), (True, False), (False, True), (True, True)
    }
    older = candidate_choices(parse_hardware("4x16GB", "64GB", gpu_name="Tesla V100-SXM2-16GB"), seq_len=512)
    assert {c.precision for c in older} == {"fp16", "fp32"}


def test_knobs_the_user_set_are_judged_as_set(mid_llama):
    # The search leaves bf16 and offload out on an AVX2 CPU, but a config that sets them is
    # still evaluated with them (and check's fix keeps them), not silently refused.
    hardware = cpu_machine(4, 64, bf16_native=False)
    held = candidate_choices(hardware, seq_len=512, fixed={"precision": "bf16", "zero_stage": 2, "offload_optimizer": True})
    assert held and all(c.precision == "bf16" and c.offload_optimizer for c in held)
    result = recommend(mid_llama, hardware, seq_len=512, fixed={"precision": "bf16"})
    assert result.require_best().choice.precision == "bf16"
    assert any("precision bf16 as set, although this CPU has no bf16 in hardware" in note for note in result.notes), result.notes


def test_plan_of_a_config_with_bf16_and_offload_on_an_avx2_cpu_says_what_to_change(tmp_path):
    from zeropipe.config.load import validate_config

    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    config = validate_config(
        {
            "model": {"config": dict(MID_LLAMA), "gradient_checkpointing": False},
            "data": {"path": str(data), "max_seq_len": 512},
            "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 4},
            "deepspeed": {"zero_stage": 2, "precision": "bf16", "offload_optimizer": "cpu", "offload_param": "none"},
            "hardware": {"gpus": 4, "accelerator": "cpu"},
        }
    )
    result = plan_run(config, cpu_machine(4, 64, bf16_native=False), model_spec(config))
    assert result.configured.choice.precision == "bf16" and result.configured.choice.offload_optimizer
    best = result.require_best().choice
    assert best.precision == "fp32" and not best.offload_optimizer
    text = render_plan(result)
    assert "your precision bf16: this CPU has no bf16 in hardware" in text and "set deepspeed.precision: auto (fp32 here)" in text
    assert "your offload saves nothing on CPU ranks" in text


def test_this_machines_cpu_ranks_read_the_cpu_flags():
    hardware = detect_hardware(cpu_ranks=2)
    if hardware.accelerator != "cpu":
        pytest.skip("this machine has CUDA devices: its ranks are GPUs")
    assert hardware.cpu_bf16_native == cpu_runs_bf16_natively()
    precisions = {c.precision for c in candidate_choices(hardware, seq_len=512)}
    assert precisions == ({"bf16", "fp32"} if cpu_runs_bf16_natively() else {"fp32"})
