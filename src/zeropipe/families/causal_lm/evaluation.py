"""Eval loss and perplexity on held-out data: inside the ranks during training, and in-process for a checkpoint.

The loss is the mean over every held-out token that carries loss (the same tokens and the
same loss as training), so it is computed from sums: each batch's mean loss times its
number of loss tokens, summed over batches and ranks, divided by the total token count.
It does not depend on how the examples were batched or split between ranks.

During training every rank evaluates a disjoint slice of the examples. Under ZeRO-3 each
forward pass is a collective (the ranks gather parameters together), so every rank runs the
same number of batches: a rank with fewer examples repeats one of its batches and ignores
its result.
"""

from __future__ import annotations

import contextlib
import math
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from zeropipe.checkpoint.consolidate import consolidated_state_dict, load_checked
from zeropipe.checkpoint.manager import list_checkpoints, resolve_checkpoint
from zeropipe.data.token_cache import TokenDataset, build_token_cache, collate
from zeropipe.data.tokenize import IGNORE_INDEX, pad_token_id
from zeropipe.errors import CheckpointError, ZeroPipeError
from zeropipe.families.causal_lm.model import add_lora
from zeropipe.models.common import TORCH_DTYPES as DTYPES
from zeropipe.models.common import model_config
from zeropipe.rundir import RunDir

EVAL_KIND = "eval"  # the "kind" of eval rows in metrics.jsonl; training rows have none


def eval_batch_indices(lengths: np.ndarray, rank: int, world_size: int, batch_size: int) -> list[tuple[list[int], bool]]:
    """This rank's eval batches as ``(example indices, counted)``; every rank gets the same number.

    A rank takes every ``world_size``-th example from its own offset, sorted longest first so
    that batches need little padding. Batches added to match the other ranks repeat one of
    the rank's batches with ``counted`` False.
    """
    count = len(lengths)
    per_rank_most = math.ceil(count / world_size)
    batches_each = max(1, math.ceil(per_rank_most / batch_size))
    mine = sorted(range(rank, count, world_size), key=lambda index: (-int(lengths[index]), index))
    batches = [(mine[start : start + batch_size], True) for start in range(0, len(mine), batch_size)]
    filler = batches[-1][0] if batches else [0]
    batches += [(filler, False)] * (batches_each - len(batches))
    return batches


def loss_token_count(labels: torch.Tensor) -> int:
    """Tokens that carry loss after the model's shift by one (the first position is never a target)."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def eval_sums(
    loss_of: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    dataset,
    batches: list[tuple[list[int], bool]],
    collate: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]],
    device: torch.device,
) -> tuple[float, float, float]:
    """``(sum of loss x tokens, loss tokens, examples)`` over the counted batches.

    ``loss_of`` runs the model on a batch (already on ``device``) and returns its mean loss;
    the caller puts the model in eval mode.
    """
    loss_sum = tokens = examples = 0.0
    with torch.no_grad():
        for indices, counted in batches:
            batch = {key: value.to(device) for key, value in collate([dataset[i] for i in indices]).items()}
            loss = loss_of(batch)  # run even when not counted: under ZeRO-3 the other ranks wait for it
            if not counted:
                continue
            batch_tokens = loss_token_count(batch["labels"])
            if batch_tokens:
                loss_sum += float(loss.float()) * batch_tokens
                tokens += batch_tokens
            examples += len(indices)
    return loss_sum, tokens, examples


def perplexity(loss: float) -> float:
    # exp overflows a float past ~709; a diverged run's perplexity is simply infinite.
    return math.exp(loss) if loss < 700 else float("inf")


def eval_record(step: int, loss_sum: float, tokens: float, examples: float, seconds: float) -> dict[str, Any]:
    """The metrics.jsonl row of one evaluation."""
    loss = loss_sum / tokens if tokens else float("nan")
    return {
        "kind": EVAL_KIND,
        "step": step,
        "eval_loss": loss,
        "eval_perplexity": perplexity(loss) if tokens else float("nan"),
        "eval_tokens": int(tokens),
        "eval_examples": int(examples),
        "eval_time_s": seconds,
    }


# ------------------------------------------------------- a checkpoint, in-process
@dataclass
class EvalResult:
    loss: float
    perplexity: float
    tokens: int  # tokens that carry loss
    examples: int
    run: str
    checkpoint: str
    step: int
    data: str  # the eval data: a file given with --data, or the run's eval cache
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def evaluate_checkpoint(
    source: str | Path,
    checkpoint: str | None = None,
    data: str | Path | None = None,
    dtype: str | None = None,
    batch_size: int | None = None,
) -> EvalResult:
    """Eval loss of a run's checkpoint, computed in this process on CPU (no DeepSpeed ranks).

    The ZeRO shards are consolidated like ``zeropipe export`` does, loaded into the model
    built from the run's config, and run over the held-out data in the run's precision (so
    the figure is comparable with the eval rows the training wrote).

    Args:
        source: run directory, or one of its ``checkpoints/step_*`` directories.
        checkpoint: a checkpoint tag of the run (``step_00000120``); default: the latest.
        data: a file in the formats data.path accepts, instead of the run's held-out data.
        dtype: bf16, fp16 or fp32; default: the run's deepspeed.precision.
        batch_size: examples per forward pass; default: the run's micro-batch size.

    Raises:
        CheckpointError: no complete checkpoint, or it does not match the run's model.
        ZeroPipeError: the run has no held-out data and none was given, or is not a causal LM.
    """

    run, info = resolve_run_checkpoint(source, checkpoint)
    config = run.read_config()
    if config.model.family not in ("causal_lm", "auto"):
        raise ZeroPipeError(f"zeropipe eval computes the loss of causal language models; {run.path} is a {config.model.family} run")
    return _evaluate_loaded(run, info, config, data, dtype, batch_size)


def resolve_run_checkpoint(source: str | Path, checkpoint: str | None = None) -> tuple[RunDir, Any]:
    """(the run, its checkpoint) that ``zeropipe eval SOURCE [--checkpoint TAG]`` names; the run confined to its own files.

    Raises:
        ZeroPipeError: SOURCE is not a run directory.
        CheckpointError: no such (complete) checkpoint.
    """
    source = Path(source)
    if not RunDir(source).config.is_file() and not (source.parent.name == "checkpoints" and RunDir(source.parent.parent).config.is_file()):
        raise ZeroPipeError(f"{source} is not a run directory (no config.yaml): give the directory `zeropipe train` wrote")
    if checkpoint:
        run_root = source.parent.parent if source.parent.name == "checkpoints" else source
        tag_dir = run_root / "checkpoints" / checkpoint
        if not tag_dir.is_dir():
            tags = [info.tag for info in list_checkpoints(run_root)]
            raise CheckpointError(f"{run_root} has no checkpoint {checkpoint}: complete ones are {', '.join(tags) or 'none'}")
        run_path, info = resolve_checkpoint(tag_dir)
    else:
        run_path, info = resolve_checkpoint(source)
    run = RunDir(run_path)
    run.use_checkpoint(info.path)  # a UI run's: never a checkpoint folder symlinked out of the run; its data confined
    return run, info


def _evaluate_loaded(run: RunDir, info, config, data, dtype, batch_size) -> EvalResult:
    # A run's saved precision is resolved; a hand-written config's auto is taken as fp32 (exact on any machine).
    dtype = dtype or (config.deepspeed.precision if config.deepspeed.precision != "auto" else "fp32")
    if dtype not in DTYPES:
        raise ZeroPipeError(f"--dtype must be one of {', '.join(DTYPES)} (you gave {dtype})")
    if data is None and not (run.eval_cache / "cache.json").is_file():
        raise ZeroPipeError(
            f"{run.path} has no held-out data: it was trained without data.eval_path or data.eval_fraction. "
            "Give a file to evaluate on with --data FILE"
        )
    batch_size = batch_size or run.read_plan().micro_batch_size

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(run.tokenizer))
    pad_id = pad_token_id(tokenizer)
    model = load_checkpoint_model(run, info, DTYPES[dtype])
    with tempfile.TemporaryDirectory(prefix="zeropipe-eval-") as scratch:
        if data is not None:
            # Tokenized exactly as the training data was: same tokenizer, format and length.
            cache_dir = Path(scratch) / "eval"
            build_token_cache(
                Path(data).expanduser(),
                tokenizer,
                cache_dir,
                fmt=config.data.format,
                max_seq_len=config.data.max_seq_len,
                max_bad_fraction=config.data.max_bad_fraction,
                max_bad_records=config.data.max_bad_records,
                columns=config.data.columns,
            )
        else:
            cache_dir = run.eval_cache
        dataset = TokenDataset(cache_dir)
        batches = eval_batch_indices(dataset.lengths(), 0, 1, batch_size)
        loss_sum, tokens, examples = eval_sums(
            lambda batch: model(**batch, use_cache=False).loss, dataset, batches, lambda items: collate(items, pad_token_id=pad_id), torch.device("cpu")
        )
    row = eval_record(info.step, loss_sum, tokens, examples, 0.0)
    return EvalResult(
        loss=row["eval_loss"],
        perplexity=row["eval_perplexity"],
        tokens=row["eval_tokens"],
        examples=row["eval_examples"],
        run=str(run.path),
        checkpoint=info.tag,
        step=info.step,
        data=str(Path(data).expanduser()) if data is not None else str(run.eval_cache),
        dtype=dtype,
    )


def load_checkpoint_model(run, info, dtype: torch.dtype):
    """The run's model with a checkpoint's consolidated weights, on CPU, in eval mode."""
    from transformers import AutoModelForCausalLM

    section = run.read_config().model
    attention = {"attn_implementation": section.attn_implementation}
    if section.path:
        model = AutoModelForCausalLM.from_pretrained(section.path, dtype=torch.float32, **attention)
    else:
        model = AutoModelForCausalLM.from_config(model_config(section), dtype=torch.float32, **attention)
    if section.lora is not None:
        model = add_lora(model, section)
    # DeepSpeed's zero_to_fp32 prints its progress: keep stdout for the result (--json).
    with contextlib.redirect_stdout(sys.stderr):
        state = consolidated_state_dict(info)
    load_checked(model, state, info)
    return model.to(dtype).eval()
