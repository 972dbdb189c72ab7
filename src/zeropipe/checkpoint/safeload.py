"""Checkpoint files read without unpickling code: ``torch.load(weights_only=True)`` and an allow-list.

A checkpoint is anyone's file: a run copied from elsewhere, a shared or downloaded checkpoint, a
run directory another local user can write. ``torch.load(weights_only=False)`` (DeepSpeed's own
``zero_to_fp32``, its checkpoint engine and its universal-checkpoint readers) runs whatever a pickle's
``__reduce__`` names. Every checkpoint file ZeRO-Pipe or DeepSpeed reads in a ZeRO-Pipe process
(export, eval, generate, the UI's Generate, Chat and Draw, a resume's ranks) goes through
:func:`load`: tensors, plain containers and the few non-tensor globals DeepSpeed's checkpoints
hold (``SAFE_GLOBALS``, found by saving real checkpoints at every ZeRO stage:
``tests/unit/checkpoint/test_safeload.py``). A file that needs anything else is refused with the
global's name; there is no fallback to ``weights_only=False``.

DeepSpeed's readers call ``torch.load(..., weights_only=False)`` themselves: :func:`install` gives
each of those modules a copy of the ``torch`` module whose ``load`` is :func:`load` (a plain
module, so every other ``torch.X`` in them is the same object at the same cost).
"""

from __future__ import annotations

import collections
import importlib
import pickle
import re
import threading
import types
from pathlib import Path
from typing import Any

import torch

from zeropipe.errors import CheckpointError


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file whose pickle names a global outside the allow-list: it is not loaded."""


def _safe_globals() -> list[Any]:
    """The non-tensor globals real DeepSpeed and ZeRO-Pipe checkpoints hold (none of them runs code when rebuilt)."""
    import numpy
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    found: list[Any] = [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler, collections.OrderedDict, collections.defaultdict]
    # The ranks' RNG states (rng_rankN.pt): numpy's Mersenne Twister state is an array.
    found += [numpy.ndarray, numpy.dtype, numpy.dtypes.UInt32DType, numpy.dtypes.Int64DType, numpy.dtypes.Float64DType]
    reconstruct = getattr(getattr(numpy, "_core", numpy.core), "multiarray")._reconstruct
    found.append(reconstruct)
    return found


_GLOBALS: list[Any] | None = None


def safe_globals() -> list[Any]:
    global _GLOBALS
    if _GLOBALS is None:
        _GLOBALS = _safe_globals()
    return _GLOBALS


_REAL_LOAD = torch.load
GLOBAL_NAME = re.compile(r"GLOBAL ([\w.]+)|global ['\"]?([\w.]+)", re.IGNORECASE)


def load(f: Any, map_location: Any = None, *args: Any, weights_only: bool | None = True, **kwargs: Any) -> Any:
    """``torch.load(f, weights_only=True)`` with the allow-list; ``weights_only`` asked by the caller is ignored (always True).

    Raises:
        UnsafeCheckpoint: the file names a global outside the allow-list (the name is in the message).
    """
    del weights_only, args  # never False: a caller (DeepSpeed) asking for it gets the safe load all the same
    kwargs.pop("pickle_module", None)
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return _REAL_LOAD(f, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        name = unsafe_name(f, str(err))
        raise UnsafeCheckpoint(
            f"{f} needs {name} to be rebuilt, which is not one of the tensors, containers and DeepSpeed records a checkpoint holds: "
            "it is refused and was not unpickled (a pickle can run any code as it loads). If you made this file yourself and trust it, "
            "load it in your own Python session with torch.load(..., weights_only=False)"
        ) from None


def unsafe_name(f: Any, message: str) -> str:
    match = GLOBAL_NAME.search(message)
    if match:
        return match.group(1) or match.group(2)
    if isinstance(f, (str, Path)):
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(f)
        except Exception:  # noqa: BLE001 - only for the message; the file is refused either way
            names = []
        allowed = {f"{g.__module__}.{g.__qualname__}" for g in safe_globals() if hasattr(g, "__qualname__")}
        names = [n for n in names if n not in allowed]
        if names:
            return ", ".join(names)
    return "a global outside the allow-list"


# DeepSpeed's modules that read checkpoint files with torch.load(weights_only=False).
DEEPSPEED_READERS = (
    "deepspeed.utils.zero_to_fp32",
    "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine",
    "deepspeed.runtime.base_optimizer",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.checkpoint.zero_checkpoint",
    "deepspeed.checkpoint.deepspeed_checkpoint",
    "deepspeed.checkpoint.universal_checkpoint",
    "deepspeed.checkpoint.ds_to_universal",
)
_INSTALLED = False
_LOCK = threading.Lock()


def safe_torch() -> types.ModuleType:
    """A copy of the ``torch`` module whose ``load`` is :func:`load`."""
    copy = types.ModuleType("torch", torch.__doc__)
    copy.__dict__.update(torch.__dict__)
    copy.load = load
    return copy


def install() -> None:
    """Make every DeepSpeed checkpoint reader of this process load with :func:`load` (idempotent)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        shim = safe_torch()
        for name in DEEPSPEED_READERS:
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a reader this DeepSpeed build lacks (optional dependencies) reads nothing
                continue
            if getattr(module, "torch", None) is torch:
                module.torch = shim
        _INSTALLED = True
