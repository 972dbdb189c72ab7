"""Stored activation traces of catalog models, so a plan of a big diffusion model is arithmetic, not a traced forward pass.

Tracing a 14-32B denoiser on the meta device takes 10-40 s per shape (mostly counting FLOPs
through torch's dispatcher); the result depends only on the denoiser's class and config, the
adapters injected, the input shape and diffusers' version. ``traces.json`` beside the catalog
holds the traces of the shapes the catalog and examples/ plan, keyed by exactly that; any other
key is traced as before (``plan.model_spec._trace``). ``scripts/rebuild_traces.py`` traces them again (after a diffusers upgrade the keys no longer match and plans
trace live until then); ``tests/unit/plan/test_plan_trace_store.py`` holds a stored trace to a
fresh one.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from zeropipe.plan.trace import ActivationTrace

STORE = Path(__file__).parent / "catalog" / "traces.json"


def _diffusers_version() -> str:
    from importlib.metadata import version

    return ".".join(version("diffusers").split(".")[:2])


def trace_key(model, trained: dict[str, Any], resolution: int, frames: int, latent: int, latent_frames: int, text_tokens: int, entry: str | None = None) -> str:
    """What a trace depends on: the denoiser's class and config, its trainable weights (the adapters), dropout, the input shape, diffusers' version, and what a trace holds (its fields).

    ``entry``: the entry's name, where it traces the same denoiser config at the same shape differently from another entry
    (one that shares its folder); None keeps the keys of the traces stored before (the name is not in them).
    """
    import torch

    trainable = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    dropout = sorted({round(m.p, 4) for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0})
    named = {} if entry is None else {"entry": entry}
    blob = json.dumps(
        {
            **named,
            "class": trained.get("class"),
            "config": trained.get("config"),
            "trainable": trainable if len(trainable) < len(list(model.parameters())) else "all",
            "dropout": dropout,
            "shape": [resolution, frames, latent, latent_frames, text_tokens],
            "diffusers": _diffusers_version(),
            "fields": sorted(f.name for f in fields(ActivationTrace)),  # a trace with other fields is traced again
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


@lru_cache(maxsize=1)
def _stored() -> dict[str, dict[str, Any]]:
    if not STORE.is_file():
        return {}
    return json.loads(STORE.read_text())


def lookup(key: str) -> ActivationTrace | None:
    row = _stored().get(key)
    if row is None:
        return None
    # JSON has no tuples: the trace's tuple fields (offloaded_sizes) come back as lists.
    return ActivationTrace(**{name: tuple(value) if isinstance(value, list) else value for name, value in row["trace"].items()})


def record(key: str, label: str, trace: ActivationTrace) -> None:
    """Add a trace to the store (the rebuild below; several rebuilds may run at once: the file is locked while it is rewritten)."""
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / "zeropipe-traces.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _stored.cache_clear()
        rows = dict(_stored())
        rows[key] = {"label": label, "trace": asdict(trace)}
        STORE.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
        _stored.cache_clear()


# Set by the rebuild (scripts/rebuild_traces.py, ZEROPIPE_RECORD_TRACES=1): every trace made while it runs is recorded.
RECORDING: dict[str, str] = {"on": "1"} if os.environ.get("ZEROPIPE_RECORD_TRACES") else {}
