"""Write a run's checkpoint as a Hugging Face directory, or a peft adapter.

The checkpoint's shards are consolidated (:mod:`zeropipe.checkpoint.consolidate`), loaded
into the model the run's family builds from its config, and written with
``save_pretrained`` (safetensors) next to the run's tokenizer or processor. LoRA runs export
the adapter alone (loadable by peft) or merged into the base (``merge``). The directory is
written under a temporary name and renamed, so a failed export never leaves a half-written
model where a loader would find it. Which model is built is the family's choice
(``zeropipe.families.export_run``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from zeropipe.checkpoint.consolidate import consolidated_ema_state_dict, consolidated_state_dict, load_checked
from zeropipe.checkpoint.manager import CheckpointInfo, resolve_checkpoint
from zeropipe.config.schema import RunConfig
from zeropipe.errors import ZeroPipeError
from zeropipe.models.common import TORCH_DTYPES
from zeropipe.rundir import RunDir


@dataclass
class ExportJob:
    """One export: which run and checkpoint, where to, how."""

    run: RunDir
    info: CheckpointInfo
    config: RunConfig  # the run's saved config (its data paths are not re-checked)
    out: Path
    merge: bool
    dtype_name: str
    ema: bool = False  # the checkpoint's EMA weights (train.ema) instead of the trained ones


    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype_name]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return consolidated_ema_state_dict(self.info) if self.ema else consolidated_state_dict(self.info)


def export_job(source: str | Path, out: str | Path, merge: bool = False, dtype: str | None = None, force: bool = False, ema: bool = False) -> ExportJob:
    """Resolve what to export.

    Raises:
        CheckpointError: no complete checkpoint. ZeroPipeError: an occupied --out or an unknown --dtype.
    """
    run_path, info = resolve_checkpoint(Path(source))
    run = RunDir(run_path)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise ZeroPipeError(f"{out} already exists and is not empty: choose another --out or pass --force to replace it")
    config = run.read_config()
    # A run's saved precision is resolved; a hand-written config's auto is taken as fp32 (exact on any machine).
    dtype = dtype or (config.deepspeed.precision if config.deepspeed.precision != "auto" else "fp32")
    if dtype not in TORCH_DTYPES:
        raise ZeroPipeError(f"--dtype must be one of {', '.join(TORCH_DTYPES)} (you gave {dtype})")
    return ExportJob(run, info, config, out, merge, dtype, ema)


def write_transformers_export(job: ExportJob, model, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Load the checkpoint into ``model`` (a transformers or peft model) and write it to job.out.

    ``state`` is what to load when the family picks from the checkpoint (a QLoRA run: its
    adapters only, the base being model.path's full-precision weights); the whole
    consolidated checkpoint by default.
    """
    section = job.config.model
    load_checked(model, job.state_dict() if state is None else state, job.info)
    tmp = job.out.with_name(f".{job.out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if section.lora is not None and job.merge:
        model = model.merge_and_unload()
    model = model.to(job.dtype)
    # The config records the dtype loaders cast to ("auto"): it must say what was written.
    target_config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    target_config.dtype = job.dtype
    target_config.use_cache = True
    model.save_pretrained(str(tmp), safe_serialization=True)
    if section.lora is not None and not job.merge and section.path:
        # The adapter points at the base it was trained on, so peft can load it directly.
        adapter_config = tmp / "adapter_config.json"
        data = json.loads(adapter_config.read_text())
        data["base_model_name_or_path"] = str(Path(section.path).resolve())
        adapter_config.write_text(json.dumps(data, indent=2))
    run = job.run
    if run.tokenizer.is_dir():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(run.tokenizer)).save_pretrained(str(tmp))
    if run.processor.is_dir():
        from transformers import AutoProcessor

        # Vision-language runs: the processor (tokenizer + image processor) the run trained with.
        AutoProcessor.from_pretrained(str(run.processor)).save_pretrained(str(tmp))
    (tmp / "zeropipe_export.json").write_text(
        json.dumps({"run": str(run.path.resolve()), "checkpoint": job.info.tag, "step": job.info.step, "merged": job.merge, "dtype": job.dtype_name, "ema": job.ema}, indent=2)
    )
    if job.out.exists():
        shutil.rmtree(job.out)
    tmp.rename(job.out)
    return job.out
