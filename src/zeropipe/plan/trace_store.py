"""Stored activation traces of catalog models, so a plan of a big diffusion model is arithmetic, not a traced forward pass.

Tracing a 14-32B denoiser on the meta device takes 10-40 s per shape (mostly counting FLOPs
through torch's dispatcher); the result depends only on the denoiser's class and config, the
adapters injected, the input shape and diffusers' version. ``traces.json`` beside the catalog
holds the traces of the shapes the catalog and examples/ plan, keyed by exactly that; any other
key is traced as before (``plan.model_spec._trace``). ``python -m zeropipe.plan.trace_store
--rebuild`` traces them again (after a diffusers upgrade the keys no longer match and plans
trace live until then); ``tests/unit/plan/test_plan_trace_store.py`` holds a stored trace to a
fresh one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import Any

from zeropipe.plan.trace import ActivationTrace

STORE = Path(__file__).parent / "catalog" / "traces.json"


def _diffusers_version() -> str:
    from importlib.metadata import version

    return ".".join(version("diffusers").split(".")[:2])


def trace_key(model, trained: dict[str, Any], resolution: int, frames: int, latent: int, latent_frames: int, text_tokens: int) -> str:
    """What a trace depends on: the denoiser's class and config, its trainable weights (the adapters), dropout, the input shape, diffusers' version."""
    import torch

    trainable = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    dropout = sorted({round(m.p, 4) for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0})
    blob = json.dumps(
        {
            "class": trained.get("class"),
            "config": trained.get("config"),
            "trainable": trainable if len(trainable) < len(list(model.parameters())) else "all",
            "dropout": dropout,
            "shape": [resolution, frames, latent, latent_frames, text_tokens],
            "diffusers": _diffusers_version(),
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
    return None if row is None else ActivationTrace(**row["trace"])


def record(key: str, label: str, trace: ActivationTrace) -> None:
    """Add a trace to the store (the rebuild below)."""
    rows = dict(_stored())
    rows[key] = {"label": label, "trace": asdict(trace)}
    STORE.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    _stored.cache_clear()


# Set by the rebuild: every trace made while it runs is recorded.
RECORDING: dict[str, str] = {}


def _rebuild(names: list[str], lora_ranks: list[int]) -> None:  # pragma: no cover - a maintenance command
    """Trace the catalog's diffusion entries (plain and with LoRA at the given ranks) and every example under examples/."""
    import glob

    from zeropipe.config.schema import LoraSection
    from zeropipe.plan.model_spec import catalog_names, spec_from_catalog

    RECORDING["on"] = "1"
    for name in names or catalog_names():
        if json.loads((Path(__file__).parent / "catalog" / f"{name}.json").read_text())["family"] == "causal_lm":
            continue  # counted by formula, never traced
        for r in lora_ranks:
            try:
                spec_from_catalog(name, LoraSection(r=r) if r else None)
            except Exception as err:  # noqa: BLE001 - report and go on
                print(f"{name} r={r}: {err}")
    root = Path(__file__).resolve().parents[3] / "examples"
    for path in sorted(glob.glob(str(root / "**" / "*.yaml"), recursive=True)):
        from zeropipe.cli.main import main

        try:
            main(["plan", path, "--gpus", "5x24GB", "--ram", "64GB", "--json"])
        except SystemExit:
            pass
        except Exception as err:  # noqa: BLE001
            print(f"{path}: {err}")


if __name__ == "__main__":  # pragma: no cover
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rebuild", action="store_true")
    parser.add_argument("--model", action="append", default=[])
    parser.add_argument("--lora-r", action="append", type=int, default=[])
    args = parser.parse_args()
    if args.rebuild:
        _rebuild(args.model, args.lora_r or [16, 32])
