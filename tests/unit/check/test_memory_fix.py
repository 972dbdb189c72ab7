"""ZP011's fix keeps what the user set (ZeRO stage, offload, precision, checkpointing) and the global batch, or says why one must change.

The issue's case: a 0.4B Llama with ZeRO-3 and fp32 on 4 CPU ranks, micro-batch 16, refused with
a fix that switched to ZeRO-1 and bf16 although the user had asked for fp32. The plans here are
made for a stated machine (CPU ranks, a given host RAM, bf16 in the CPU's hardware or not), not
this one, so the answers do not depend on where the tests run.
"""

from __future__ import annotations

import pytest

from zeropipe.check.planning import memory_problems
from zeropipe.check.run import build_context
from zeropipe.config.load import validate_config
from zeropipe.plan import Choice, evaluate
from zeropipe.plan.hardware import GIB, Hardware

# 24 layers x 1024 (0.4B parameters): the shape of the run the issue measured.
MID_LLAMA = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
}
RANKS = 4


@pytest.fixture
def context_for(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')

    def build(deepspeed: dict, host_ram_gib: int, micro_batch_size: int = 16, bf16_native: bool = False):
        raw = {
            "model": {"config": dict(MID_LLAMA)},
            "data": {"path": str(data), "max_seq_len": 512},
            "train": {"micro_batch_size": micro_batch_size},
            "deepspeed": deepspeed,
            "hardware": {"gpus": RANKS, "accelerator": "cpu"},
        }
        ram = host_ram_gib * GIB
        # The machine is injected into the one resolve: precision auto, the plan and the fix all decide for it.
        hardware = Hardware(RANKS, ram // RANKS, 1, ram, None, "cpu", cpu_bf16_native=bf16_native)
        context = build_context(validate_config(raw), world_size=RANKS, accelerator="cpu", hardware=hardware)
        assert context.plan.hardware is hardware
        return context

    return build


def suggested_settings(fix: str) -> dict[str, str]:
    """The `key: value` pairs after "set " in a fix."""
    listed = fix[len("set ") :] if fix.startswith("set ") else fix.split("; set ", 1)[1]
    listed = listed.split(" (keeps")[0].split(", which fits")[0]
    return dict(pair.split(": ", 1) for pair in listed.split(", "))


def apply(context, settings: dict[str, str]) -> Choice:
    choice = context.plan.configured.choice
    fields = {
        "deepspeed.zero_stage": ("zero_stage", int),
        "deepspeed.offload_optimizer": ("offload_optimizer", lambda v: v == "cpu"),
        "deepspeed.offload_param": ("offload_param", lambda v: v == "cpu"),
        "deepspeed.precision": ("precision", str),
        "model.gradient_checkpointing": ("gradient_checkpointing", lambda v: v == "true"),
        "train.micro_batch_size": ("micro_batch_size", int),
        "train.gradient_accumulation_steps": ("gradient_accumulation_steps", int),
    }
    changes = {fields[key][0]: fields[key][1](value) for key, value in settings.items()}
    return Choice(**{**vars(choice), **changes})


def test_the_fix_keeps_the_stage_and_precision_the_user_set(context_for):
    context = context_for({"zero_stage": 3, "precision": "fp32"}, host_ram_gib=24)
    assert context.user_set == {"zero_stage": 3, "precision": "fp32"}
    [(_, message, fix)] = memory_problems(context)
    assert message.startswith("does not fit")
    settings = suggested_settings(fix)
    assert "deepspeed.precision" not in settings and "deepspeed.zero_stage" not in settings, fix
    assert "keeps your deepspeed.zero_stage: 3, deepspeed.precision: fp32 and the global batch" in fix
    suggested = apply(context, settings)
    # What it suggests fits on that machine, with the batch the user asked for.
    assert evaluate(context.plan.spec, context.plan.hardware, suggested).fits
    assert suggested.micro_batch_size * suggested.gradient_accumulation_steps == 16


def test_a_setting_that_cannot_fit_is_changed_with_the_reason(context_for):
    # 16 GiB: no fp32 choice under ZeRO-3 fits (DeepSpeed keeps the 0.4B model gathered on
    # every rank from the second step: about 18 GiB at least); on a CPU with bf16 in hardware,
    # giving up one of the two settings the user made does. (On an AVX2 CPU nothing fits:
    # no bf16 there, see test_on_an_avx2_cpu_the_fix_never_proposes_bf16_or_offload.)
    context = context_for({"zero_stage": 3, "precision": "fp32"}, host_ram_gib=16, bf16_native=True)
    [(_, _, fix)] = memory_problems(context)
    released = fix.split(" as you set it cannot fit (")[0]
    assert released in ("deepspeed.zero_stage: 3", "deepspeed.precision: fp32"), fix
    assert "nothing fits with zero_stage=3, precision=fp32 held fixed" in fix
    settings = suggested_settings(fix)
    key = released.split(":")[0]
    # Only the released one of the user's settings changes, and what is suggested fits.
    assert key in settings and not ({"deepspeed.zero_stage", "deepspeed.precision"} - {key}) & set(settings), fix
    assert evaluate(context.plan.spec, context.plan.hardware, apply(context, settings)).fits


def test_what_the_user_left_to_defaults_may_change_and_auto_precision_is_kept(context_for):
    # Nothing set but the batch: the stage (default 2) may change; precision auto picked fp32
    # for this CPU (no bf16 in hardware), and the fix does not switch it to bf16.
    context = context_for({}, host_ram_gib=24)
    assert context.user_set == {}
    [(_, _, fix)] = memory_problems(context)
    settings = suggested_settings(fix)
    assert "deepspeed.precision" not in settings, fix
    assert "(keeps the global batch)" in fix
    assert evaluate(context.plan.spec, context.plan.hardware, apply(context, settings)).fits


def test_nothing_fits_says_so_with_the_planner_reason(context_for):
    context = context_for({"zero_stage": 3, "precision": "fp32"}, host_ram_gib=6)
    [(_, _, fix)] = memory_problems(context)
    assert fix.startswith("nothing fits with the settings you chose (nothing fits with zero_stage=3, precision=fp32 held fixed")


@pytest.mark.parametrize(
    ("deepspeed", "host_ram_gib"),
    [
        ({}, 16),  # the old fix: "set deepspeed.precision: bf16"
        ({"zero_stage": 3}, 16),  # the old fix: offload_param: cpu and bf16
        ({"zero_stage": 3}, 24),  # the old fix: "set deepspeed.offload_param: cpu, ..."
    ],
)
def test_on_an_avx2_cpu_the_fix_never_proposes_bf16_or_offload(context_for, deepspeed, host_ram_gib):
    context = context_for(deepspeed, host_ram_gib=host_ram_gib, bf16_native=False)
    [(_, _, fix)] = memory_problems(context)
    assert "precision: bf16" not in fix and "offload_param: cpu" not in fix and "offload_optimizer: cpu" not in fix, fix
    if fix.startswith("nothing fits"):
        # precision: auto's fp32 is kept, and the fix says why bf16 is not offered.
        assert fix.endswith("precision stays fp32: this CPU has no bf16 in hardware (no avx512_bf16/AMX): bf16 would run 18-56x slower than fp32"), fix
    else:
        assert evaluate(context.plan.spec, context.plan.hardware, apply(context, suggested_settings(fix))).fits


def test_on_a_cpu_with_bf16_in_hardware_auto_precision_is_bf16_and_the_fix_keeps_it(context_for):
    # 16 GiB: nothing fits in fp32 (on an AVX2 CPU the fix says so, above). Where the CPU runs
    # bf16 natively, the one resolve already picked bf16 for precision: auto, the plan is made in
    # it, and the fix only changes what the user left to defaults, never back to fp32.
    context = context_for({}, host_ram_gib=16, bf16_native=True)
    assert context.config.deepspeed.precision == "bf16" and context.plan.configured.choice.precision == "bf16"
    [(_, _, fix)] = memory_problems(context)
    settings = suggested_settings(fix)
    assert "deepspeed.precision" not in settings, fix
    assert "deepspeed.offload_param" not in settings and "deepspeed.offload_optimizer" not in settings, fix
    assert evaluate(context.plan.spec, context.plan.hardware, apply(context, settings)).fits


def test_offload_the_user_set_on_cpu_ranks_is_dropped_with_the_reason(context_for):
    context = context_for({"zero_stage": 2, "offload_optimizer": "cpu"}, host_ram_gib=20)
    [(_, _, fix)] = memory_problems(context)
    assert fix.startswith("deepspeed.offload_optimizer: cpu as you set it (it saves nothing on CPU ranks"), fix
    settings = suggested_settings(fix)
    assert settings["deepspeed.offload_optimizer"] == "none" and "deepspeed.zero_stage" not in settings, fix
    assert evaluate(context.plan.spec, context.plan.hardware, apply(context, settings)).fits


def test_when_no_setting_fits_the_fix_names_the_nearest_box(context_for):
    """No ZeRO setting and no change the planner knows fits 3 GiB: the fix names the RAM that would (CPU ranks: more RAM, shared by the ranks)."""
    context = context_for({"zero_stage": 3, "precision": "fp32"}, host_ram_gib=3)
    [(_, _, fix)] = memory_problems(context)
    assert "no change the planner knows fits this box; the nearest that fits: --cpu-ranks " in fix and "GB: ZeRO-" in fix
