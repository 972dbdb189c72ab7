"""A checkpoint's weights in one state dict, and loading them into a model with every tensor checked.

The partitioned shards are merged with DeepSpeed's own ``zero_to_fp32`` (stages 1-3; stage 0
checkpoints hold the whole module already). Export, eval, generate and curricula all read
weights this way.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import torch

from zeropipe.checkpoint import safeload
from zeropipe.checkpoint.manager import COMPLETE_MARKER, EMA_FILE, CheckpointInfo
from zeropipe.errors import CheckpointError


def consolidated_state_dict(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a checkpoint, gathered from every rank's shards."""
    marker = json.loads((info.path / COMPLETE_MARKER).read_text())
    refuse_links_out(info)
    # Never unpickled: tensors and DeepSpeed's own records only (checkpoint.safeload), here and in zero_to_fp32.
    safeload.install()
    if marker.get("zero_stage", 0) == 0:
        states = safeload.load(info.path / "mp_rank_00_model_states.pt", map_location="cpu")
        return {key: value.float() for key, value in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(info.path.parent), tag=info.tag)


def refuse_links_out(info: CheckpointInfo) -> None:
    """Refuse a checkpoint whose files are symlinks leading out of its folder (a run's files are its own).

    Raises:
        CheckpointError: naming the file; it is not read.
    """
    folder = info.path.resolve()
    for file in sorted(info.path.iterdir()):
        if file.is_symlink():
            try:
                file.resolve().relative_to(folder)
            except (ValueError, OSError, RuntimeError):
                raise CheckpointError(f"{file} is a symlink that leads out of checkpoint {info.tag}: it is not read; copy the file itself into the checkpoint") from None


def consolidated_ema_state_dict(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a checkpoint with its EMA weights (train.ema) in place of the trained ones.

    Each rank saved the EMA of its own partition of the fp32 master weights (``ema_rankN.pt``,
    engine/ema.py), laid out as DeepSpeed's partition. DeepSpeed's own ``zero_to_fp32`` gathers
    them: it reads a copy of the checkpoint whose optimizer files hold the EMA partitions where
    the master partitions were (stages 1-3). Stage 0: the EMA of each trainable parameter
    replaces it in the module's weights. Frozen weights are the checkpoint's.
    """
    safeload.install()  # DeepSpeed's readers below load without unpickling too
    marker = json.loads((info.path / COMPLETE_MARKER).read_text())
    world_size = int(marker.get("world_size", 1))
    files = [info.path / EMA_FILE.format(rank=rank) for rank in range(world_size)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {info.path} holds no EMA weights ({', '.join(missing)} missing): it was saved without train.ema")
    if marker.get("zero_stage", 0) == 0:
        ema = safeload.load(files[0], map_location="cpu")
        state = consolidated_state_dict(info)
        state.update({name: tensor.float() for name, tensor in zip(ema["names"], ema["tensors"])})
        return state
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT, SINGLE_PARTITION_OF_FP32_GROUPS
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    key = FP32_FLAT_GROUPS if marker["zero_stage"] == 3 else SINGLE_PARTITION_OF_FP32_GROUPS
    with tempfile.TemporaryDirectory(prefix="zeropipe-ema-") as scratch:
        copy = Path(scratch) / info.tag
        copy.mkdir()
        for source in info.path.iterdir():
            if source.name.endswith("_model_states.pt"):
                (copy / source.name).symlink_to(source.resolve())
            elif source.name.endswith("_optim_states.pt"):
                rank = int(re.search(r"zero_pp_rank_(\d+)_", source.name).group(1))
                states = safeload.load(source, map_location="cpu")
                states[OPTIMIZER_STATE_DICT].pop(OPTIMIZER_STATE_DICT, None)  # the Adam moments: not needed to gather weights
                ema = safeload.load(files[rank], map_location="cpu")
                masters = states[OPTIMIZER_STATE_DICT][key]
                if [tuple(t.shape) for t in masters] != [tuple(t.shape) for t in ema["tensors"]]:
                    raise CheckpointError(f"{files[rank]} does not match rank {rank}'s partition in {source}")
                states[OPTIMIZER_STATE_DICT][key] = [t.float() for t in ema["tensors"]]
                torch.save(states, copy / source.name)
        return get_fp32_state_dict_from_zero_checkpoint(scratch, tag=info.tag)



def load_checked(model, state: dict[str, torch.Tensor], info: CheckpointInfo, what: str = "model") -> None:
    """Load the consolidated weights, refusing missing, unexpected or misshapen tensors.

    Tied output embeddings (``tie_word_embeddings``) may be absent from the checkpoint: they are re-tied.
    """
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
        raise CheckpointError(f"checkpoint {info.path} does not match the run's {what} ({'; '.join(parts)}): was config.yaml edited after training?")
    model.load_state_dict(state, strict=False)
    if tied:
        model.tie_weights()
