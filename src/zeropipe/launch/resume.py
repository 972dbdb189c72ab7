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
"""

from __future__ import annotations

from typing import Any

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
    plan = run.read_json(run.plan_file) or {}
    return plan.get("total_steps")
