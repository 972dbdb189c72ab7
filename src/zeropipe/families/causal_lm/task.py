"""The causal language model's part of a rank: token cache, model, loss, held-out evaluation and answers."""

from __future__ import annotations

import json
import logging
import time
from functools import partial
from typing import Any

import torch

from zeropipe.data.packing import PackedDataset, collate_packed
from zeropipe.data.sampler import DataPosition, LengthGroupedSampler, ResumableDistributedSampler
from zeropipe.data.token_cache import TokenDataset, collate
from zeropipe.data.tokenize import pad_token_id, render_prompt
from zeropipe.engine.task import TaskDefaults, sampler_batches, write_generations
from zeropipe.families.causal_lm.evaluation import eval_batch_indices, eval_record, eval_sums
from zeropipe.families.causal_lm.model import build_model
from zeropipe.models.common import count_parameters, hf_zero3_config, log_partitioning, model_config
from zeropipe.models.moe import configure_moe, mark_zero3_leaves, moe_shape, router_figures, tokens_per_expert

log = logging.getLogger("zeropipe")


class CausalLMTask(TaskDefaults):
    """Examples (or packed sequences) from the launcher's token cache, trained with the model's own LM loss."""

    def setup_data(self) -> None:
        from transformers import AutoTokenizer

        trainer = self.trainer
        self.tokenizer = AutoTokenizer.from_pretrained(str(trainer.run.tokenizer))
        pad_id = pad_token_id(self.tokenizer)
        data = trainer.config.data
        if data.packing:

            # The sampler deals packed sequences (built by the launcher), not examples.
            self.dataset = PackedDataset(trainer.run.cache)
            self.collate = partial(collate_packed, pad_token_id=pad_id)
        else:
            self.dataset = TokenDataset(trainer.run.cache)
            self.collate = partial(collate, pad_token_id=pad_id)
        self.pad_id = pad_id
        seed = trainer.config.run.seed
        # Sequence parallelism: the ranks of a group read the same micro-batch (data rank = rank // N).
        if data.group_by_length:
            self.sampler = LengthGroupedSampler(self.dataset.lengths(), trainer.data_rank, trainer.data_world, seed, trainer.micro_batch_size)
        else:
            self.sampler = ResumableDistributedSampler(len(self.dataset), trainer.data_rank, trainer.data_world, seed=seed, shuffle=True)
        # Held-out data is always evaluated padded, example by example, whatever the training batches look like.
        self.eval_dataset = TokenDataset(trainer.run.eval_cache) if (data.eval_path or data.eval_fraction) else None
        self.eval_collate = partial(collate, pad_token_id=pad_id)

    def build_model(self) -> tuple[torch.nn.Module, dict[str, Any]]:

        trainer = self.trainer
        section = trainer.config.model
        config = model_config(section)
        # A mixture of experts: the router's auxiliary loss in the model's loss, the experts' kernel (models.moe).
        for note in configure_moe(config, section.router_aux_loss_coef, section.experts_implementation):
            log.info("%s", note)
        self.moe = moe_shape(config)
        self.router_sums: dict[str, torch.Tensor] = {}
        self.router_count, self.logged_routing = 0, False
        # Alive for the whole run: transformers builds the model inside zero.Init, and generate() under ZeRO-3 needs it too.
        self.hf_ds_config = hf_zero3_config(trainer.ds_config, trainer.plan.zero_stage)
        model = build_model(section, config, trainer.config.deepspeed.precision, trainer.plan.zero_stage, activation_offload=trainer.config.train.activation_offload)
        if trainer.sequence_parallel > 1:
            from zeropipe.families.causal_lm import sequence_parallel

            # DeepSpeed's Ulysses attention in place of the model's, and the groups: the mpu deepspeed.initialize takes.
            trainer.mpu = sequence_parallel.register(model, section.attn_implementation, trainer.sequence_parallel, trainer.micro_batch_size)
            log.info("sequence parallelism: groups of %d ranks share each sample's tokens; %d data-parallel ranks", trainer.sequence_parallel, trainer.data_world)
        self.choose_loss(model)
        if trainer.plan.zero_stage == 3:
            log_partitioning(model)
        if trainer.plan.zero_stage == 3 and section.zero3_leaf_blocks:
            # Before deepspeed.initialize, which installs the fetch hooks: each MoE block is gathered whole, whatever the router chose.
            leaves = mark_zero3_leaves(model)
            if leaves:
                log.info("ZeRO-3 leaf modules (each gathered whole): %s", ", ".join(leaves))
        trainable, total = count_parameters(model)
        log.info("model: %s parameters, %s trainable (%.2f%%)", f"{total:,}", f"{trainable:,}", 100 * trainable / max(total, 1))
        return model, {"trainable": trainable, "total": total}

    def choose_loss(self, model: torch.nn.Module) -> None:
        """parallel.tiled_loss: the LM loss tile by tile (families/causal_lm/tiled_loss.py) or the model's own; said in the run log."""
        from zeropipe.errors import ConfigError
        from zeropipe.families.causal_lm import tiled_loss

        trainer = self.trainer
        parallel, data = trainer.config.parallel, trainer.config.data
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        # The longest micro-batch one rank holds: micro_batch_size sequences of max_seq_len tokens, 1/N of them under sequence parallelism.
        local_tokens = trainer.micro_batch_size * -(-data.max_seq_len // trainer.sequence_parallel)
        self.loss_tile, self.lm_head, self.loss_zero3 = 0, None, False
        if type(self).forward_loss is not CausalLMTask.forward_loss:
            # Preference tuning and GRPO take per-sequence log-probabilities from the logits: their own loss, untiled.
            if parallel.tiled_loss is True:
                raise ConfigError("parallel.tiled_loss: true tiles the causal-LM loss only; preference tuning and GRPO compute their own. Set parallel.tiled_loss: auto or false.")
            return
        try:
            self.loss_tile, sentence = tiled_loss.choose(parallel.tiled_loss, parallel.loss_tile_tokens, local_tokens, int(getattr(config, "vocab_size", 0) or 0), model)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        self.lm_head = model.get_output_embeddings() if self.loss_tile else None
        if self.loss_tile:
            tiled_loss.mark_tied(model)
        # Under ZeRO-3 each head call gathers its weight over all ranks: every rank must make the same number of calls.
        self.loss_zero3 = trainer.plan.zero_stage == 3
        log.info("%s", sentence)

    def tiled_model_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's mean token loss, as the model's own loss computes it (sum over labelled tokens / their count), tiled."""
        from zeropipe.families.causal_lm import tiled_loss

        device = self.trainer.device
        inputs = {key: value.to(device) for key, value in batch.items()}
        total, labelled = tiled_loss.token_loss_sum(self.trainer.engine, self.lm_head, self.loss_tile, self.loss_zero3, **inputs)
        return total / labelled.clamp(min=1).to(total.dtype)

    def batches(self, start_step: int):
        trainer = self.trainer
        # Where a resumed run stands in its data, for all ranks together: it may have had another rank count.
        start = trainer.data_position or DataPosition.at_micro_step(
            start_step * trainer.accumulation, trainer.plan.micro_batches_per_epoch, trainer.data_world, trainer.micro_batch_size
        )
        return sampler_batches(self.sampler, self.dataset, self.collate, trainer.micro_batch_size, start)

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, float]:
        """(loss, tokens, examples) of one micro-batch; tokens counts non-padding tokens."""
        engine, device = self.trainer.engine, self.trainer.device
        if self.trainer.sequence_parallel > 1:
            return self.sequence_parallel_loss(batch)
        # Tokens and examples are counted on the host batch, before it moves: a count read
        # back from the device would make the step wait for it.
        if "num_tokens" not in batch:
            tokens, examples = float(batch["attention_mask"].sum()), float(batch["input_ids"].shape[0])
            if getattr(self, "loss_tile", 0):
                return self.tiled_model_loss(batch), tokens, examples
            output = engine(**{key: value.to(device) for key, value in batch.items()})
            return self.keep_router_figures(output), tokens, examples
        # Packed batches: no attention mask to count real tokens from, and several examples
        # per row; the collator counts both. transformers reads the boundaries between
        # examples from position_ids only when there is no KV cache.
        batch = dict(batch)
        tokens, examples = float(batch.pop("num_tokens")), float(batch.pop("num_examples"))
        if getattr(self, "loss_tile", 0):
            return self.tiled_model_loss(batch), tokens, examples
        output = engine(**{key: value.to(device) for key, value in batch.items()}, use_cache=False)
        return self.keep_router_figures(output), tokens, examples

    def keep_router_figures(self, output) -> torch.Tensor:
        """The loss of a forward; a mixture of experts' router losses kept for the step's metrics."""
        if getattr(self, "moe", None) is None:
            return output.loss
        figures = router_figures(output)
        for name, value in figures.items():
            self.router_sums[name] = self.router_sums.get(name, 0.0) + value
        self.router_count += 1
        if not self.logged_routing:
            self.logged_routing = True
            self.log_routing(output)
        return output.loss

    def log_routing(self, output) -> None:
        """Where each rank's first batch sent its tokens (the first MoE layer): ranks differ, the case ZeRO-3 leaves are for.

        A collective, once: every rank's first micro-batch reaches it.
        """
        import deepspeed.comm as dist

        trainer = self.trainer
        counts = tokens_per_expert(output, self.moe.experts, self.moe.active).to(trainer.device)
        gathered = [torch.zeros_like(counts) for _ in range(trainer.world_size)]
        dist.all_gather(gathered, counts)
        for rank, rank_counts in enumerate(gathered):
            log.info("tokens per expert, rank %d's first batch (first MoE layer): %s", rank, rank_counts.tolist())

    def extra_metrics(self) -> dict[str, Any]:
        if getattr(self, "moe", None) is None or not self.router_count:
            return {}
        # This rank's mean over the step's micro-batches (rank 0's, as the other task figures).
        figures = {name: value / self.router_count for name, value in self.router_sums.items()}
        self.router_sums, self.router_count = {}, 0
        return figures

    def sequence_parallel_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, float]:
        """This rank's share of the group's micro-batch; tokens and examples counted on the group's first rank only."""
        from zeropipe.families.causal_lm import sequence_parallel

        trainer = self.trainer
        batch = dict(batch)
        if "num_tokens" in batch:
            tokens, examples = float(batch.pop("num_tokens")), float(batch.pop("num_examples"))
        else:
            tokens, examples = float(batch["attention_mask"].sum()), float(batch["input_ids"].shape[0])
        shard = sequence_parallel.shard_batch(batch, trainer.sequence_parallel, trainer.sp_rank, self.pad_id)
        tiled = (self.lm_head, self.loss_tile, self.loss_zero3) if getattr(self, "loss_tile", 0) else None
        loss, group_mean = sequence_parallel.group_loss(trainer.engine, shard, trainer.mpu.get_sequence_parallel_group(), trainer.device, trainer.plan.zero_stage, tiled)
        self.reported_loss = group_mean
        counted = trainer.sp_rank == 0
        return loss, tokens if counted else 0.0, examples if counted else 0.0

    def after_step(self) -> None:
        trainer = self.trainer
        every = trainer.config.train.eval_every
        if self.eval_dataset is not None and ((every and trainer.step % every == 0) or trainer.step == trainer.plan.total_steps):
            self.evaluate()

    def evaluate(self) -> dict[str, Any] | None:
        """Eval loss and perplexity on the held-out data; a collective, every rank evaluates its share."""
        import deepspeed.comm as dist

        trainer = self.trainer
        started = time.perf_counter()
        batches = eval_batch_indices(self.eval_dataset.lengths(), trainer.rank, trainer.world_size, trainer.micro_batch_size)
        trainer.engine.eval()
        # parallel.tiled_loss holds for held-out batches too (whole sequences on each rank, even under sequence parallelism).
        if getattr(self, "loss_tile", 0):
            loss_of = self.tiled_model_loss
        else:
            loss_of = lambda batch: trainer.engine(**batch, use_cache=False, **self.eval_kwargs()).loss  # noqa: E731
        sums = eval_sums(loss_of, self.eval_dataset, batches, self.eval_collate, trainer.device)
        trainer.engine.train()
        total = torch.tensor(sums, dtype=torch.float64, device=trainer.device)
        dist.all_reduce(total)
        record = eval_record(trainer.step, *total.tolist(), time.perf_counter() - started)
        if trainer.rank == 0:
            record["time"] = time.time()
            with open(trainer.run.metrics, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            trainer.sinks.log(record)
            log.info("step %d eval loss %.4f perplexity %.4g (%d tokens, %.1f s)", trainer.step, record["eval_loss"], record["eval_perplexity"], record["eval_tokens"], record["eval_time_s"])
        return record

    def eval_kwargs(self) -> dict[str, Any]:
        # Held-out loss and perplexity are the LM's alone: the router's auxiliary loss stays out.
        return {"output_router_logits": False} if getattr(self, "moe", None) is not None else {}

    def generate_samples(self) -> None:
        """Answer the configured prompts with the trained weights (all ranks take part under ZeRO-3)."""

        trainer = self.trainer
        prompts = trainer.plan.generate_prompts
        if not prompts:
            return
        inputs = []
        for prompt in prompts:
            ids = render_prompt(self.tokenizer, [{"role": "user", "content": prompt}])
            inputs.append(({"input_ids": torch.tensor([ids], device=trainer.device)}, {"prompt": prompt}))
        with trainer.sampling_weights():  # train.ema.sample_from_ema: the answers of the EMA weights
            write_generations(trainer, self.tokenizer, inputs)
