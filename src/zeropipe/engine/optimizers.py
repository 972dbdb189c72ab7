"""The client optimizers a rank builds for ``train.optimizer`` values DeepSpeed cannot build from its JSON.

DeepSpeed builds AdamW, Muon and Adafactor from ds_config.json's optimizer block. bitsandbytes'
AdamW8bit and Prodigy are handed to ``deepspeed.initialize`` ready-made; DeepSpeed then wraps them
in its ZeRO optimizer (which steps them on the rank's fp32 partition) and builds the scheduler
from the JSON as usual. ``config.optimizers`` says which stages and offloads each allows, and
``check`` refuses the rest before any process starts.
"""

from __future__ import annotations

from typing import Any

import torch

from zeropipe.config.optimizers import optimizer_kind
from zeropipe.config.schema import TrainSection
from zeropipe.errors import ConfigError


def build_client_optimizer(train: TrainSection, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    """The optimizer the rank hands to DeepSpeed, or None when DeepSpeed builds it from the JSON."""
    kind = optimizer_kind(train.optimizer)
    if kind.deepspeed_type is not None:
        return None
    betas = (train.adam_beta1, train.adam_beta2)
    if kind.name == "adamw8bit":
        bnb = _import(kind.package, "bitsandbytes")
        # min_8bit_size: bitsandbytes keeps tensors under 4096 values in 32 bits; ZeRO hands it one flat
        # partition per group, so its default applies to the partition, not to each weight.
        return bnb.optim.AdamW8bit(parameters, lr=train.lr, betas=betas, eps=train.adam_eps, weight_decay=train.weight_decay)
    if kind.name == "prodigy":
        prodigyopt = _import(kind.package, "prodigyopt")
        return prodigyopt.Prodigy(parameters, lr=train.lr, betas=betas, eps=train.adam_eps, weight_decay=train.weight_decay)
    raise AssertionError(f"no client optimizer for {kind.name}")


def _import(package: str | None, module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(
            [("train.optimizer", f"{module} is not installed in this environment ({error})", f"pip install {package} on every node")]
        ) from error
