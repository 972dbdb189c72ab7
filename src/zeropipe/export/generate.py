"""Generate text with a trained model, in this process, from wherever its weights are.

Three kinds of source are accepted:

- a run directory (or one of its ``checkpoints/step_*`` directories, or a curriculum run,
  whose last stage with a checkpoint is used): the checkpoint's ZeRO shards are
  consolidated (``zero_to_fp32``) into the model the run's ``config.yaml`` describes, as
  ``zeropipe export`` does, but nothing is written;
- an exported Hugging Face directory (``config.json``): ``from_pretrained``;
- a peft adapter directory (``adapter_config.json``): its base model plus the adapter.

This module resolves sources and holds what every family's generation shares; each family
loads and answers with its own backend (``zeropipe.families.load_model``:
:mod:`zeropipe.families.causal_lm.generate`, :mod:`zeropipe.families.vlm.generate`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeropipe.checkpoint.manager import (
    TAG_PATTERN,
    CheckpointInfo,
    is_complete,
    latest_stage_with_checkpoint,
    list_checkpoints,
    resolve_checkpoint,
    tag_for,
)
from zeropipe.config.pipeline_index import is_pipeline_folder
from zeropipe.errors import CheckpointError, ZeroPipeError
from zeropipe.models.common import TORCH_DTYPES as DTYPES
from zeropipe.rundir import RunDir

DEFAULT_MAX_NEW_TOKENS = 64


@dataclass
class ModelSource:
    """Where the weights come from, decided from the files in the directory."""

    kind: str  # "run", "hf" or "adapter"
    path: Path  # the run directory, exported directory or adapter directory
    family: str = ""  # causal_lm, vlm, diffusion...: filled in by zeropipe.families.resolve_source
    checkpoint: CheckpointInfo | None = None  # runs only
    base: Path | None = None  # adapters only: the base model directory

    def describe(self) -> str:
        if self.kind == "run":
            assert self.checkpoint is not None
            return f"run {self.path} checkpoint {self.checkpoint.tag} (consolidated)"
        if self.kind == "adapter":
            return f"LoRA adapter {self.path} on {self.base}"
        return f"model {self.path}"


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any  # a processor for vision-language models
    source: ModelSource
    device: torch.device
    default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    extra: dict[str, Any] = field(default_factory=dict)  # what a backend needs besides model and tokenizer


@dataclass
class Generation:
    prompt: str
    output: str
    image: str | None = None
    prompt_tokens: int | None = None  # the rendered prompt's length (a conversation's grows each turn)

    def to_dict(self) -> dict[str, Any]:
        row = {"prompt": self.prompt, "output": self.output}
        if self.image is not None:
            row["image"] = self.image
        return row


# ------------------------------------------------------------------ sources
def resolve_source(path: str | Path, checkpoint: str | None = None) -> ModelSource:
    """What kind of directory ``path`` is, and for runs which checkpoint to use.

    Args:
        checkpoint: a tag (``step_00000120``) or a step number; runs only. Default: the
            latest complete checkpoint.

    Raises:
        ZeroPipeError: the path does not exist or holds no model; CheckpointError for a
            run without the checkpoint asked for.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ZeroPipeError(f"{path} does not exist: give a run directory (runs/NAME) or a directory written by zeropipe export")
    if not path.is_dir():
        raise ZeroPipeError(f"{path} is a file: give a run directory (runs/NAME) or a directory written by zeropipe export")
    if (path / "adapter_config.json").is_file():
        refuse_checkpoint(checkpoint, path)
        base = adapter_base(path)
        return ModelSource("adapter", path, base=base)
    if (path / "config.json").is_file():
        refuse_checkpoint(checkpoint, path)
        return ModelSource("hf", path)
    if is_pipeline_folder(path):
        return ModelSource("hf", path)
    run_path = run_directory_of(path)
    if run_path is None:
        raise ZeroPipeError(
            f"{path} holds no model: it is neither a run directory (config.yaml), an exported model (config.json) "
            "nor a LoRA adapter (adapter_config.json); give one of those"
        )
    info = checkpoint_of(path, run_path, checkpoint)
    RunDir(info.path.parent.parent).use_checkpoint(info.path)  # a UI run's: never a checkpoint folder symlinked out of the run
    return ModelSource("run", info.path.parent.parent, checkpoint=info)


def refuse_checkpoint(checkpoint: str | None, path: Path) -> None:
    if checkpoint is not None:
        raise ZeroPipeError(f"--checkpoint picks a checkpoint of a run directory, and {path} is an exported model: drop --checkpoint")


def run_directory_of(path: Path) -> Path | None:
    """The run directory ``path`` is or belongs to (a checkpoint, the checkpoints folder), else None."""
    if TAG_PATTERN.match(path.name) and path.parent.name == "checkpoints":
        return path.parent.parent
    if path.name == "checkpoints" and RunDir(path.parent).config.is_file():
        return path.parent
    if RunDir(path).config.is_file():
        return path
    return None


def checkpoint_of(path: Path, run_path: Path, checkpoint: str | None) -> CheckpointInfo:
    if TAG_PATTERN.match(path.name) and path.parent.name == "checkpoints":
        if checkpoint is not None:
            raise ZeroPipeError(f"{path} is a checkpoint already: drop --checkpoint, or give the run directory {run_path}")
        return resolve_checkpoint(path)[1]
    if (run_path / "stages.json").is_file():
        # A curriculum: the weights are in its stages' sub-runs; the latest stage that saved one is used.
        run_path = latest_stage_with_checkpoint(run_path)
    if checkpoint is None:
        return resolve_checkpoint(run_path)[1]
    tag = tag_for(int(checkpoint)) if checkpoint.isdigit() else checkpoint
    tag_dir = run_path / "checkpoints" / tag
    if not TAG_PATTERN.match(tag) or not is_complete(tag_dir):
        available = ", ".join(info.tag for info in list_checkpoints(run_path)) or "none"
        raise CheckpointError(f"{run_path} has no complete checkpoint {checkpoint!r} (complete ones: {available}): pick one of those or drop --checkpoint")
    return CheckpointInfo(tag, int(TAG_PATTERN.match(tag).group(1)), tag_dir)


def adapter_base(path: Path) -> Path:
    config = json.loads((path / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base or not (Path(base).expanduser() / "config.json").is_file():
        raise ZeroPipeError(
            f"the adapter in {path} names its base model as {base!r}, which is not a local model directory: "
            "set base_model_name_or_path in its adapter_config.json to the base model's directory, or export the run with --merge"
        )
    return Path(base).expanduser()


def read_run_config(run_path: Path):
    """The run's config.yaml as written by the launcher, without re-checking data paths (the data may have moved)."""
    return RunDir(run_path).read_config()


# ------------------------------------------------------------------ loading
def pick_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ZeroPipeError("--device cuda was asked for but torch sees no CUDA device: use --device cpu")
    return torch.device(device)


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """fp32 on the CPU (bf16 matmuls there are slow and change greedy outputs), bf16 on a GPU, unless told."""
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ZeroPipeError(f"--dtype must be one of auto, {', '.join(DTYPES)} (you gave {dtype})")
    return DTYPES[dtype]


# --------------------------------------------------------------- generating
Conversation = list  # [{"role": "system" | "user" | "assistant", "content": str}, ...], ending with a user turn


def as_messages(prompt: "str | Conversation") -> list[dict[str, str]]:
    """A prompt as the messages it renders: one user turn, or a whole conversation (the UI's Chat page).

    Raises:
        ZeroPipeError: a conversation that does not end with a user turn, or a message without a role or text.
    """
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = [{"role": m.get("role"), "content": m.get("content")} for m in prompt if isinstance(m, dict)]
    if len(messages) != len(prompt) or any(m["role"] not in ("system", "user", "assistant") or not isinstance(m["content"], str) for m in messages):
        raise ZeroPipeError("a conversation is a list of {role: system|user|assistant, content: text} messages")
    if not messages or messages[-1]["role"] != "user":
        raise ZeroPipeError("a conversation must end with a user turn: that is the one the model answers")
    return messages


def last_user_text(prompt: "str | Conversation") -> str:
    return prompt if isinstance(prompt, str) else next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")


def context_length(model: Any) -> int | None:
    """How many positions the model reads (None when its config does not say)."""
    config = getattr(model, "config", None)
    for holder in (config, getattr(config, "text_config", None)):
        value = getattr(holder, "max_position_embeddings", None) if holder is not None else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context(model: Any, prompt_tokens: int, max_new_tokens: int) -> None:
    """Raises ZeroPipeError when the prompt and the answer would not fit the model's positions."""
    limit = context_length(model)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        raise ZeroPipeError(
            f"the prompt is {prompt_tokens} tokens and the answer may take {max_new_tokens} more, but the model reads at most {limit}: "
            "start a new conversation (or drop earlier turns), or ask for fewer new tokens"
        )


def check_sampling(prompts: list[str], temperature: float, top_p: float) -> None:
    """Raises ZeroPipeError for no prompt or sampling settings out of range."""
    if not prompts:
        raise ZeroPipeError("no prompt: pass --prompt TEXT (repeat it for several)")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ZeroPipeError(f"--temperature must be >= 0 and --top-p in (0, 1] (you gave {temperature} and {top_p})")


def pair_images(prompts: list[str], images: list[str] | None) -> list[str | None]:
    """One image per prompt: the same image for all, or as many images as prompts."""
    if not images:
        return [None] * len(prompts)
    if len(images) == 1:
        return images * len(prompts)
    if len(images) != len(prompts):
        raise ZeroPipeError(f"{len(images)} --image for {len(prompts)} --prompt: give one image for all prompts, or one per prompt")
    return list(images)
