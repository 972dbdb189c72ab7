"""What a model family supplies to the training loop inside a rank.

The :class:`~zeropipe.engine.trainer.Trainer` owns the loop, the DeepSpeed engine,
checkpoints, resume and metrics; it *holds* one :class:`RankTask`, built by the run's family
(``zeropipe.families``), for everything that depends on what is trained: the data, the
model handed to DeepSpeed, the loss of a micro-batch, evaluation and samples. A task reads
the trainer's state (``trainer.engine``, ``trainer.step``, ``trainer.device``...) and never
drives the loop itself. What several families' tasks share is here too: resumable batches
(:func:`sampler_batches`) and the end-of-run answers (:func:`write_generations`).
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Protocol

import torch

from zeropipe.data.sampler import DataPosition


class RankTask(Protocol):
    """The family's part of one rank. Every method is called on every rank (collectives inside are safe)."""

    def setup_data(self) -> None:
        """Tokenizer or processor, dataset and sampler (and, for diffusion, the missing cache entries)."""

    def build_model(self) -> tuple[torch.nn.Module, dict[str, Any]]:
        """The model to hand to deepspeed.initialize (frozen parameters with requires_grad False) and its parameter counts."""

    def after_initialize(self) -> None:
        """Called once the DeepSpeed engine exists (trainer.engine)."""

    def batches(self, start_step: int) -> Iterator[tuple[int, Any]]:
        """``(epoch, micro-batch)`` from optimizer step ``start_step`` on, epoch after epoch, endlessly.

        An iterator with a ``position`` attribute (:class:`SamplerBatches`) tells the trainer
        where the run stands in its data, in examples of the whole run; the trainer saves it
        with each checkpoint and hands it back as ``trainer.data_position`` on resume, which
        lets the run resume on another number of ranks. Without one, a resume must keep the
        rank count and batch shape (the family says so with ``resumes_on_other_rank_counts``).
        """

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
    data_position = property(lambda self: self.trainer.data_position)  # where a resumed run starts in its data (None: the beginning)

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


class SamplerBatches:
    """Collated micro-batches of one rank from a :class:`~zeropipe.data.sampler.DataPosition` on, epoch after epoch.

    Iterating yields ``(epoch, micro-batch)``; :attr:`position` is where the whole run stands
    after the micro-batches yielded so far, which the trainer saves with every checkpoint.
    Each micro-step takes the next micro-batch x ranks examples of the epoch's order, so a run
    resumed from a position, on any number of ranks, trains on exactly the examples the
    epoch has left (the last few that do not fill a micro-step of all ranks are dropped).

    Args:
        sampler: a ``ResumableDistributedSampler`` (or subclass) built for this rank and world size.
        start: where to start; ``None`` for the beginning of the run.
    """

    def __init__(self, sampler, dataset, collate, micro_batch_size: int, start: DataPosition | None = None):
        self.sampler, self.dataset, self.collate = sampler, dataset, collate
        self.micro_batch_size = micro_batch_size
        self.position = start or DataPosition(0, 0, sampler.world_size, micro_batch_size)
        self._batches = self._generate()

    def __iter__(self) -> SamplerBatches:
        return self

    def __next__(self) -> tuple[int, Any]:
        return next(self._batches)

    def _generate(self) -> Iterator[tuple[int, Any]]:
        rank, world_size, micro = self.sampler.rank, self.sampler.world_size, self.micro_batch_size
        step_examples = micro * world_size
        position = self.position
        while True:
            order = self.sampler.epoch_order(position.epoch, position.world_size, position.micro_batch_size)
            for start in range(position.consumed, len(order) - step_examples + 1, step_examples):
                chunk = order[start : start + step_examples][rank::world_size]
                # Moved before the yield: once the trainer holds this micro-batch it counts as trained on.
                self.position = DataPosition(position.epoch, start + step_examples, position.world_size, position.micro_batch_size)
                yield position.epoch, self.collate([self.dataset[i] for i in chunk])
            # A new epoch is cut for the ranks that start it.
            position = DataPosition(position.epoch + 1, 0, world_size, micro)


def sampler_batches(sampler, dataset, collate, micro_batch_size: int, start: DataPosition | None = None) -> SamplerBatches:
    """The micro-batches a causal-LM or vision-language rank trains on, from ``start`` (see :class:`SamplerBatches`)."""
    return SamplerBatches(sampler, dataset, collate, micro_batch_size, start)


def write_generations(trainer, tokenizer, inputs: list[tuple[dict[str, torch.Tensor], dict[str, Any]]]) -> None:
    """Greedy answers of the trained model, one per input, written to RUN/generations.jsonl by rank 0.

    Every rank runs generate: under ZeRO-3 each forward pass gathers parameters from all
    ranks, so they must run the same number of them (``synced_gpus``).
    """
    model = trainer.engine.module
    model.eval()
    rows = []
    with torch.no_grad():
        for tensors, row in inputs:
            output = model.generate(
                **tensors,
                attention_mask=torch.ones_like(tensors["input_ids"]),
                max_new_tokens=trainer.config.generate.max_new_tokens,
                do_sample=False,
                use_cache=True,
                synced_gpus=trainer.plan.zero_stage == 3 and trainer.world_size > 1,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            answer = tokenizer.decode(output[0, tensors["input_ids"].shape[1] :], skip_special_tokens=True).strip()
            rows.append({**row, "output": answer, "step": trainer.step})
    model.train()
    if trainer.rank == 0:
        keep_by_step(trainer.run.generations, rows)


def keep_by_step(path, rows: list[dict[str, Any]]) -> None:
    """Add one step's answers to RUN/generations.jsonl: answers of other steps (an earlier Sample now) are kept,
    answers of this step (written again after a resume) replaced. Written whole to a new file, then renamed."""
    import os

    steps = {row.get("step") for row in rows}
    kept = []
    try:
        with open(path) as handle:
            for line in handle:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and row.get("step") not in steps:
                    kept.append(row)
    except FileNotFoundError:
        pass
    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in kept + rows)
    os.replace(partial, path)
