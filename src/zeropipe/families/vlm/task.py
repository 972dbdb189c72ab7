"""The vision-language model's part of a rank.

The processor saved by the launcher instead of a tokenizer, examples whose images are loaded
and processed when they are used, the model with only ``model.trainable`` parts (or their
LoRA adapters) handed to DeepSpeed, and answers about images at the end of the run.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any

import torch

from zeropipe.data.sampler import DataPosition, ResumableDistributedSampler
from zeropipe.data.tokenize import pad_token_id
from zeropipe.engine.task import TaskDefaults, sampler_batches, write_generations
from zeropipe.families.vlm.data import GENERATE_FILE, MANIFEST, VlmDataset, VlmEncoder, caption_messages, collate_vlm, load_rgb
from zeropipe.families.vlm.model import build_vlm, part_counts, trainable_parts, vlm_config
from zeropipe.models.common import TORCH_DTYPES, count_parameters, hf_zero3_config, log_partitioning

log = logging.getLogger("zeropipe")


class VisionLanguageTask(TaskDefaults):
    """One rank's share of a vision-language run."""

    def setup_data(self) -> None:
        from transformers import AutoProcessor

        trainer = self.trainer
        self.processor = AutoProcessor.from_pretrained(str(trainer.run.processor))
        self.tokenizer = self.processor.tokenizer
        self.encoder = VlmEncoder(self.processor, trainer.config.data.max_seq_len)
        self.dataset = VlmDataset(trainer.run.data / MANIFEST, self.encoder)
        self.sampler = ResumableDistributedSampler(len(self.dataset), trainer.rank, trainer.world_size, seed=trainer.config.run.seed, shuffle=True)
        self.collate = partial(collate_vlm, pad_token_id=pad_token_id(self.tokenizer))

    def build_model(self) -> tuple[torch.nn.Module, dict[str, Any]]:

        trainer = self.trainer
        section = trainer.config.model
        config = vlm_config(section)
        self.hf_ds_config = hf_zero3_config(trainer.ds_config, trainer.plan.zero_stage)
        model = build_vlm(section, config, trainer.config.deepspeed.precision, trainer.plan.zero_stage, activation_offload=trainer.config.train.activation_offload)
        if trainer.plan.zero_stage == 3:
            log_partitioning(model)
        trainable, total = count_parameters(model)
        parts = part_counts(model)
        log.info(
            "model: %s parameters, %s trainable (%s%s)",
            f"{total:,}",
            f"{trainable:,}",
            ", ".join(f"{part} {c['trainable']:,}/{c['total']:,}" for part, c in parts.items()),
            f"; LoRA on {', '.join(trainable_parts(section))}" if section.lora is not None else "",
        )
        self.compute_dtype = TORCH_DTYPES[trainer.config.deepspeed.precision]
        # Frozen parts get no gradients and no optimizer state: only trainable parameters go to DeepSpeed.
        return model, {"trainable": trainable, "total": total, "parts": parts}

    def batches(self, start_step: int):
        trainer = self.trainer
        # Where a resumed run stands in its data, for all ranks together: it may have had another rank count.
        start = trainer.data_position or DataPosition.at_micro_step(
            start_step * trainer.accumulation, trainer.plan.micro_batches_per_epoch, trainer.world_size, trainer.micro_batch_size
        )
        return sampler_batches(self.sampler, self.dataset, self.collate, trainer.micro_batch_size, start)

    def to_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors on the rank's device; pixel values in the model's dtype (DeepSpeed casts the weights, not the inputs)."""
        device = self.trainer.device
        return {key: value.to(device, dtype=self.compute_dtype if value.is_floating_point() else value.dtype) for key, value in tensors.items()}

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, float]:
        # Counted on the host batch, before it moves: a count read back from the device would wait for it.
        tokens, examples = float(batch["attention_mask"].sum()), float(batch["input_ids"].shape[0])
        loss = self.trainer.engine(**self.to_device(batch)).loss
        return loss, tokens, examples

    def after_step(self) -> None:
        counts = self.trainer.parameter_counts
        # Adam's moments exist from the first step on; counted once, they go into summary.json.
        if "optimizer_state_elements" not in counts:
            counts["optimizer_state_elements"] = self.optimizer_state_elements()

    def optimizer_state_elements(self) -> int:
        """Elements of Adam's first moment over all ranks: the trainable parameters (plus ZeRO's padding), frozen ones absent.

        A collective: every rank calls it.
        """
        import deepspeed.comm as dist

        trainer = self.trainer
        optimizer = trainer.engine.optimizer
        # DeepSpeed's ZeRO optimizers wrap the torch optimizer that holds the moments.
        while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer
        local = sum(state["exp_avg"].numel() for state in optimizer.state.values() if "exp_avg" in state)
        gathered = [torch.zeros(1, dtype=torch.float64, device=trainer.device) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, torch.tensor([local], dtype=torch.float64, device=trainer.device))
        counts = [int(t.item()) for t in gathered]
        # Partitioned (ZeRO-1..3, and DeepSpeed's bf16 optimizer at stage 0): the shares add up.
        # Replicated (plain data parallel): every rank holds all of it.
        return max(counts) if min(counts) >= trainer.parameter_counts["trainable"] else sum(counts)

    def generate_samples(self) -> None:
        """Answer each configured (prompt, image) pair with the trained weights (all ranks take part under ZeRO-3)."""

        trainer = self.trainer
        path = trainer.run.data / GENERATE_FILE
        pairs = json.loads(path.read_text()) if path.is_file() else []
        inputs = []
        for pair in pairs:
            example = self.encoder.encode(caption_messages(pair["prompt"]), [load_rgb(pair["image"])], for_generation=True)
            tensors = self.to_device({key: value[None] for key, value in example.items() if key not in ("images", "labels")})
            tensors.update(self.to_device(example["images"]))
            row = {"prompt": pair["prompt"], "image": pair["image"]}
            if "expected" in pair:
                row["expected"] = pair["expected"]
            inputs.append((tensors, row))
        if inputs:
            write_generations(self.trainer, self.tokenizer, inputs)
