"""One resolved run: everything a command decides about a config before it checks, plans or starts it.

The accelerator and the number of ranks, the explicit choices of a user's DeepSpeed JSON
(batch shape, ZeRO stage, offload, precision) written into the typed config, the precision
``auto`` picks for this hardware, and the planner's values for the knobs left ``auto``. The
result is one :class:`ResolvedRun`; ``check`` judges its config, ``prepare_run`` writes it as
config.yaml and builds ds_config.json from it, so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from zeropipe.config.deepspeed import fold_user_config, read_user_config
from zeropipe.config.schema import RunConfig
from zeropipe.confine import Confinement, ConfinementError
from zeropipe.doctor.facts import cpu_precision
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.families import model_spec
from zeropipe.launch.auto import auto_knobs, fill_auto_knobs_from
from zeropipe.launch.nodes import NodeLayout, resolve_layout
from zeropipe.plan import PlanResult, plan_run
from zeropipe.plan.hardware import Hardware, detect_hardware, supports_bf16


@dataclass(frozen=True)
class ResolvedRun:
    """A run as one command decided it: frozen, carried to everything downstream, never edited after resolving.

    A later step that decides more (the planner's auto knobs, a curriculum's shared tokenizer) makes a new one
    (``dataclasses.replace``), so no reader sees a run change under it.
    """

    config: RunConfig  # no "auto" precision; the DeepSpeed JSON's explicit choices folded in; auto knobs filled when asked
    accelerator: str  # "cuda" or "cpu"
    world_size: int
    notes: list[str] = field(default_factory=list)  # what was decided, and from what
    conflicts: list[tuple[str, str]] = field(default_factory=list)  # YAML values the DeepSpeed JSON overrides
    nodes: NodeLayout | None = None  # several machines (hardware.nodes, a hostfile, a SLURM allocation); None: this one
    # The knobs the user set to a value (in the YAML or the DeepSpeed JSON), by the plan's Choice
    # field names: a suggested fix keeps them, or says why one must change.
    user_set: dict[str, object] = field(default_factory=dict)
    # The machine the run is decided for, detected once (or injected: the UI and tests plan for
    # other machines). Everything downstream that depends on the hardware reads it from here.
    hardware: Hardware | None = None
    # (precision, why): what the device computes in natively, what precision "auto" picks on it;
    # saved in run.json for the node's setup process (the dtype it loads frozen encoders in).
    native_precision: tuple[str, str] = ("fp32", "not decided")
    # deepspeed.config_file as read once, when the run was resolved (None without one): the
    # checks, the plan and the DeepSpeed JSON written for the ranks take it from here.
    user_ds_config: dict[str, Any] | None = None
    # The folders a run submitted through the UI may read and write (None: a command-line run,
    # unconfined). Applied here, to the config and its DeepSpeed JSON, before anything reads a
    # path; saved in run.json, where every later reader of the run's data finds it.
    confinement: Confinement | None = None
    # (config, hardware, their plan): a cache of plan(), not a decision; a replace() starts without it.
    _plan: tuple[Any, Any, PlanResult] | None = field(default=None, init=False, repr=False, compare=False)

    def plan(self, spec: Any = None, margin: float = 0.1) -> PlanResult:
        """The memory plan of this run's config on its hardware: how every command plans a config.

        Made once per config (and hardware) for the run's own model and the default margin;
        ``spec`` and ``margin`` plan another model or margin on the same resolved run.

        Raises:
            ZeroPipeError: the planner's refusal (a batch that does not divide over the ranks...).
        """
        if spec is not None or margin != 0.1:
            return plan_run(self.config, self.hardware, spec or model_spec(self.config), margin, self.user_ds_config)
        if self._plan is None or self._plan[0] is not self.config or self._plan[1] is not self.hardware:
            result = plan_run(self.config, self.hardware, model_spec(self.config), user_ds_config=self.user_ds_config)
            object.__setattr__(self, "_plan", (self.config, self.hardware, result))  # the cache of a frozen record
        return self._plan[2]


class UnresolvedRunError(ConfigError):
    """The config's problems found after the user's DeepSpeed JSON was read: ``check`` reports them and judges the JSON as read."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None, user_ds_config: dict[str, Any] | None):
        super().__init__(problems, source)
        self.user_ds_config = user_ds_config


# The knobs a memory fix may change, by (section, field) and the plan's Choice field name.
USER_KNOBS = {
    ("deepspeed", "zero_stage"): "zero_stage",
    ("deepspeed", "offload_optimizer"): "offload_optimizer",
    ("deepspeed", "offload_param"): "offload_param",
    ("deepspeed", "precision"): "precision",
    ("model", "gradient_checkpointing"): "gradient_checkpointing",
}


def user_set_knobs(config: RunConfig) -> dict[str, object]:
    """The memory knobs this config sets to a value of its own: written in it (or its DeepSpeed JSON) and not "auto"."""
    chosen: dict[str, object] = {}
    for (section, name), knob in USER_KNOBS.items():
        part = getattr(config, section)
        value = getattr(part, name)
        if name in part.model_fields_set and value != "auto":
            chosen[knob] = value == "cpu" if knob.startswith("offload") else value
    return chosen


def detect_accelerator(config: RunConfig) -> tuple[str, int]:
    """(accelerator, number of ranks) for this machine and config.

    Raises:
        ConfigError: CUDA asked for but absent, more GPUs than visible, or fewer than one rank.
    """
    import torch

    wanted = config.hardware.accelerator
    has_cuda = torch.cuda.is_available()
    if wanted == "cuda" and not has_cuda:
        raise ConfigError([("hardware.accelerator", "cuda was asked for but torch sees no CUDA device: set hardware.accelerator: auto or cpu")])
    accelerator = "cuda" if (wanted == "cuda" or (wanted == "auto" and has_cuda)) else "cpu"
    gpus = config.hardware.gpus
    if gpus != "auto" and gpus < 1:
        raise ConfigError([("hardware.gpus", f"must be at least 1 (you set {gpus}): the number of ranks to start, one per GPU, or auto")])
    if gpus == "auto":
        gpus = torch.cuda.device_count() if accelerator == "cuda" else 2
    elif accelerator == "cuda" and gpus > torch.cuda.device_count():
        raise ConfigError([("hardware.gpus", f"{gpus} ranks asked for but only {torch.cuda.device_count()} GPUs are visible: lower hardware.gpus")])
    return accelerator, int(gpus)


def auto_precision(accelerator: str, hardware: Hardware) -> tuple[str, str]:
    """(precision, why) for deepspeed.precision: auto on this hardware (on CPU ranks, the hardware object's CPU fact)."""
    if accelerator == "cuda":
        # The hardware object's GPU facts (compute capability, read once by detect_hardware).
        if hardware.accelerator != "cuda":
            return "bf16", "GPUs of Ampere or newer assumed (no GPU visible here to ask)"
        if supports_bf16(hardware):
            return "bf16", "the GPUs support bf16"
        return "fp16", f"{hardware.gpu_name or 'these GPUs'} has no bf16 (compute capability below 8.0)"
    return cpu_precision(hardware.cpu_bf16_native)


def ranks_on_gpus(hardware: Hardware, world_size: int, layout: NodeLayout | None) -> Hardware:
    """The machine as the run uses it: as many GPUs per node as ranks start there, not as many as are visible.

    The auto knobs, the checks and the plan then count the ranks' memory and communication
    (2 ranks on a 4-GPU box are planned on 2 GPUs; several nodes as the layout says).
    """
    if layout is None and hardware.nodes > 1:
        return hardware  # several nodes described by the caller (zeropipe plan --nodes): planned as given
    per_node, nodes = (layout.nodes[0].ranks, len(layout.nodes)) if layout is not None else (world_size, 1)
    if (per_node, nodes) == (hardware.gpus_per_node, hardware.nodes):
        return hardware
    note = f"planned for the run's {per_node} rank(s) per node{f' on {nodes} nodes' if nodes > 1 else ''}, one GPU each ({hardware.gpus_per_node} visible)"
    return replace(hardware.with_gpus(per_node), nodes=nodes, notes=hardware.notes + (note,))


def confine(config: RunConfig, confinement: Confinement | None, user_ds_config: dict[str, Any] | None = None) -> None:
    """Refuse a confined run's paths outside its roots (the DeepSpeed JSON's contents included) and, unless trusted, other machines.

    Raises:
        ConfinementError: every problem, each naming its key (``deepspeed.config_file:csv_monitor.output_path``).
    """
    if confinement is None:
        return
    problems = confinement.run_problems(config.model_dump(mode="json"), user_ds_config)
    if confinement.multinode:  # trusted to name machines, never files: no ssh option naming a path (issue 46)
        from zeropipe.launch.nodes import hardware_problems

        problems += [p for p in hardware_problems({"ssh_options": config.hardware.ssh_options}, confined=True) if p not in problems]
    if problems:
        raise ConfinementError(problems)


def resolve_run(
    config: RunConfig,
    world_size: int | None = None,
    accelerator: str | None = None,
    fill_auto_knobs: bool = True,
    hardware: Hardware | None = None,
    confinement: Confinement | None = None,
) -> ResolvedRun:
    """Resolve a config for this machine.

    Args:
        world_size, accelerator: override what is detected (the UI and tests plan for other machines).
        fill_auto_knobs: ask the planner for the knobs left "auto" (train does; check and plan judge them as "auto").
        hardware: the machine to decide for; detected here (once) when not given. On CPU ranks its
            ``cpu_bf16_native`` decides precision "auto"; tests inject it to decide as on another CPU.
        confinement: the roots of a run submitted through the UI: every path of the config (a
            hostfile, the DeepSpeed JSON) is checked before it is read, and the JSON's own paths after.

    Raises:
        ConfigError: with the key and the fix; ZeroPipeError when no choice of the auto knobs fits.
        ConfinementError: a confined run's path outside its roots, or a field choosing other machines.
    """
    confine(config, confinement)  # before the hostfile or the DeepSpeed JSON is read
    detected_accelerator, detected_ranks = detect_accelerator(config)
    accelerator = accelerator or detected_accelerator
    if hardware is not None and accelerator == "cuda" and hardware.accelerator == "cuda" and config.hardware.gpus == "auto":
        # hardware.gpus: auto is one rank per GPU of the machine decided for, which may not be this one.
        detected_ranks = hardware.gpus_per_node
    layout = resolve_layout(config.hardware, detected_ranks)
    notes = []
    if layout is not None:
        notes += layout.notes
        if len(layout.nodes) == 1 and layout.launcher == "slurm":
            # A one-node allocation: the ranks run here, as without SLURM.
            detected_ranks, layout = layout.nodes[0].ranks, None
        else:
            detected_ranks = layout.world_size
            notes.append(f"{len(layout.nodes)} nodes from {layout.source}: {', '.join(f'{n.host} ({n.ranks} ranks)' for n in layout.nodes)}; world size {layout.world_size}")
    ranks_from_config = world_size is None
    world_size = world_size or detected_ranks
    if hardware is None:
        hardware = detect_hardware(cpu_ranks=world_size)
        if ranks_from_config and accelerator == "cuda" and hardware.accelerator == "cuda" and (layout is None or layout.launcher == "slurm"):
            # This machine runs the ranks (of the first node, for SLURM): one GPU each.
            ranks_here = layout.nodes[0].ranks if layout is not None else world_size
            if ranks_here > hardware.gpus_per_node:
                raise ConfigError(
                    [
                        (
                            "hardware.gpus",
                            f"{ranks_here} ranks would start on this machine, which has {hardware.gpus_per_node} GPUs (one rank per GPU): "
                            f"each extra rank would fail to find its device. Set hardware.gpus: {hardware.gpus_per_node} (or auto), "
                            "or ask the allocation for as many tasks per node as GPUs",
                        )
                    ]
                )
    if accelerator == "cuda" and hardware.accelerator == "cuda":
        hardware = ranks_on_gpus(hardware, world_size, layout)
    native_precision = auto_precision(accelerator, hardware)
    user_json = read_user_config(Path(config.deepspeed.config_file)) if config.deepspeed.config_file else None
    confine(config, confinement, user_json)  # what the JSON writes to: csv_monitor, tensorboard, nvme_path...
    try:
        config, fold_notes, conflicts = fold_user_config(config, world_size, user_json)
    except ConfigError as err:
        raise UnresolvedRunError(err.problems, err.source, user_json) from None
    notes += fold_notes
    user_set = user_set_knobs(config)
    if config.deepspeed.precision == "auto":
        precision, why = native_precision
        config = config.model_copy(deep=True)
        config.deepspeed.precision = precision
        notes.append(f"deepspeed.precision = {precision} ({why})")
    resolved = ResolvedRun(config, accelerator, world_size, notes, conflicts, layout, user_set, hardware, native_precision, user_json, confinement)
    if fill_auto_knobs and auto_knobs(config):
        filled, auto_notes = fill_auto_knobs_from(config, resolved.plan())
        resolved = replace(resolved, config=filled, notes=notes + auto_notes)
    return resolved


def resolve_stages(
    config: RunConfig,
    world_size: int | None = None,
    accelerator: str | None = None,
    hardware: Hardware | None = None,
    confinement: Confinement | None = None,
) -> list[ResolvedRun | ZeroPipeError]:
    """A curriculum's stages, each resolved once as the run it will be (its own ZeRO stage, LoRA, batch, auto knobs).

    The machine is detected once for all of them. A stage that cannot be resolved (no
    combination of its auto knobs fits) is its error, in its place: ``zeropipe check`` reports it
    as that stage's finding, ``train`` refuses the curriculum with it.
    """
    from zeropipe.config.stages import stage_configs

    stages: list[ResolvedRun | ZeroPipeError] = []
    for stage in stage_configs(config):
        try:
            resolved = resolve_run(stage, world_size, accelerator, hardware=hardware, confinement=confinement)
        except ConfinementError:
            raise  # not one stage's finding: the whole curriculum is refused
        except ZeroPipeError as err:
            stages.append(err)
            continue
        hardware = resolved.hardware
        stages.append(resolved)
    return stages
