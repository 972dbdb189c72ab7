"""Consolidate a ZeRO checkpoint of any stage into a Hugging Face directory.

The partitioned shards are merged with DeepSpeed's own ``zero_to_fp32`` (stages 1-3; stage 0
checkpoints hold the whole module already), loaded into the model built from the run's
config, and written with ``save_pretrained`` (safetensors) next to the run's tokenizer.
LoRA runs export the adapter alone (loadable by peft) or merged into the base (``merge``).
The directory is written under a temporary name and renamed, so a failed export never
leaves a half-written model where a loader would find it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from zeropipe.checkpoint.manager import CheckpointInfo, resolve_checkpoint
from zeropipe.config.load import load_config
from zeropipe.errors import CheckpointError, ZeroPipeError
from zeropipe.rundir import RunDir

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def consolidated_state_dict(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a checkpoint, gathered from every rank's shards."""
    marker = json.loads((info.path / "zeropipe_complete.json").read_text())
    if marker.get("zero_stage", 0) == 0:
        states = torch.load(info.path / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        return {key: value.float() for key, value in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(info.path.parent), tag=info.tag)


def export_run(source: str | Path, out: str | Path, merge: bool = False, dtype: str | None = None, force: bool = False) -> Path:
    """Write a Hugging Face directory (or a peft adapter) from a run's checkpoint.

    Args:
        source: run directory, or one of its checkpoint directories.
        merge: for LoRA runs, merge the adapter into the base instead of saving it alone.
        dtype: bf16, fp16 or fp32; default: the run's training precision.

    Raises:
        CheckpointError: no complete checkpoint, or it does not match the run's model.
    """
    from transformers import AutoModelForCausalLM

    from zeropipe.models.causal_lm import add_lora, model_config

    run_path, info = resolve_checkpoint(Path(source))
    run = RunDir(run_path)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise ZeroPipeError(f"{out} already exists and is not empty: choose another --out or pass --force to replace it")
    config = load_config(run.config)
    dtype = dtype or config.deepspeed.precision
    if dtype not in DTYPES:
        raise ZeroPipeError(f"--dtype must be one of {', '.join(DTYPES)} (you gave {dtype})")
    state = consolidated_state_dict(info)
    if config.model.family == "diffusion":
        from zeropipe.export.diffusion import export_diffusion

        return export_diffusion(run, config, info, state, out, merge, DTYPES[dtype])

    section = config.model
    if section.family == "vlm":
        from zeropipe.models.vlm import build_vlm_for_export

        # AutoModelForImageTextToText, with adapters only on the parts that trained.
        model = build_vlm_for_export(section)
    elif section.path:
        model = AutoModelForCausalLM.from_pretrained(section.path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(model_config(section), dtype=torch.float32)
    if section.lora is not None and section.family != "vlm":
        model = add_lora(model, section)
    load_checked(model, state, info)

    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if section.lora is not None and merge:
        model = model.merge_and_unload()
    model = model.to(DTYPES[dtype])
    # The config records the dtype loaders cast to ("auto"): it must say what was written.
    target_config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    target_config.dtype = DTYPES[dtype]
    target_config.use_cache = True
    model.save_pretrained(str(tmp), safe_serialization=True)
    if section.lora is not None and not merge and section.path:
        # The adapter points at the base it was trained on, so peft can load it directly.
        adapter_config = tmp / "adapter_config.json"
        data = json.loads(adapter_config.read_text())
        data["base_model_name_or_path"] = str(Path(section.path).resolve())
        adapter_config.write_text(json.dumps(data, indent=2))
    if run.tokenizer.is_dir():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(run.tokenizer)).save_pretrained(str(tmp))
    if (run.path / "processor").is_dir():
        from transformers import AutoProcessor

        # Vision-language runs: the processor (tokenizer + image processor) the run trained with.
        AutoProcessor.from_pretrained(str(run.path / "processor")).save_pretrained(str(tmp))
    (tmp / "zeropipe_export.json").write_text(
        json.dumps({"run": str(run.path.resolve()), "checkpoint": info.tag, "step": info.step, "merged": merge, "dtype": dtype}, indent=2)
    )
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def load_checked(model, state: dict[str, torch.Tensor], info: CheckpointInfo) -> None:
    """Load the consolidated weights, refusing missing, unexpected or misshapen tensors."""
    expected = model.state_dict()
    tied = {name for name in expected if name.endswith("lm_head.weight")} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = [k for k in expected if k not in state and k not in tied]
    unexpected = [k for k in state if k not in expected]
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(expected[k].shape)}" for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        parts = []
        for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
            if names:
                parts.append(f"{label}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
        raise CheckpointError(f"checkpoint {info.path} does not match the run's model ({'; '.join(parts)}): was config.yaml edited after training?")
    model.load_state_dict(state, strict=False)
    if tied:
        model.tie_weights()
