"""What a model family supplies to the training loop inside a rank.

The :class:`~zeropipe.engine.trainer.Trainer` owns the loop, the DeepSpeed engine,
checkpoints, resume and metrics; it *holds* one :class:`RankTask`, built by the run's family
(``zeropipe.families``), for everything that depends on what is trained: the data, the
model handed to DeepSpeed, the loss of a micro-batch, evaluation and samples. A task reads
the trainer's state (``trainer.engine``, ``trainer.step``, ``trainer.device``...) and never
drives the loop itself.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch


class RankTask(Protocol):
    """The family's part of one rank. Every method is called on every rank (collectives inside are safe)."""

    def setup_data(self) -> None:
        """Tokenizer or processor, dataset and sampler (and, for diffusion, the missing cache entries)."""

    def build_model(self) -> tuple[torch.nn.Module, dict[str, Any]]:
        """The model to hand to deepspeed.initialize (frozen parameters with requires_grad False) and its parameter counts."""

    def after_initialize(self) -> None:
        """Called once the DeepSpeed engine exists (trainer.engine)."""

    def batches(self, start_step: int) -> Iterator[tuple[int, Any]]:
        """``(epoch, micro-batch)`` from optimizer step ``start_step`` on, epoch after epoch, endlessly."""

    def forward_loss(self, batch: Any) -> tuple[torch.Tensor, float, float]:
        """``(loss, tokens, examples)`` of one micro-batch; tokens is 0 where the family has none."""

    def before_train(self) -> None: ...

    def after_step(self) -> None:
        """Work between optimizer steps (evaluation, sample images)."""

    def after_train(self) -> None: ...

    def generate_samples(self) -> None:
        """Answers or images from the trained weights, written into the run directory by rank 0."""

    def extra_metrics(self) -> dict[str, Any]:
        """Fields added to every metrics row (rank 0)."""

    def summary_fields(self) -> dict[str, Any]:
        """Fields added to summary.json (rank 0)."""


class TaskDefaults:
    """No-op defaults for the optional hooks of :class:`RankTask`, and the trainer's state under short names."""

    def __init__(self, trainer: Any):  # the zeropipe.engine.trainer.Trainer that holds this task
        self.trainer = trainer

    run = property(lambda self: self.trainer.run)
    config = property(lambda self: self.trainer.config)
    plan = property(lambda self: self.trainer.plan)
    rank = property(lambda self: self.trainer.rank)
    world_size = property(lambda self: self.trainer.world_size)
    device = property(lambda self: self.trainer.device)
    engine = property(lambda self: self.trainer.engine)
    step = property(lambda self: self.trainer.step)
    micro_batch_size = property(lambda self: self.trainer.micro_batch_size)
    accumulation = property(lambda self: self.trainer.accumulation)

    def after_initialize(self) -> None:
        pass

    def before_train(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def after_train(self) -> None:
        pass

    def generate_samples(self) -> None:
        pass

    def extra_metrics(self) -> dict[str, Any]:
        return {}

    def summary_fields(self) -> dict[str, Any]:
        return {}


def sampler_batches(sampler, dataset, collate, micro_batch_size: int, micro_batches_per_epoch: int, start_micro_step: int) -> Iterator[tuple[int, Any]]:
    """Collated micro-batches of a resumable sampler from micro-step ``start_micro_step`` on, epoch after epoch.

    The position inside an epoch is a count of micro-batches, so a resumed run continues
    with exactly the batches the uninterrupted run would have seen.
    """
    micro_step = start_micro_step
    while True:
        epoch, position = divmod(micro_step, micro_batches_per_epoch)
        sampler.set_epoch(epoch)
        sampler.set_start(position * micro_batch_size)
        indices = list(iter(sampler))
        for start in range(0, (micro_batches_per_epoch - position) * micro_batch_size, micro_batch_size):
            chunk = indices[start : start + micro_batch_size]
            yield epoch, collate([dataset[i] for i in chunk])
            micro_step += 1
