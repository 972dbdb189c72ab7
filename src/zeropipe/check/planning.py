"""Rules that need the memory plan (zeropipe.plan): too big, ZeRO-3 not needed, activations dominate."""

from __future__ import annotations

from zeropipe.doctor.facts import cpu_precision
from zeropipe.plan import recommend

GIB = 1024**3
# Below this, activations are too small for gradient checkpointing's extra compute to pay (ZP013).
ACTIVATION_FLOOR_BYTES = 1 * GIB


def readable_bytes(num_bytes: float) -> str:
    """GiB with one decimal, or MiB where that would round to 0.0 GiB."""
    if num_bytes >= 0.05 * GIB:
        return f"{num_bytes / GIB:.1f} GiB"
    return f"{num_bytes / 1024**2:.0f} MiB"


# Knobs a fix gives up, in this order, when nothing fits with every one the user set:
# offload and checkpointing only cost speed; the stage changes how the run shards; the
# precision changes the numbers the model computes with, so it goes last.
RELEASE_ORDER = ("offload_param", "offload_optimizer", "gradient_checkpointing", "zero_stage", "precision")
KNOB_KEYS = {
    "zero_stage": "deepspeed.zero_stage",
    "offload_optimizer": "deepspeed.offload_optimizer",
    "offload_param": "deepspeed.offload_param",
    "precision": "deepspeed.precision",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "micro_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
}


def _yaml_value(knob: str, value) -> str:
    if knob.startswith("offload"):
        return "cpu" if value else "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _changes(configured, suggested) -> list[str]:
    """The settings that differ between two choices, as `key: value` in the run config's words."""
    return [
        f"{key}: {_yaml_value(knob, getattr(suggested, knob))}"
        for knob, key in KNOB_KEYS.items()
        if getattr(configured, knob) != getattr(suggested, knob)
    ]


def _best_keeping(plan, configured, held: dict) -> tuple[object | None, str | None]:
    """The fastest fit with ``held`` knobs fixed and the global batch kept, or (None, why nothing fits)."""
    choice = configured.choice
    world = plan.hardware.world_size
    result = recommend(
        plan.spec,
        plan.hardware,
        global_batch=choice.micro_batch_size * choice.gradient_accumulation_steps * world,
        seq_len=choice.seq_len,
        margin=plan.margin,
        fixed=held,
        attention=choice.attention,
        zero3_limits={"zero3_max_live_parameters": choice.zero3_max_live_parameters, "zero3_reuse_distance": choice.zero3_reuse_distance},
    )
    return result.best, result.reason


def memory_problems(ctx):
    """ZP011, with a fix that keeps what the user set (ZeRO stage, offload, precision, checkpointing) and the global batch.

    When nothing fits with all of them, the fix gives up as few as it can, in RELEASE_ORDER,
    and says which one changes and why (the planner's reason nothing fits with it held).
    """
    configured = ctx.plan.configured if ctx.plan is not None else None
    if configured is None or configured.fits:
        return []
    message = f"does not fit: {configured.why_not}"
    held = {knob: getattr(configured.choice, knob) for knob in ctx.user_set if knob in KNOB_KEYS}
    # precision: auto is a decision for this hardware (fp32 on CPUs without bf16, fp16 on GPUs
    # without it): held like the user's own, and said so when it has to change.
    held.setdefault("precision", configured.choice.precision)
    best, why = _best_keeping(ctx.plan, configured, held)
    if best is not None:
        kept = ", ".join(f"{KNOB_KEYS[k]}: {_yaml_value(k, v)}" for k, v in held.items() if k in ctx.user_set)
        keeping = f" (keeps your {kept} and the global batch)" if kept else " (keeps the global batch)"
        return [("deepspeed", message, f"set {', '.join(_changes(configured.choice, best.choice))}{keeping}; zeropipe plan shows the terms")]
    for released in [k for k in RELEASE_ORDER if k in held]:
        keep = {k: v for k, v in held.items() if k != released}
        best, _ = _best_keeping(ctx.plan, configured, keep)
        if best is not None:
            how = "as you set it" if released in ctx.user_set else "as precision: auto picked it for this hardware"
            if released.startswith("offload") and ctx.plan.hardware.accelerator == "cpu":
                how += " (it saves nothing on CPU ranks, whose 'GPU' memory is host RAM already)"
            return [
                (
                    "deepspeed",
                    message,
                    (
                        f"{KNOB_KEYS[released]}: {_yaml_value(released, held[released])} {how} cannot fit ({why}); "
                        f"set {', '.join(_changes(configured.choice, best.choice))}, which fits; zeropipe plan shows the terms"
                    ),
                )
            ]
    fix = "zeropipe plan shows the settings that fit"
    if ctx.plan.best is not None:
        fix = f"use {ctx.plan.best.choice.describe()} (zeropipe plan shows why), or set the knobs to auto"
    else:
        fix = _smallest_change(ctx.plan, configured) or fix
    hardware = ctx.plan.hardware
    if hardware.accelerator == "cpu" and not hardware.cpu_bf16_native and held.get("precision") == "fp32" and "precision" not in ctx.user_set:
        # Say why bf16, which would halve the weights, is not offered.
        fix += f"; precision stays fp32: {cpu_precision(False)[1]}"
    return [("deepspeed", message, f"nothing fits with the settings you chose ({why}); {fix}")]


def _smallest_change(plan, configured) -> str | None:
    """When no ZeRO setting fits: the smallest change the planner knows that does (caches, an fp8/nf4 base, a smaller image or clip), with its price."""
    from zeropipe.plan.search import complete

    choice = configured.choice
    kwargs = dict(
        global_batch=choice.micro_batch_size * choice.gradient_accumulation_steps * plan.hardware.world_size,
        seq_len=choice.seq_len,
        margin=plan.margin,
        fixed=None,
        attention=choice.attention,
        zero3_limits={"zero3_max_live_parameters": choice.zero3_max_live_parameters, "zero3_reuse_distance": choice.zero3_reuse_distance},
    )
    import dataclasses

    searched = complete(dataclasses.replace(plan, notes=list(plan.notes)), kwargs)  # a copy: the check's plan stays as it was
    if searched.best is not None and searched.settings:
        return f"set {', '.join(s.key for s in searched.settings)} (changes no result), then {searched.best.choice.describe()} fits"
    if searched.offers:
        return searched.offers[0].describe() + "; zeropipe plan lists the other changes"
    if searched.nearest_box:
        return f"no change the planner knows fits this box; the nearest that fits: {searched.nearest_box}"
    return None


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
