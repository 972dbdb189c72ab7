"""A checkpoint's weights in one state dict, and loading them into a model with every tensor checked.

The partitioned shards are merged with DeepSpeed's own ``zero_to_fp32`` (stages 1-3; stage 0
checkpoints hold the whole module already). Export, eval, generate and curricula all read
weights this way.
"""

from __future__ import annotations

import json

import torch

from zeropipe.checkpoint import safeload
from zeropipe.checkpoint.manager import COMPLETE_MARKER, CheckpointInfo
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
