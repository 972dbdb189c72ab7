"""What runs inside one rank: setup -> train -> save_checkpoint -> cleanup.

Every rank runs this same code. Collective calls (initialize, save_checkpoint, generation
under ZeRO-3) are made by every rank; only file writes and logging are rank 0's work.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from zeropipe.checkpoint import manager
from zeropipe.config.load import load_config
from zeropipe.rundir import RunDir

log = logging.getLogger("zeropipe")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class Trainer:
    """One rank of a ZeRO-Pipe run, driven by the files the launcher wrote into the run directory."""

    def __init__(self, run_dir: str | Path):
        self.run = RunDir(run_dir)
        self.config = load_config(self.run.config)
        self.plan = self.run.read_plan()
        self.ds_config = json.loads(self.run.ds_config.read_text())
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.step = 0
        self.process = psutil.Process()

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        import deepspeed

        self.configure_logging()
        from zeropipe.metrics import MetricSinks

        # TensorBoard, W&B, MLflow: only rank 0 writes; a missing package turns its sink off.
        self.sinks = MetricSinks(self.run.path, self.config.logging, self.rank)
        if self.plan.accelerator == "cuda":
            torch.cuda.set_device(self.local_rank)
        deepspeed.init_distributed(dist_backend="nccl" if self.plan.accelerator == "cuda" else "gloo")
        self.device = torch.device("cuda", self.local_rank) if self.plan.accelerator == "cuda" else torch.device("cpu")
        # The same seed on every rank: replicas (stages 0-2) must start identical.
        seed_everything(self.config.run.seed)

        self.setup_tokenizer()
        self.setup_data()
        self.setup_model()
        self.resume()

    def configure_logging(self) -> None:
        level = logging.INFO if self.rank == 0 else logging.WARNING
        logging.basicConfig(level=level, format=f"%(asctime)s rank{self.rank} %(levelname)s %(name)s: %(message)s", force=True)
        for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        # torch's gloo wrappers warn on every collective DeepSpeed makes: noise, not news.
        from zeropipe.engine.worker import quiet_known_noise

        quiet_known_noise()

    def setup_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.run.tokenizer))

    def setup_data(self) -> None:
        from zeropipe.data.sampler import LengthGroupedSampler, ResumableDistributedSampler
        from zeropipe.data.tokenize import TokenDataset, collate

        self.micro_batch_size = self.plan.micro_batch_size
        self.accumulation = self.plan.gradient_accumulation_steps
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        data = self.config.data
        if data.packing:
            from zeropipe.data.packing import PackedDataset, collate_packed

            # The sampler deals packed sequences (built by the launcher), not examples.
            self.dataset = PackedDataset(self.run.cache)
            self.collate = partial(collate_packed, pad_token_id=pad_id)
        else:
            self.dataset = TokenDataset(self.run.cache)
            self.collate = partial(collate, pad_token_id=pad_id)
        seed = self.config.run.seed
        if data.group_by_length:
            self.sampler = LengthGroupedSampler(self.dataset.lengths(), self.rank, self.world_size, seed, self.micro_batch_size)
        else:
            self.sampler = ResumableDistributedSampler(len(self.dataset), self.rank, self.world_size, seed=seed, shuffle=True)
        # Held-out data is always evaluated padded, example by example, whatever the training batches look like.
        self.eval_dataset = TokenDataset(self.run.eval_cache) if (data.eval_path or data.eval_fraction) else None
        self.eval_collate = partial(collate, pad_token_id=pad_id)

    def setup_model(self) -> None:
        import deepspeed

        from zeropipe.models.causal_lm import build_model, count_parameters, model_config

        config = model_config(self.config.model)
        self.hf_ds_config = None
        if self.plan.zero_stage == 3:
            # transformers builds the model inside zero.Init while this object is alive.
            from transformers.integrations import HfDeepSpeedConfig

            self.hf_ds_config = HfDeepSpeedConfig(self.ds_config)
        model = build_model(self.config.model, config, self.config.deepspeed.precision, self.plan.zero_stage)
        if self.plan.zero_stage == 3:
            self.log_partitioning(model)
        trainable, total = count_parameters(model)
        log.info("model: %s parameters, %s trainable (%.2f%%)", f"{total:,}", f"{trainable:,}", 100 * trainable / max(total, 1))
        parameters = [p for p in model.parameters() if p.requires_grad]
        # DeepSpeed builds optimizer and scheduler from ds_config: no client optimizer.
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(model=model, model_parameters=parameters, config=self.ds_config)
        self.parameter_counts = {"trainable": trainable, "total": total}

    def log_partitioning(self, model) -> None:
        """Say whether construction was partitioned: under ZeRO-3 no rank may hold the full model."""
        params = list(model.parameters())
        partitioned = [p for p in params if hasattr(p, "ds_id")]
        local = sum(p.ds_tensor.numel() for p in partitioned if getattr(p, "ds_tensor", None) is not None)
        full = sum(p.ds_numel for p in partitioned)
        log.info(
            "ZeRO-3: %d of %d parameter tensors partitioned at construction; this rank holds %s of %s elements",
            len(partitioned), len(params), f"{local:,}", f"{full:,}",
        )

    def resume(self) -> None:
        tag = self.plan.resume_from
        if not tag:
            return
        load_path, client_state = self.engine.load_checkpoint(
            str(self.run.checkpoints), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {self.run.checkpoints}")
        self.step = int(client_state["step"])
        rng_file = self.run.checkpoints / tag / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            restore_rng_state(torch.load(rng_file, weights_only=False))
        log.info("resumed from %s at step %d", tag, self.step)

    # ------------------------------------------------------------------ train
    def batches(self):
        """Micro-batches from the current data position to the end of training, epoch after epoch."""
        per_epoch = self.plan.micro_batches_per_epoch
        micro_step = self.step * self.accumulation
        while True:
            epoch, position = divmod(micro_step, per_epoch)
            self.sampler.set_epoch(epoch)
            self.sampler.set_start(position * self.micro_batch_size)
            indices = list(iter(self.sampler))
            for start in range(0, per_epoch * self.micro_batch_size - position * self.micro_batch_size, self.micro_batch_size):
                chunk = indices[start : start + self.micro_batch_size]
                yield epoch, self.collate([self.dataset[i] for i in chunk])
                micro_step += 1

    def train(self) -> None:
        total = self.plan.total_steps
        save_every = self.config.train.save_every
        batches = self.batches()
        self.engine.train()
        log.info("training steps %d..%d of %d", self.step + 1, total, total)
        # A step's time runs from the end of the previous step, so that it includes the
        # metrics gathering and logging in between: tokens/s is what the run really achieves.
        previous_end = time.perf_counter()
        while self.step < total:
            loss_sum = tokens = samples = 0.0
            lr = self.current_lr()
            for _ in range(self.accumulation):
                epoch, batch = next(batches)
                loss, batch_tokens, batch_samples = self.forward_loss(batch)
                self.engine.backward(loss)
                self.engine.step()
                loss_sum += loss.detach().float().item()
                tokens += batch_tokens
                samples += batch_samples
            self.step += 1
            now = time.perf_counter()
            self.record_metrics(epoch, loss_sum / self.accumulation, lr, tokens, samples, now - previous_end)
            self.after_step()
            if save_every and self.step % save_every == 0 and self.step < total:
                self.save_checkpoint()
            # Evaluation, samples and checkpoints are not training time.
            previous_end = time.perf_counter()
        self.save_checkpoint()

    def after_step(self) -> None:
        """Work between optimizer steps (evaluation, sample images); every rank calls it."""
        every = self.config.train.eval_every
        if getattr(self, "eval_dataset", None) is not None and ((every and self.step % every == 0) or self.step == self.plan.total_steps):
            self.evaluate()

    def evaluate(self) -> dict[str, Any] | None:
        """Eval loss and perplexity on the held-out data; a collective, every rank evaluates its share."""
        import deepspeed.comm as dist

        from zeropipe.engine.evaluation import eval_batch_indices, eval_record, eval_sums

        started = time.perf_counter()
        batches = eval_batch_indices(self.eval_dataset.lengths(), self.rank, self.world_size, self.micro_batch_size)
        self.engine.eval()
        sums = eval_sums(lambda batch: self.engine(**batch, use_cache=False).loss, self.eval_dataset, batches, self.eval_collate, self.device)
        self.engine.train()
        total = torch.tensor(sums, dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        record = eval_record(self.step, *total.tolist(), time.perf_counter() - started)
        if self.rank == 0:
            record["time"] = time.time()
            with open(self.run.metrics, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            self.sinks.log(record)
            log.info("step %d eval loss %.4f perplexity %.4g (%d tokens, %.1f s)", self.step, record["eval_loss"], record["eval_perplexity"], record["eval_tokens"], record["eval_time_s"])
        return record

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, float]:
        """(loss, tokens, examples) of one micro-batch; tokens counts non-padding tokens."""
        batch = {key: value.to(self.device) for key, value in batch.items()}
        if "num_tokens" not in batch:
            return self.engine(**batch).loss, float(batch["attention_mask"].sum()), float(batch["input_ids"].shape[0])
        # Packed batches: no attention mask to count real tokens from, and several examples
        # per row; the collator counts both. transformers reads the boundaries between
        # examples from position_ids only when there is no KV cache.
        num_tokens, num_examples = batch.pop("num_tokens"), batch.pop("num_examples")
        loss = self.engine(**batch, use_cache=False).loss
        return loss, float(num_tokens), float(num_examples)

    def current_lr(self) -> float:
        # The rate this step will use: the scheduler set it on the optimizer after the last step.
        return float(self.engine.optimizer.param_groups[0]["lr"])

    def record_metrics(self, epoch: int, loss: float, lr: float, tokens: float, samples: float, step_time: float) -> None:
        """One collective per step gathers every rank's figures; rank 0 appends them to metrics.jsonl."""
        import deepspeed.comm as dist

        rss = self.process.memory_info().rss
        gpu = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        local = torch.tensor([loss, tokens, samples, rss, gpu], dtype=torch.float64, device=self.device)
        gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        if self.rank != 0:
            return
        rows = torch.stack(gathered).cpu()
        grad_norm = self.engine.get_global_grad_norm()
        record = {
            "step": self.step,
            "epoch": epoch,
            "loss": float(rows[:, 0].mean()),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "samples_per_s": float(rows[:, 2].sum()) / step_time,
            "step_time_s": step_time,
            "host_rss_bytes": [int(v) for v in rows[:, 3]],
            "time": time.time(),
        }
        if float(rows[:, 1].sum()) > 0:  # families without tokens (diffusion) report samples/s only
            record["tokens_per_s"] = float(rows[:, 1].sum()) / step_time
        record.update(self.extra_metrics())
        if self.device.type == "cuda":
            record["gpu_max_allocated_bytes"] = [int(v) for v in rows[:, 4]]
        with open(self.run.metrics, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        self.sinks.log(record)
        if self.step % self.config.train.log_every == 0 or self.step == self.plan.total_steps:
            speed = f"{record['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in record else f"{record['samples_per_s']:.2f} samples/s"
            log.info("step %d/%d loss %.4f lr %.3g grad_norm %s %s", self.step, self.plan.total_steps, record["loss"], lr, record["grad_norm"], speed)

    def extra_metrics(self) -> dict[str, Any]:
        """Family-specific fields added to every metrics row (rank 0)."""
        return {}

    def summary_fields(self) -> dict[str, Any]:
        """Family-specific fields added to summary.json (rank 0)."""
        return {}

    # ------------------------------------------------------------- checkpoint
    def save_checkpoint(self) -> None:
        """Every rank saves its shards (a collective); rank 0 then seals the checkpoint."""
        import deepspeed.comm as dist

        tag = manager.tag_for(self.step)
        if (self.run.checkpoints / tag / manager.COMPLETE_MARKER).is_file():
            return
        self.engine.save_checkpoint(str(self.run.checkpoints), tag=tag, client_state={"step": self.step}, save_latest=False)
        # Per-rank RNG: dropout and LoRA dropout must continue exactly after a resume.
        torch.save(rng_state(), self.run.checkpoints / tag / f"rng_rank{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            manager.mark_complete(self.run.path, self.step, {"world_size": self.world_size, "zero_stage": self.plan.zero_stage, "total_steps": self.plan.total_steps})
            removed = manager.prune(self.run.path, self.config.train.keep_last)
            log.info("checkpoint %s saved%s", tag, f"; removed {', '.join(removed)}" if removed else "")
        dist.barrier()

    # ------------------------------------------------------------- generation
    def generate_samples(self) -> None:
        """Answer the configured prompts with the trained weights (all ranks take part under ZeRO-3)."""
        from zeropipe.data.tokenize import render_prompt

        prompts = self.plan.generate_prompts
        if not prompts:
            return
        model = self.engine.module
        model.eval()
        results = []
        with torch.no_grad():
            for prompt in prompts:
                ids = render_prompt(self.tokenizer, [{"role": "user", "content": prompt}])
                input_ids = torch.tensor([ids], device=self.device)
                output = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=self.config.generate.max_new_tokens,
                    do_sample=False,
                    use_cache=True,
                    # Under ZeRO-3 every rank must run the same number of forward passes.
                    synced_gpus=self.plan.zero_stage == 3 and self.world_size > 1,
                    pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=self.tokenizer.eos_token_id,
                )
                answer = self.tokenizer.decode(output[0, len(ids) :], skip_special_tokens=True)
                results.append({"prompt": prompt, "output": answer.strip(), "step": self.step})
        model.train()
        if self.rank == 0:
            with open(self.run.generations, "w") as handle:
                handle.writelines(json.dumps(row) + "\n" for row in results)

    # ---------------------------------------------------------------- cleanup
    def cleanup(self) -> None:
        import deepspeed.comm as dist

        if self.rank == 0:
            rows = self.run.read_metrics()
            metrics = [row for row in rows if row.get("kind") is None]  # training steps; eval rows apart
            evals = [row for row in rows if row.get("kind") == "eval"]
            summary = {
                "steps": self.step,
                "first_loss": metrics[0]["loss"] if metrics else None,
                "final_loss": metrics[-1]["loss"] if metrics else None,
                "mean_step_time_s": float(np.mean([m["step_time_s"] for m in metrics])) if metrics else None,
                "mean_tokens_per_s": float(np.mean([m["tokens_per_s"] for m in metrics])) if metrics and "tokens_per_s" in metrics[0] else None,
                "mean_samples_per_s": float(np.mean([m["samples_per_s"] for m in metrics])) if metrics else None,
                "host_rss_peak_bytes": max((max(m["host_rss_bytes"]) for m in metrics), default=None),
                "parameters": self.parameter_counts,
                "world_size": self.world_size,
                "zero_stage": self.plan.zero_stage,
                "latest_checkpoint": manager.tag_for(self.step),
                **self.summary_fields(),
            }
            if evals:
                summary.update(final_eval_loss=evals[-1]["eval_loss"], final_eval_perplexity=evals[-1]["eval_perplexity"])
            manager.write_atomic(self.run.summary, json.dumps(summary, indent=2))
        self.sinks.close()
        dist.barrier()
        dist.destroy_process_group()

    def run_all(self) -> None:
        self.setup()
        self.train()
        self.generate_samples()
        self.cleanup()


def trainer_for(run_dir: str | Path) -> Trainer:
    """The trainer of the run's model family (causal LM, diffusion, vision-language)."""
    family = load_config(RunDir(run_dir).config).model.family
    if family == "diffusion":
        from zeropipe.engine.diffusion import DiffusionTrainer

        return DiffusionTrainer(run_dir)
    if family == "vlm":
        from zeropipe.engine.vlm import VisionLanguageTrainer

        return VisionLanguageTrainer(run_dir)
    return Trainer(run_dir)
