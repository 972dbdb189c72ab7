"""What a resumed run needs so that it continues exactly where the original run was.

The model, optimizer moments, scheduler position, data position and RNG are saved with every
checkpoint; two things are not state and still change a resumed run:

- DeepSpeed's CPU Adam kernels (the ``FusedAdam`` of the CPU accelerator and ``DeepSpeedCPUAdam``
  of optimizer offload) keep beta1^t and beta2^t in float32 inside the process and multiply
  them by the betas at every step; a fresh process recomputes them with ``pow(beta, t)``.
  The two differ in the last bit, so the first update after a resume differs slightly
  (whether it does depends on t: resuming from step 10 happened to match, from 20 and 30
  it did not) and the runs drift apart. torch's AdamW recomputes the bias correction
  from the saved step every time, so it resumes bit-exactly; on CPU ranks, where speed is
  not the point, ZeRO-Pipe asks DeepSpeed for it (``torch_adam``). CUDA's FusedAdam also
  recomputes it every step and is kept.
- The length of the run: DeepSpeed's schedulers take it from the JSON, so a resume with
  another ``train.max_steps`` silently bends the learning-rate schedule.

A resume on another number of ranks keeps the global batch (the accumulation is recomputed),
continues the data from the checkpoint's position counted for all ranks together, and reads
the checkpoint through its universal copy (``checkpoint/universal.py``).
"""

from __future__ import annotations

from typing import Any

from zeropipe.data.sampler import DataPosition
from zeropipe.errors import ZeroPipeError
from zeropipe.rundir import RunDir

ADAM_TYPES = {"adam", "adamw"}


def prefer_exact_adam(ds_config: dict[str, Any], accelerator: str) -> list[str]:
    """On CPU ranks, have DeepSpeed build torch's AdamW (resumes exactly); a note when it was changed.

    The user's explicit ``torch_adam`` is kept, and optimizer offload keeps DeepSpeedCPUAdam
    (torch's AdamW would be several times slower there).
    """
    optimizer = ds_config.get("optimizer")
    if accelerator != "cpu" or not isinstance(optimizer, dict) or str(optimizer.get("type", "")).lower() not in ADAM_TYPES:
        return []
    params = optimizer.setdefault("params", {})
    offload = (ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if "torch_adam" in params or offload.get("device", "none") not in (None, "none"):
        return []
    params["torch_adam"] = True
    return ["optimizer.params.torch_adam = true (CPU ranks: torch's AdamW resumes bit-exactly, DeepSpeed's CPU Adam does not)"]


def check_resume_schedule(saved_total_steps: int | None, total_steps: int, tag: str, new_schedule: bool) -> list[str]:
    """Refuse a resume whose run length would change the learning-rate schedule, unless asked for.

    Args:
        saved_total_steps: the run length the checkpoint was saved under (None for checkpoints
            written before ZeRO-Pipe recorded it: nothing to compare).
        new_schedule: the user passed ``--new-schedule``.

    Raises:
        ZeroPipeError: the lengths differ and ``new_schedule`` is false.
    """
    if saved_total_steps is None or saved_total_steps == total_steps:
        return []
    change = (
        f"checkpoint {tag} belongs to a run of {saved_total_steps} steps and this resume would run {total_steps}: "
        f"the learning-rate schedule (warm-up, decay and its end) is computed from the run length, "
        f"so the rate would change from the first resumed step on"
    )
    if not new_schedule:
        raise ZeroPipeError(
            f"{change}. Resume with train.max_steps={saved_total_steps} to keep the original schedule, "
            "or add --new-schedule to recompute it for the new length"
        )
    return [f"{change} (--new-schedule: recomputed for {total_steps} steps)"]


def previous_total_steps(run: RunDir) -> int | None:
    """The run length of the run's last attempt (for checkpoints that do not record their own)."""
    plan = run.read_plan_fields()
    return plan.get("total_steps")


def saved_batch_shape(saved: dict[str, Any], previous_plan: dict[str, Any]) -> tuple[int, int, int] | None:
    """(micro-batch, accumulation, ranks) a checkpoint was trained with: from its marker, else from the run's last plan."""
    values = []
    for key in ("micro_batch_size", "gradient_accumulation_steps", "world_size"):
        value = saved.get(key, previous_plan.get(key))
        if not isinstance(value, int) or value < 1:
            return None
        values.append(value)
    return values[0], values[1], values[2]


def keep_global_batch(saved_shape: tuple[int, int, int] | None, micro_batch_size: int, accumulation: int, world_size: int, tag: str) -> tuple[int, list[str]]:
    """The accumulation that keeps the checkpoint's global batch on ``world_size`` ranks with ``micro_batch_size``.

    The global batch (micro-batch x accumulation x ranks) is what the optimizer, the learning
    rate and the data position are counted in; a resume keeps it whatever the rank count.

    Returns:
        (accumulation, notes: said when it differs from the config's).

    Raises:
        ZeroPipeError: the global batch does not divide over ``micro_batch_size`` x ``world_size``,
            naming the rank counts and micro-batch sizes that would keep it.
    """
    if saved_shape is None:
        return accumulation, []
    saved_micro, saved_accumulation, saved_world = saved_shape
    global_batch = saved_micro * saved_accumulation * saved_world
    per_micro_step = micro_batch_size * world_size
    if global_batch % per_micro_step:
        ranks_that_fit = [ranks for ranks in range(1, global_batch // micro_batch_size + 1) if global_batch % (micro_batch_size * ranks) == 0]
        micros_that_fit = [micro for micro in range(micro_batch_size, 0, -1) if global_batch % (micro * world_size) == 0][:3]
        fixes = []
        if ranks_that_fit:
            fixes.append(f"resume with hardware.gpus set to one of {', '.join(map(str, ranks_that_fit))} (they keep it with micro-batch {micro_batch_size})")
        if micros_that_fit:
            fixes.append(f"keep {world_size} ranks with train.micro_batch_size={micros_that_fit[0]}" + (f" (or {', '.join(map(str, micros_that_fit[1:]))})" if micros_that_fit[1:] else ""))
        if not fixes:
            fixes.append(f"no micro-batch keeps it on {world_size} ranks: choose a rank count that divides {global_batch}")
        raise ZeroPipeError(
            f"checkpoint {tag} was trained with a global batch of {global_batch} "
            f"(micro-batch {saved_micro} x accumulation {saved_accumulation} x {saved_world} ranks), and a resume keeps it: "
            f"on {world_size} ranks with micro-batch {micro_batch_size} it would need accumulation {global_batch}/{per_micro_step}, not a whole number. "
            + "; or ".join(fixes)
        )
    kept = global_batch // per_micro_step
    if kept == accumulation:
        return kept, []
    note = (
        f"train.gradient_accumulation_steps = {kept} (keeps checkpoint {tag}'s global batch of {global_batch}: "
        f"micro-batch {micro_batch_size} x {kept} x {world_size} ranks; it was trained as {saved_micro} x {saved_accumulation} x {saved_world})"
    )
    return kept, [note]


def saved_data_position(saved: dict[str, Any], previous_plan: dict[str, Any], step: int, saved_shape: tuple[int, int, int] | None) -> DataPosition | None:
    """Where the checkpoint's run stood in its data, for all ranks together.

    Checkpoints record it (``data_position``); for older ones it is counted from the step,
    exact as long as that run never changed its batch shape.
    """
    if isinstance(saved.get("data_position"), dict):
        return DataPosition.from_dict(saved["data_position"])
    per_epoch = previous_plan.get("micro_batches_per_epoch")
    if saved_shape is None or not isinstance(per_epoch, int) or per_epoch < 1:
        return None
    micro, accumulation, world_size = saved_shape
    return DataPosition.at_micro_step(step * accumulation, per_epoch, world_size, micro)


def resume_batch_shape(
    family: Any, saved: dict[str, Any], previous_plan: dict[str, Any], micro_batch_size: int, accumulation: int, world_size: int, tag: str
) -> tuple[int, list[str]]:
    """The one rule for resuming a checkpoint on ``world_size`` ranks, for the launcher and the UI alike.

    Args:
        family: the run's model family; None where it is not known here (a plug-in the UI has
            not loaded): then only the global batch is judged, and the launcher judges the rest.
        saved, previous_plan: the checkpoint's completion marker and the run's last run.json.

    Returns:
        (accumulation that keeps the checkpoint's global batch, notes).

    Raises:
        ZeroPipeError: the family resumes only on the rank count that saved it, or the global
            batch does not divide over ``micro_batch_size`` x ``world_size`` (naming what would).
    """
    saved_shape = saved_batch_shape(saved, previous_plan)
    saved_world = saved.get("world_size") or (saved_shape[2] if saved_shape else world_size)
    if family is not None and saved_world != world_size and not getattr(family, "resumes_on_other_rank_counts", False):
        raise ZeroPipeError(
            f"checkpoint {tag} was saved by {saved_world} ranks and {family.name} runs resume only on the rank count that saved them "
            f"(their data order is dealt per rank): resume with hardware.gpus={saved_world}"
        )
    return keep_global_batch(saved_shape, micro_batch_size, accumulation, world_size, tag)
