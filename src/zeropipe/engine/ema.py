"""An exponential moving average (EMA) of the trained weights, each rank keeping its own ZeRO partition.

Under ZeRO the fp32 master weights that the optimizer updates are partitioned across the ranks:
ZeRO-1/2 hold them in ``optimizer.single_partition_of_fp32_groups``, ZeRO-3 in
``optimizer.fp32_partitioned_groups_flat`` (deepspeed 0.19, ``runtime/zero/stage_1_and_2.py`` and
``runtime/zero/stage3.py``; ZeRO-1's ``BF16_Optimizer`` in ``fp32_groups_flat_partition``). The EMA is one fp32 tensor beside each, on the same device (the host
when the optimizer is offloaded): 4 bytes per trainable weight of the rank's partition, no
collective. The full EMA is gathered offline the way DeepSpeed gathers the master weights
(``zero_to_fp32``), with the EMA in their place (``checkpoint/consolidate.py``). Stage 0 keeps no
fp32 partition of its own: the EMA follows the module's trainable parameters, which every rank
holds whole (in fp32 runs these are the master weights; with bf16/fp16 it averages the 16-bit weights).

The decay of each update is diffusers' ``EMAModel.get_decay`` (``diffusers/training_utils.py``),
which SimpleTuner, ai-toolkit and OneTrainer's diffusers-based trainers use: the first update copies
the weights, then the n-th (n counted from 0) uses min(decay, (1+n)/(10+n)) ("ratio", its default),
min(decay, 1-(1+n)^-power) ("power", its ``use_ema_warmup``), or the decay itself ("none").
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch

from zeropipe.checkpoint import safeload
from zeropipe.checkpoint.manager import EMA_FILE
from zeropipe.errors import ConfigError

log = logging.getLogger(__name__)


def ema_decay(update: int, decay: float, warmup: str = "ratio", power: float = 2 / 3) -> float:
    """The decay used by the ``update``-th update (1-based): 0 for the first, which copies the weights."""
    n = update - 1
    if n <= 0:
        return 0.0
    if warmup == "ratio":
        return min(decay, (1 + n) / (10 + n))
    if warmup == "power":
        return min(decay, 1 - (1 + n) ** -power)
    return decay


def publish_masters(engine: Any) -> None:
    """Copy this rank's master weights into the module's (16-bit or fp32) weights, as DeepSpeed does after an optimizer step.

    ZeRO-1/2 and ZeRO-1's BF16_Optimizer: ``update_lp_params`` (copy, then all-gather: a collective).
    ZeRO-3: each sub-group's ``_reassign_or_swap_out_partitioned_parameters`` (each rank its own partition;
    in fp32 runs the masters are the partitions themselves). Stage 0: the masters are the module's parameters.
    """
    optimizer = engine.optimizer
    groups = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    if groups is not None:
        for group in range(len(groups)):
            optimizer._reassign_or_swap_out_partitioned_parameters(group)
    elif hasattr(optimizer, "update_lp_params"):
        optimizer.update_lp_params()


def master_partitions(engine: Any) -> tuple[list[torch.Tensor], list[str] | None]:
    """This rank's trained fp32 weights: its ZeRO partition (stages 1-3), or the module's trainable parameters and their names (stage 0)."""
    optimizer = engine.optimizer
    if getattr(optimizer, "swap_optimizer", False):
        raise ConfigError(
            [("train.ema", "cannot average weights that DeepSpeed swaps to NVMe (zero_optimization.offload_optimizer.device: nvme): offload the optimizer to cpu, or remove train.ema")]
        )
    # ZeRO-1/2, ZeRO-3, and ZeRO-1's BF16_Optimizer (bf16 weights with fp32 gradient accumulation,
    # runtime/bf16_optimizer.py, which checkpoints it as single_partition_of_fp32_groups too).
    for attribute in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        groups = getattr(optimizer, attribute, None)
        if groups is not None:
            return list(groups), None
    named = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    return [p for _, p in named], [name for name, _ in named]


class EmaWeights:
    """One rank's EMA of its partition of the trained weights.

    Args:
        masters: the tensors the optimizer updates in place (:func:`master_partitions`).
        names: the parameter name of each tensor at stage 0 (whole parameters), else None (flat partitions).
        decay, warmup, power: ``train.ema``'s.
    """

    def __init__(self, masters: list[torch.Tensor], names: list[str] | None, decay: float, warmup: str = "ratio", power: float = 2 / 3):
        self.masters, self.names = masters, names
        self.decay, self.warmup, self.power = decay, warmup, power
        self.updates = 0
        self.tensors = [m.detach().float().clone() for m in masters]

    @classmethod
    def for_engine(cls, engine: Any, settings: Any) -> "EmaWeights":
        masters, names = master_partitions(engine)
        return cls(masters, names, settings.decay, settings.warmup, settings.power)

    @torch.no_grad()
    def update(self) -> float:
        """ema = decay * ema + (1 - decay) * weights, for every tensor of the partition; returns the decay used."""
        self.updates += 1
        decay = ema_decay(self.updates, self.decay, self.warmup, self.power)
        for ema, master in zip(self.tensors, self.masters):
            ema.mul_(decay).add_(master.detach().float(), alpha=1 - decay)
        return decay

    @torch.no_grad()
    def restart(self) -> None:
        """Start again from the current weights (a resume whose checkpoint holds no EMA for this rank)."""
        self.updates = 0
        self.tensors = [m.detach().float().clone() for m in self.masters]

    @contextlib.contextmanager
    def in_module(self, engine: Any):
        """The module computes with the EMA weights inside the block (samples from the EMA: train.ema.sample_from_ema), with the trained ones after.

        The masters are set to the EMA and published to the module, then put back and published again,
        so the optimizer's state and the next step are untouched. A collective under ZeRO 1-2: every rank enters.
        It holds a copy of this rank's masters meanwhile (4 bytes per trained weight of its partition).
        """
        kept = [master.detach().clone() for master in self.masters]
        try:
            with torch.no_grad():
                for master, ema in zip(self.masters, self.tensors):
                    master.copy_(ema.to(device=master.device, dtype=master.dtype))
            publish_masters(engine)
            yield
        finally:
            with torch.no_grad():
                for master, saved in zip(self.masters, kept):
                    master.copy_(saved)
            publish_masters(engine)

    def state_dict(self, rank: int, world_size: int) -> dict[str, Any]:
        return {"updates": self.updates, "tensors": self.tensors, "names": self.names, "rank": rank, "world_size": world_size}

    def save(self, checkpoint: Path, rank: int, world_size: int) -> None:
        torch.save(self.state_dict(rank, world_size), checkpoint / EMA_FILE.format(rank=rank))

    def load(self, checkpoint: Path, rank: int, world_size: int) -> bool:
        """Continue the EMA saved by this rank in ``checkpoint``; False (and the EMA restarts from the loaded weights) when there is none to continue."""
        path = checkpoint / EMA_FILE.format(rank=rank)
        state = safeload.load(path, map_location="cpu") if path.is_file() else None
        shapes = [tuple(t.shape) for t in self.tensors]
        reason = None
        if state is None:
            reason = "the checkpoint holds no EMA (train.ema was off when it was saved)"
        elif state["world_size"] != world_size or [tuple(t.shape) for t in state["tensors"]] != shapes:
            reason = f"its EMA was partitioned for {state['world_size']} ranks, this run has {world_size}"
        if reason:
            self.restart()
            log.warning("train.ema: the EMA starts again from the resumed weights: %s", reason)
            return False
        self.updates = int(state["updates"])
        self.tensors = [saved.to(device=mine.device, dtype=torch.float32) for saved, mine in zip(state["tensors"], self.tensors)]
        return True
