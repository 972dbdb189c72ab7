"""Build what the rules look at from a run config, and run them."""

from __future__ import annotations

import logging

from zeropipe.check.rules import CheckContext, Finding, load_user_ds_config, run_rules
from zeropipe.config.deepspeed import build_deepspeed_config
from zeropipe.config.schema import RunConfig
from zeropipe.errors import ConfigError, ZeroPipeError


class CheckFailed(ZeroPipeError):
    """The config breaks at least one error rule; the message lists every finding."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        errors = [f for f in findings if f.severity == "error"]
        lines = [f"{len(errors)} problem(s) that would make this run fail; nothing was started:"]
        lines += ["  " + f.render().replace("\n", "\n  ") for f in errors]
        super().__init__("\n".join(lines))


def build_context(config: RunConfig, world_size: int | None = None, accelerator: str | None = None) -> CheckContext:
    from zeropipe.launch.prepare import detect_accelerator
    from zeropipe.models.causal_lm import hidden_size_of, model_config

    detected_accelerator, detected_ranks = detect_accelerator(config)
    accelerator = accelerator or detected_accelerator
    world_size = world_size or detected_ranks
    problems: list[tuple[str, str]] = []
    hidden = None
    from zeropipe.models.family import model_family

    try:
        if model_family(config.model) != "diffusion":
            hidden = hidden_size_of(model_config(config.model))
    except ConfigError as err:
        problems += err.problems
    user_ds = load_user_ds_config(config)
    try:
        ds_config = build_deepspeed_config(config, world_size, total_steps=1000, hidden_size=hidden).config
    except ConfigError as err:
        problems += err.problems
        ds_config = user_ds or {}
    context = CheckContext(config, accelerator, world_size, ds_config, user_ds, problems=problems)
    context.plan = plan_for(context)
    return context


def plan_for(context: CheckContext):
    """The memory plan of the config's own choice, or None when it cannot be computed."""
    from zeropipe.check.planning import plan_context

    try:
        return plan_context(context)
    except Exception as err:  # noqa: BLE001 - a planner failure must not block the other rules
        # One line for the user; the traceback only for whoever turns on debug logging.
        logging.getLogger("zeropipe").warning("the memory planner failed (%s: %s); plan-based checks skipped", type(err).__name__, err)
        logging.getLogger("zeropipe").debug("memory planner failure", exc_info=True)
        return None


def check_config(config: RunConfig, world_size: int | None = None, accelerator: str | None = None) -> list[Finding]:
    """Every finding for this config, errors first; for a curriculum, every stage's."""
    if config.stages:
        return check_stages(config, world_size, accelerator)
    findings = run_rules(build_context(config, world_size, accelerator))
    return sorted(findings, key=lambda f: (f.severity != "error", f.rule))


def check_stages(config: RunConfig, world_size: int | None = None, accelerator: str | None = None) -> list[Finding]:
    """A curriculum: each stage checked as the run it will be (its own ZeRO stage, LoRA, batch), keys prefixed stages[N]."""
    import dataclasses

    from zeropipe.config.stages import stage_configs, stage_key
    from zeropipe.launch.auto import resolve_auto_knobs

    findings = []
    for index, stage in enumerate(stage_configs(config)):
        try:
            stage, _ = resolve_auto_knobs(stage, world_size)
        except ZeroPipeError as err:
            findings.append(Finding("ZP011", "error", stage_key(index, "deepspeed"), str(err), "zeropipe plan on this stage's settings shows what fits", "docs/plan.md"))
            continue
        for finding in run_rules(build_context(stage, world_size, accelerator)):
            findings.append(dataclasses.replace(finding, key=stage_key(index, finding.key)))
    return sorted(findings, key=lambda f: (f.severity != "error", f.rule))
