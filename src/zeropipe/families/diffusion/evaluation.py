"""``zeropipe eval`` on a diffusion run: the validation loss of a checkpoint, in this process on CPU, with the ranks' code (validation.py)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.families.diffusion.validation import eval_record, item_losses


@dataclass
class DiffusionEvalResult:
    loss: float
    loss_by_quantile: dict[str, float]
    examples: int
    run: str
    checkpoint: str
    step: int
    data: str
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Host:
    """The trainer's state a :class:`DiffusionTask` reads, for one process on CPU without DeepSpeed."""

    run: Any
    config: Any
    plan: Any
    engine: Any
    step: int
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    micro_batch_size: int = 1
    accumulation: int = 1
    data_position: Any = None


def evaluate_diffusion_checkpoint(run, info, dtype: str | None = None) -> DiffusionEvalResult:
    """The validation loss of a diffusion run's checkpoint, computed in this process on CPU, as the ranks compute it.

    Raises:
        ZeroPipeError: the run kept no held-out items, or ``dtype`` is unknown.
        CheckpointError: the checkpoint does not match the run's denoiser.
    """
    from zeropipe.checkpoint.consolidate import consolidated_state_dict
    from zeropipe.errors import ZeroPipeError
    from zeropipe.families.diffusion.core import PredictContext
    from zeropipe.families.diffusion.export import trained_denoiser
    from zeropipe.families.diffusion.prepare import read_plan
    from zeropipe.families.diffusion.task import DiffusionTask
    from zeropipe.models.common import TORCH_DTYPES

    config = run.read_config()
    if not read_plan(run).eval_items:
        raise ZeroPipeError(
            f"{run.path} has no held-out images: it was trained without data.eval_path or data.eval_fraction. "
            "Train with one of them (e.g. data.eval_fraction: 0.05) to get a validation loss"
        )
    dtype = dtype or (config.deepspeed.precision if config.deepspeed.precision != "auto" else "fp32")
    if dtype not in TORCH_DTYPES:
        raise ZeroPipeError(f"--dtype must be one of {', '.join(TORCH_DTYPES)} (you gave {dtype})")
    with contextlib.redirect_stdout(sys.stderr):  # zero_to_fp32 prints its progress: stdout keeps the result (--json)
        state = consolidated_state_dict(info)
    _, _, _, denoiser = trained_denoiser(run, config, info, state)
    denoiser = denoiser.to(TORCH_DTYPES[dtype]).eval()
    config.deepspeed.precision = dtype  # the task computes in the run's precision: here the one asked for
    host = _Host(run=run, config=config, plan=run.read_plan(), engine=denoiser, step=info.step)
    task = DiffusionTask(host)
    task.setup_data()
    task.predict_context = PredictContext(host.device, task.compute_dtype, task.vae_factor, config.model.diffusion.guidance)
    items = task.data.eval_items
    table = torch.tensor([item_losses(task, index, position) for position, index in enumerate(items)], dtype=torch.float64)
    row = eval_record(info.step, table, 0.0)
    return DiffusionEvalResult(
        loss=row["eval_loss"], loss_by_quantile=row["eval_loss_by_quantile"], examples=row["eval_examples"], run=str(run.path),
        checkpoint=info.tag, step=info.step, data=f"{len(items)} held-out item(s) of {Path(task.data.image_dir).name} or data.eval_path", dtype=dtype,
    )
