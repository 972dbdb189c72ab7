"""The memory planner: what a run needs per GPU and per node, and the fastest settings that fit.

``plan_run`` is what the rest of zeropipe calls (``check`` and ``train`` with ``auto`` knobs);
``recommend`` searches for a bare model. The arithmetic lives in ``memory`` (pure functions),
the model's counts in ``model_spec`` (built on the meta device), the speeds in ``cost``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zeropipe.doctor.facts import cpu_precision
from zeropipe.plan.hardware import Hardware, detect_hardware, parse_hardware
from zeropipe.plan.memory import Choice, Term
from zeropipe.plan.search import Candidate, PlanResult, evaluate, recommend

if TYPE_CHECKING:
    from zeropipe.config.schema import RunConfig
    from zeropipe.plan.model_spec import ModelSpec

AUTO = "auto"


def knobs_from_config(run_config: RunConfig) -> dict[str, Any]:
    """The run config's settings by Choice field name; a value of "auto" is left for the planner."""
    ds, model, train = run_config.deepspeed, run_config.model, run_config.train
    raw = {
        "zero_stage": ds.zero_stage,
        "offload_optimizer": ds.offload_optimizer,
        "offload_param": ds.offload_param,
        "precision": ds.precision,
        "gradient_checkpointing": model.gradient_checkpointing,
        "micro_batch_size": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
    }
    knobs: dict[str, Any] = {}
    for name, value in raw.items():
        if value == AUTO:
            knobs[name] = AUTO
        elif name in ("offload_optimizer", "offload_param"):
            knobs[name] = value == "cpu"
        else:
            knobs[name] = value
    return knobs


def zero3_limits(run_config: RunConfig, user_ds_config: dict | None = None) -> dict[str, int]:
    """DeepSpeed's stage3_max_live_parameters and stage3_max_reuse_distance for this run, as Choice fields.

    From deepspeed.overrides, else the user's DeepSpeed JSON, else DeepSpeed's defaults
    (zeropipe's generated JSON leaves them to DeepSpeed).
    """
    from zeropipe.plan.memory import DEFAULT_STAGE3_MAX_LIVE_PARAMETERS, DEFAULT_STAGE3_REUSE_DISTANCE

    # The user's JSON as the resolved run read it (ResolvedRun.plan passes it): never read here.
    sources = [run_config.deepspeed.overrides]
    if user_ds_config is not None:
        sources.append(user_ds_config)
    limits = {"zero3_max_live_parameters": DEFAULT_STAGE3_MAX_LIVE_PARAMETERS, "zero3_reuse_distance": DEFAULT_STAGE3_REUSE_DISTANCE}
    for field, key in (("zero3_max_live_parameters", "stage3_max_live_parameters"), ("zero3_reuse_distance", "stage3_max_reuse_distance")):
        for source in sources:
            zero = source.get("zero_optimization") if isinstance(source, dict) else None
            value = zero.get(key) if isinstance(zero, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                limits[field] = int(value)
                break
    return limits


def plan_run(run_config: RunConfig, hardware: Hardware, spec: ModelSpec, margin: float = 0.1, user_ds_config: dict | None = None) -> PlanResult:
    """Plan a run config on this hardware.

    With every knob set, ``configured`` is the config's own choice evaluated (does it fit, and
    how close) and ``best`` the recommendation over all knobs. With knobs set to "auto",
    ``configured`` is None and ``best`` is the fastest fit with the other knobs held as set:
    what ``train`` uses to fill them in (``PlanResult.fragment()``).

    Args:
        spec: the configured model, counted by its family (``zeropipe.families.model_spec``).
        user_ds_config: deepspeed.config_file's content as the resolved run read it (``ResolvedRun.plan`` passes it).

    Raises:
        ZeroPipeError: when the batch does not divide over the ranks.
    """
    if isinstance(run_config.hardware.gpus, int):
        hardware = hardware.with_gpus(run_config.hardware.gpus)
    knobs = knobs_from_config(run_config)
    fixed = {name: value for name, value in knobs.items() if value != AUTO}
    all_set = len(fixed) == len(knobs)
    # parallel.sequence_parallel_size as set: held, and the batch dealt over world / N data-parallel ranks.
    sp = run_config.parallel.sequence_parallel_size
    held_sp = {"sequence_parallel": sp} if sp > 1 and hardware.world_size % sp == 0 else {}
    fixed.update(held_sp)
    seq_len = run_config.data.max_seq_len
    attention = run_config.model.attn_implementation
    micro, accumulation = fixed.get("micro_batch_size"), fixed.get("gradient_accumulation_steps")
    global_batch = micro * accumulation * (hardware.world_size // (sp if held_sp else 1)) if micro is not None and accumulation is not None else None
    notes = []
    # parallel.tiled_loss and its tile travel with the ZeRO-3 limits: Choice fields every candidate carries.
    limits = {**zero3_limits(run_config, user_ds_config), "tiled_loss": run_config.parallel.tiled_loss, "loss_tile_tokens": run_config.parallel.loss_tile_tokens}
    if run_config.deepspeed.config_file:
        notes.append(f"deepspeed.config_file is set: the plan follows the deepspeed.* fields, not {run_config.deepspeed.config_file}")
    if all_set:
        # train.activation_offload as the config sets it (it offloads only what checkpointing keeps).
        held = {**fixed, "activation_offload": run_config.train.activation_offload and fixed.get("gradient_checkpointing") is True}
        held.pop("sequence_parallel", None)
        configured = evaluate(spec, hardware, Choice(**held, seq_len=seq_len, attention=attention, sequence_parallel=sp, **limits), margin)
        result = recommend(spec, hardware, global_batch=global_batch, seq_len=seq_len, margin=margin, fixed=held_sp or None, attention=attention, zero3_limits=limits)
        result.configured = configured
        result.notes += notes + _configured_on_cpu_ranks(configured.choice, hardware)
        result.notes += fp8_base_offer(spec, hardware, result, lambda other: recommend(other, hardware, global_batch=global_batch, seq_len=seq_len, margin=margin, fixed=held_sp or None, attention=attention, zero3_limits=limits))
        return result
    result = recommend(
        spec, hardware, global_batch=global_batch, seq_len=seq_len, margin=margin, fixed=fixed, attention=attention, zero3_limits=limits
    )
    result.notes += notes + ["planned for the knobs set to auto: " + ", ".join(k for k, v in knobs.items() if v == AUTO)]
    result.notes += fp8_base_offer(spec, hardware, result, lambda other: recommend(
        other, hardware, global_batch=global_batch, seq_len=seq_len, margin=margin, fixed=fixed, attention=attention, zero3_limits=limits
    ))
    return result


def fp8_base_offer(spec: ModelSpec, hardware: Hardware, result: PlanResult, replan) -> list[str]:
    """For a LoRA run on a 16-bit base: the same run with model.quantization: fp8, when it makes the run fit or saves much memory."""
    if spec.lora is None or spec.fp8_base is not None or spec.quantized is not None or spec.block_linear_params == 0:
        return []
    fp8 = replan(spec.with_fp8_base())
    if fp8.best is None:
        return []
    saved = spec.block_linear_params  # one byte instead of two (bf16) per block-linear weight, before ZeRO-3's share
    plain = result.configured if result.configured is not None else result.best
    if plain is None or not plain.fits:
        return [
            f"model.quantization: fp8 makes this run fit: the frozen base's block linears ({spec.block_linear_params / 1e9:.2f}B weights) stored in 8 bits, "
            f"about {saved / 2**30:.1f} GiB less over the ranks than in bf16; then {fp8.best.choice.describe()}: "
            f"{fp8.best.per_gpu_bytes / 2**30:.1f} GiB per GPU, {fp8.best.per_node_bytes / 2**30:.1f} GiB host RAM"
        ]
    if fp8.best.per_gpu_bytes < plain.per_gpu_bytes * 0.8 or fp8.best.per_node_bytes < plain.per_node_bytes * 0.8:
        return [
            f"model.quantization: fp8 would store the frozen base's block linears in 8 bits: {fp8.best.choice.describe()} needs "
            f"{fp8.best.per_gpu_bytes / 2**30:.1f} GiB per GPU and {fp8.best.per_node_bytes / 2**30:.1f} GiB host RAM "
            f"(this plan: {plain.per_gpu_bytes / 2**30:.1f} and {plain.per_node_bytes / 2**30:.1f})"
        ]
    return []


def _configured_on_cpu_ranks(choice: Choice, hardware: Hardware) -> list[str]:
    """Why the recommendation on CPU ranks can differ from the config's own bf16 or offload."""
    if hardware.accelerator != "cpu":
        return []
    notes = []
    if choice.precision == "bf16" and not hardware.cpu_bf16_native:
        notes.append(f"your precision bf16: {cpu_precision(False)[1]}; set deepspeed.precision: auto (fp32 here)")
    if choice.offload_optimizer or choice.offload_param:
        notes.append(
            "your offload saves nothing on CPU ranks: their 'GPU' memory is host RAM already, so it moves bytes from "
            "host RAM to host RAM and adds copies; set deepspeed.offload_optimizer and offload_param: none"
        )
    return notes


__all__ = [
    "Candidate",
    "Choice",
    "Hardware",
    "PlanResult",
    "Term",
    "detect_hardware",
    "evaluate",
    "knobs_from_config",
    "parse_hardware",
    "plan_run",
    "recommend",
    "zero3_limits",
]
