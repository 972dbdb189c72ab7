"""Rules that need the memory plan (zeropipe.plan): too big, ZeRO-3 not needed, activations dominate."""

from __future__ import annotations

from zeropipe.errors import ZeroPipeError
from zeropipe.families import model_spec
from zeropipe.plan import detect_hardware, plan_run

GIB = 1024**3
# Below this, activations are too small for gradient checkpointing's extra compute to pay (ZP013).
ACTIVATION_FLOOR_BYTES = 1 * GIB


def readable_bytes(num_bytes: float) -> str:
    """GiB with one decimal, or MiB where that would round to 0.0 GiB."""
    if num_bytes >= 0.05 * GIB:
        return f"{num_bytes / GIB:.1f} GiB"
    return f"{num_bytes / 1024**2:.0f} MiB"


def plan_context(context):
    """The plan of the config's own choice on this machine's hardware, or None when it cannot be made."""

    try:
        hardware = detect_hardware(cpu_ranks=context.world_size)
        return plan_run(context.config, hardware, model_spec(context.config))
    except ZeroPipeError:
        return None  # the config problem is reported by the rules that own it


def memory_problems(ctx):
    configured = ctx.plan.configured if ctx.plan is not None else None
    if configured is None or configured.fits:
        return []
    fix = "zeropipe plan shows the settings that fit"
    if ctx.plan.best is not None:
        fix = f"use {ctx.plan.best.choice.describe()} (zeropipe plan shows why), or set the knobs to auto"
    return [("deepspeed", f"does not fit: {configured.why_not}", fix)]


def zero3_unneeded(ctx):
    plan = ctx.plan
    if plan is None or plan.configured is None or plan.configured.choice.zero_stage != 3:
        return []
    choice = plan.configured.choice
    lighter = [
        c
        for c in plan.candidates
        if c.fits
        and c.choice.zero_stage in (1, 2)
        and not c.choice.offload_param
        and (c.choice.micro_batch_size, c.choice.gradient_accumulation_steps, c.choice.precision) == (choice.micro_batch_size, choice.gradient_accumulation_steps, choice.precision)
    ]
    if not lighter:
        return []
    best = min(lighter, key=lambda c: c.relative_cost)
    return [
        (
            "deepspeed.zero_stage",
            f"ZeRO-3 gathers every layer's parameters in each forward and backward (about 1.5x the communication of ZeRO-2); "
            f"ZeRO-{best.choice.zero_stage} fits here at {readable_bytes(best.per_gpu_bytes)} per GPU",
            f"set deepspeed.zero_stage: {best.choice.zero_stage} (or auto)",
        )
    ]


def activation_heavy(ctx):
    plan = ctx.plan
    if plan is None or plan.configured is None or plan.configured.choice.gradient_checkpointing:
        return []
    terms = plan.configured.per_gpu_terms
    activations = sum(t.bytes for t in terms if t.name.startswith("activations"))
    total = sum(t.bytes for t in terms) or 1
    if activations / total < 0.5 or activations < ACTIVATION_FLOOR_BYTES:
        return []
    return [
        (
            "model.gradient_checkpointing",
            f"activations are {readable_bytes(activations)} of {readable_bytes(total)} per GPU ({100 * activations / total:.0f}%)",
            "set model.gradient_checkpointing: true (about 30% more compute, activations shrink to one layer's inputs) or lower train.micro_batch_size",
        )
    ]
