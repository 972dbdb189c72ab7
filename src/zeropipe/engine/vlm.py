"""What runs inside one rank for a vision-language model.

The base :class:`~zeropipe.engine.trainer.Trainer` drives the run (setup -> train ->
save_checkpoint -> cleanup, resume, metrics); this class supplies the VLM's pieces: the
processor saved by the launcher instead of a tokenizer, examples whose images are loaded and
processed when they are used, the model with only ``model.trainable`` parts (or their LoRA
adapters) handed to DeepSpeed, and answers about images at the end of the run.
"""

from __future__ import annotations

import json
import logging
from functools import partial

import torch

from zeropipe.engine.trainer import Trainer

log = logging.getLogger("zeropipe")


class VisionLanguageTrainer(Trainer):
    """One rank of a vision-language run."""

    def setup_tokenizer(self) -> None:
        from transformers import AutoProcessor

        from zeropipe.data.vlm import PROCESSOR_DIR

        self.processor = AutoProcessor.from_pretrained(str(self.run.path / PROCESSOR_DIR))
        self.tokenizer = self.processor.tokenizer

    def setup_data(self) -> None:
        from zeropipe.data.sampler import ResumableDistributedSampler
        from zeropipe.data.vlm import MANIFEST, VlmDataset, VlmEncoder, collate_vlm

        self.micro_batch_size = self.plan.micro_batch_size
        self.accumulation = self.plan.gradient_accumulation_steps
        self.encoder = VlmEncoder(self.processor, self.config.data.max_seq_len)
        self.dataset = VlmDataset(self.run.data / MANIFEST, self.encoder)
        self.sampler = ResumableDistributedSampler(len(self.dataset), self.rank, self.world_size, seed=self.config.run.seed, shuffle=True)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.collate = partial(collate_vlm, pad_token_id=pad_id)

    def setup_model(self) -> None:
        import deepspeed

        from zeropipe.models.causal_lm import TORCH_DTYPES, count_parameters
        from zeropipe.models.vlm import build_vlm, part_counts, trainable_parts, vlm_config

        section = self.config.model
        config = vlm_config(section)
        self.hf_ds_config = None
        if self.plan.zero_stage == 3:
            # transformers builds the model inside zero.Init while this object is alive.
            from transformers.integrations import HfDeepSpeedConfig

            self.hf_ds_config = HfDeepSpeedConfig(self.ds_config)
        model = build_vlm(section, config, self.config.deepspeed.precision, self.plan.zero_stage)
        if self.plan.zero_stage == 3:
            self.log_partitioning(model)
        trainable, total = count_parameters(model)
        parts = part_counts(model)
        log.info(
            "model: %s parameters, %s trainable (%s%s)",
            f"{total:,}",
            f"{trainable:,}",
            ", ".join(f"{part} {c['trainable']:,}/{c['total']:,}" for part, c in parts.items()),
            f"; LoRA on {', '.join(trainable_parts(section))}" if section.lora is not None else "",
        )
        # Frozen parts are not handed to DeepSpeed: no gradients, no optimizer state for them.
        parameters = [p for p in model.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(model=model, model_parameters=parameters, config=self.ds_config)
        self.compute_dtype = TORCH_DTYPES[self.config.deepspeed.precision]
        self.parameter_counts = {"trainable": trainable, "total": total, "parts": parts}

    def to_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors on the rank's device; pixel values in the model's dtype (DeepSpeed casts the weights, not the inputs)."""
        return {key: value.to(self.device, dtype=self.compute_dtype if value.is_floating_point() else value.dtype) for key, value in tensors.items()}

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, float]:
        batch = self.to_device(batch)
        loss = self.engine(**batch).loss
        return loss, float(batch["attention_mask"].sum()), float(batch["input_ids"].shape[0])

    def after_step(self) -> None:
        super().after_step()
        # Adam's moments exist from the first step on; counted once, they go into summary.json.
        if "optimizer_state_elements" not in self.parameter_counts:
            self.parameter_counts["optimizer_state_elements"] = self.optimizer_state_elements()

    def optimizer_state_elements(self) -> int:
        """Elements of Adam's first moment over all ranks: the trainable parameters (plus ZeRO's padding), frozen ones absent.

        A collective: every rank calls it.
        """
        import deepspeed.comm as dist

        optimizer = self.engine.optimizer
        # DeepSpeed's ZeRO optimizers wrap the torch optimizer that holds the moments.
        while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer
        local = sum(state["exp_avg"].numel() for state in optimizer.state.values() if "exp_avg" in state)
        gathered = [torch.zeros(1, dtype=torch.float64, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(gathered, torch.tensor([local], dtype=torch.float64, device=self.device))
        counts = [int(t.item()) for t in gathered]
        # Partitioned (ZeRO-1..3, and DeepSpeed's bf16 optimizer at stage 0): the shares add up.
        # Replicated (plain data parallel): every rank holds all of it.
        return max(counts) if min(counts) >= self.parameter_counts["trainable"] else sum(counts)

    def generate_samples(self) -> None:
        """Answer each configured (prompt, image) pair with the trained weights (all ranks take part under ZeRO-3)."""
        from zeropipe.data.vlm import GENERATE_FILE, caption_messages, load_rgb

        path = self.run.data / GENERATE_FILE
        pairs = json.loads(path.read_text()) if path.is_file() else []
        if not pairs:
            return
        model = self.engine.module
        model.eval()
        rows = []
        with torch.no_grad():
            for pair in pairs:
                example = self.encoder.encode(caption_messages(pair["prompt"]), [load_rgb(pair["image"])], for_generation=True)
                inputs = self.to_device({key: value[None] for key, value in example.items() if key not in ("images", "labels")})
                inputs.update(self.to_device(example["images"]))
                output = model.generate(
                    **inputs,
                    attention_mask=torch.ones_like(inputs["input_ids"]),
                    max_new_tokens=self.config.generate.max_new_tokens,
                    do_sample=False,
                    use_cache=True,
                    # Under ZeRO-3 every rank must run the same number of forward passes.
                    synced_gpus=self.plan.zero_stage == 3 and self.world_size > 1,
                    pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=self.tokenizer.eos_token_id,
                )
                answer = self.tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
                row = {"prompt": pair["prompt"], "image": pair["image"], "output": answer, "step": self.step}
                if "expected" in pair:
                    row["expected"] = pair["expected"]
                rows.append(row)
        model.train()
        if self.rank == 0:
            with open(self.run.generations, "w") as handle:
                handle.writelines(json.dumps(row) + "\n" for row in rows)
