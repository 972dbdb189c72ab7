"""Fill the knobs a config leaves as "auto" (ZeRO stage, offload, checkpointing, batch shape) from the plan."""

from __future__ import annotations

from zeropipe.config.schema import RunConfig
from zeropipe.plan import PlanResult

AUTO_KNOBS = {
    ("deepspeed", "zero_stage"),
    ("deepspeed", "offload_optimizer"),
    ("deepspeed", "offload_param"),
    ("model", "gradient_checkpointing"),
    ("train", "micro_batch_size"),
    ("train", "gradient_accumulation_steps"),
}


def auto_knobs(config: RunConfig) -> list[tuple[str, str]]:
    return sorted((section, key) for section, key in AUTO_KNOBS if getattr(getattr(config, section), key) == "auto")


def fill_auto_knobs_from(config: RunConfig, result: PlanResult) -> tuple[RunConfig, list[str]]:
    """A copy of the config with every "auto" knob set to the plan's choice, and a note saying so.

    ``result`` is the plan of this config (``ResolvedRun.plan``), made once the precision is known.

    Raises:
        ZeroPipeError: when no combination fits the hardware (the plan's reason).
    """
    wanted = auto_knobs(config)
    if not wanted:
        return config, []
    best = result.require_best()
    fragment = result.fragment()
    resolved = config.model_copy(deep=True)
    chosen = []
    for section, key in wanted:
        value = fragment[section][key]
        setattr(getattr(resolved, section), key, value)
        chosen.append(f"{section}.{key} = {value}")
    return resolved, [f"auto: {', '.join(chosen)} (the plan's fastest fit: {best.choice.describe()} on {result.hardware.describe()}; see zeropipe plan)"]
