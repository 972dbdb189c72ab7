"""Build what the rules look at from a run config, and run them."""

from __future__ import annotations

import logging

from zeropipe.check import multinode as _multinode_rules  # noqa: F401 - registers the multi-node rules
from zeropipe.check.rules import CheckContext, Finding, run_rules
from zeropipe.config.deepspeed import build_deepspeed_config
from zeropipe.config.schema import RunConfig
from zeropipe.config.stages import stage_key
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.families import family_of
from zeropipe.launch.resolve import ResolvedRun, UnresolvedRunError, detect_accelerator, resolve_run, resolve_stages, user_set_knobs
from zeropipe.plan.hardware import Hardware, detect_hardware


class CheckFailed(ZeroPipeError):
    """The config breaks at least one error rule; the message lists every finding."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        errors = [f for f in findings if f.severity == "error"]
        lines = [f"{len(errors)} problem(s) that would make this run fail; nothing was started:"]
        lines += ["  " + f.render().replace("\n", "\n  ") for f in errors]
        super().__init__("\n".join(lines))


def build_context(
    config: RunConfig | ResolvedRun,
    world_size: int | None = None,
    accelerator: str | None = None,
    node_reports: list[dict] | None = None,
    hardware: Hardware | None = None,
) -> CheckContext:
    """What the rules look at: the resolved config (resolved here unless it is), its DeepSpeed JSON and its plan.

    Args:
        node_reports: what each node's agent said when probed (zeropipe check probes; train learns it at launch).
        hardware: the machine to check for (detected once when not given; a resolved run carries its own).
    """
    problems: list[tuple[str, str]] = []
    if isinstance(config, ResolvedRun):
        resolved = config
    else:
        try:
            resolved = resolve_run(config, world_size, accelerator, fill_auto_knobs=False, hardware=hardware)
        except ConfigError as err:  # e.g. a train_batch_size that does not divide over the ranks (ZP008)
            problems += err.problems
            detected = detect_accelerator(config)
            world_size = world_size or detected[1]
            hardware = hardware or detect_hardware(cpu_ranks=world_size)
            # The user's JSON as the failed resolve read it; read here only when the resolve stopped before it.
            user_ds = err.user_ds_config if isinstance(err, UnresolvedRunError) else unread_user_json(config, problems)
            resolved = ResolvedRun(config, accelerator or detected[0], world_size, user_set=user_set_knobs(config), hardware=hardware, user_ds_config=user_ds)
    config, accelerator, world_size = resolved.config, resolved.accelerator, resolved.world_size
    hardware = resolved.hardware
    hidden = None
    family_problems: list[tuple[str, str]] = []
    try:
        family = family_of(config.model)
        family_problems = family.config_problems(config)
        hidden = family.hidden_size(config)
    except ConfigError as err:
        family_problems += err.problems
    user_ds = resolved.user_ds_config
    try:
        if config.deepspeed.config_file and user_ds is None:
            raise ConfigError([])  # unreadable: its problem was reported where it was read
        ds_config = build_deepspeed_config(config, world_size, total_steps=1000, hidden_size=hidden, user_json=user_ds).config
    except ConfigError as err:
        problems += err.problems
        ds_config = user_ds or {}
    context = CheckContext(
        config, accelerator, world_size, ds_config, user_ds, problems=problems, family_problems=family_problems, conflicts=resolved.conflicts,
        nodes=resolved.nodes, node_reports=node_reports, user_set=resolved.user_set, hardware=hardware,
    )
    context.plan, refused = plan_and_problems(resolved)
    # What building the model's description refused (LoRA targets that match no linear layer of a vision-language part...) is what the
    # ranks refuse before the first step: said here (ZP000), once, unless a rule already said it.
    said = set(context.problems) | set(context.family_problems)
    context.family_problems += [problem for problem in refused if problem not in said]
    return context


def plan_and_problems(resolved: ResolvedRun):
    """(the memory plan or None, the config problems that stopped it)."""
    try:
        return resolved.plan(), []
    except ConfigError as err:
        return None, list(err.problems)
    except ZeroPipeError:
        return None, []
    except Exception:  # noqa: BLE001 - plan_for says it once
        return plan_for(resolved), []


def unread_user_json(config: RunConfig, problems: list[tuple[str, str]]) -> dict | None:
    """deepspeed.config_file's content for a check whose resolve stopped before reading it (None: none, or unreadable: its problem added)."""
    from pathlib import Path

    from zeropipe.config.deepspeed import read_user_config

    if not config.deepspeed.config_file:
        return None
    try:
        return read_user_config(Path(config.deepspeed.config_file))
    except ConfigError as err:
        problems += err.problems
        return None


def plan_for(resolved: ResolvedRun):
    """The memory plan of the config's own choice (the resolved run's), or None when it cannot be computed."""

    try:
        return resolved.plan()
    except ZeroPipeError:
        return None  # the config problem is reported by the rules that own it
    except Exception as err:  # noqa: BLE001 - a planner failure must not block the other rules
        # One line for the user; the traceback only for whoever turns on debug logging.
        logging.getLogger("zeropipe").warning("the memory planner failed (%s: %s); plan-based checks skipped", type(err).__name__, err)
        logging.getLogger("zeropipe").debug("memory planner failure", exc_info=True)
        return None


def check_config(
    config: RunConfig | ResolvedRun,
    world_size: int | None = None,
    accelerator: str | None = None,
    node_reports: list[dict] | None = None,
    hardware: Hardware | None = None,
    resolved_stages: list[ResolvedRun | ZeroPipeError] | None = None,
) -> list[Finding]:
    """Every finding for this config (or resolved run), errors first; for a curriculum, every stage's.

    Args:
        resolved_stages: a curriculum's stages as the command resolved them (train resolves them once and
            hands the same to the curriculum runner); resolved here when not given.
    """
    plain = config.config if isinstance(config, ResolvedRun) else config
    if isinstance(config, ResolvedRun):
        hardware = hardware or config.hardware
    if plain.stages:
        findings = check_stages(plain, world_size, accelerator, hardware, resolved_stages)
    else:
        findings = run_rules(build_context(config, world_size, accelerator, node_reports, hardware))
    # run.accept_warnings: a deliberate choice is not warned about again (errors always stand).
    accepted = set(plain.run.accept_warnings)
    findings = [f for f in findings if f.severity == "error" or f.rule not in accepted]
    return sorted(findings, key=lambda f: (f.severity != "error", f.rule))


def check_stages(
    config: RunConfig,
    world_size: int | None = None,
    accelerator: str | None = None,
    hardware: Hardware | None = None,
    resolved_stages: list[ResolvedRun | ZeroPipeError] | None = None,
) -> list[Finding]:
    """A curriculum: each stage checked as the run it will be (its own ZeRO stage, LoRA, batch), keys prefixed stages[N].

    Args:
        resolved_stages: the stages as the command resolved them (:func:`resolve_stages`); resolved here when not given.
    """
    import dataclasses

    if resolved_stages is None:
        resolved_stages = resolve_stages(config, world_size, accelerator, hardware)
    findings = []
    for index, stage in enumerate(resolved_stages):
        if isinstance(stage, ZeroPipeError):
            findings.append(Finding("ZP011", "error", stage_key(index, "deepspeed"), str(stage), "zeropipe plan on this stage's settings shows what fits", "docs/plan.md"))
            continue
        for finding in run_rules(build_context(stage)):
            findings.append(dataclasses.replace(finding, key=stage_key(index, finding.key)))
    return sorted(findings, key=lambda f: (f.severity != "error", f.rule))
