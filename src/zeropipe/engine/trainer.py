"""What runs inside one rank: setup -> train -> save_checkpoint -> cleanup.

Every rank runs this same code. Collective calls (initialize, save_checkpoint, generation
under ZeRO-3) are made by every rank; only file writes and logging are rank 0's work.
What depends on the model family (data, model, loss, evaluation, samples) is the
:class:`~zeropipe.engine.task.RankTask` the trainer holds; the loop, the DeepSpeed engine,
checkpoints, resume and metrics are here, the same for every family.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import psutil
import torch

from zeropipe.checkpoint import manager
from zeropipe.data.sampler import DataPosition
from zeropipe.engine.ds_ops import fast_op_loads
from zeropipe.engine.optimizers import build_client_optimizer
from zeropipe.engine.ema import EmaWeights
from zeropipe.engine.task import RankTask
from zeropipe.metrics import MetricSinks
from zeropipe.models.checkpointing import offload_counter
from zeropipe.rundir import RunDir

log = logging.getLogger("zeropipe")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(cuda: Any = torch.cuda) -> dict[str, Any]:
    """Every generator a step draws from; on GPUs the CUDA generators too (dropout masks are drawn there)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if cuda.is_available():
        state["cuda"] = cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any], cuda: Any = torch.cuda) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and cuda.is_available():
        # Device by device: a resume on a machine with fewer visible GPUs restores those it has.
        for device, generator in enumerate(state["cuda"][: cuda.device_count()]):
            cuda.set_rng_state(generator, device)


@dataclass
class PendingStep:
    """One step's figures on this rank, kept (the tensors on the device) until the next flush of metrics."""

    step: int
    epoch: int
    loss: torch.Tensor | float
    lr: float
    tokens: float
    samples: float
    step_time: float
    rss: int
    gpu: int
    reserved: int
    grad_norm: torch.Tensor | float | None
    time: float
    extra: dict[str, Any]


def host_value(value: Any) -> Any:
    """A task's extra figure as JSON: a 0-d tensor kept on the device until the flush becomes a float."""
    if isinstance(value, torch.Tensor):
        return float(value)
    return value


class Trainer:
    """One rank of a ZeRO-Pipe run, driven by the files the launcher wrote into the run directory.

    Args:
        run_dir: the run directory the launcher prepared.
        make_task: builds the family's :class:`RankTask` for this trainer.
    """

    def __init__(self, run_dir: str | Path, make_task: Callable[["Trainer"], RankTask]):
        self.run = RunDir(run_dir)
        self.config = self.run.read_config()
        self.plan = self.run.read_plan()
        self.ds_config = self.run.read_ds_config()
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.micro_batch_size = self.plan.micro_batch_size
        # Sequence parallelism (parallel.sequence_parallel_size): groups of N consecutive ranks share one
        # sample's tokens; the data is dealt over world / N ranks. The family sets mpu (DeepSpeed's groups).
        self.sequence_parallel = self.config.parallel.sequence_parallel_size
        self.data_world = self.world_size // self.sequence_parallel
        self.data_rank, self.sp_rank = divmod(self.rank, self.sequence_parallel)
        self.mpu = None
        self.accumulation = self.plan.gradient_accumulation_steps
        self.step = 0
        # Where a resumed run starts in its data, counted for the whole run (the launcher read it
        # from the checkpoint); None: the beginning, or a family that counts in steps.
        self.data_position = DataPosition.from_dict(self.plan.resume_data_position) if self.plan.resume_data_position else None
        self.batches = None
        self.ema: EmaWeights | None = None  # train.ema's, made once the engine exists (setup_model)
        self.pending_metrics: list[PendingStep] = []
        self.samples_asked = False  # the UI asked for samples: seen by rank 0 at the last flush, known to every rank
        self.process = psutil.Process()
        self.task = make_task(self)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        import deepspeed

        self.configure_logging()

        # TensorBoard, W&B, MLflow: only rank 0 writes; a missing package turns its sink off.
        self.sinks = MetricSinks(self.run.path, self.config.logging, self.rank)
        if self.plan.accelerator == "cuda":
            torch.cuda.set_device(self.local_rank)
        with fast_op_loads():  # DeepSpeed's CPU collective op, built once, imported without torch's build step (engine.ds_ops)
            deepspeed.init_distributed(dist_backend="nccl" if self.plan.accelerator == "cuda" else "gloo")
        self.device = torch.device("cuda", self.local_rank) if self.plan.accelerator == "cuda" else torch.device("cpu")
        # The same seed on every rank: replicas (stages 0-2) must start identical.
        seed_everything(self.config.run.seed)

        self.task.setup_data()
        self.setup_model()
        self.resume()

    def configure_logging(self) -> None:
        level = logging.INFO if self.rank == 0 else logging.WARNING
        logging.basicConfig(level=level, format=f"%(asctime)s rank{self.rank} %(levelname)s %(name)s: %(message)s", force=True)
        for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        # torch's gloo wrappers warn on every collective DeepSpeed makes: noise, not news.
        from zeropipe.engine.noise import quiet_known_noise

        quiet_known_noise()

    def setup_model(self) -> None:
        import deepspeed

        model, self.parameter_counts = self.task.build_model()
        lora = self.config.model.lora
        if lora is not None and lora.init_from and not self.plan.resume_from:
            # model.lora.init_from: the adapters start from the user's file, before DeepSpeed takes them (a resume's checkpoint has them).
            from zeropipe.models.adapter_init import load_initial_adapter

            loaded = load_initial_adapter(model, lora.init_from, original_layout=getattr(self.task, "original_lora_layout", None))
            log.info("LoRA starts from %s (%s layout, %d modules; its strength over the run's folded into lora_B: %s)", loaded["path"], loaded["layout"], loaded["modules"], loaded["strength_folded_into_lora_B"])
        # train.activation_offload: the bytes its hooks copy to host RAM, reported per step in metrics.jsonl.
        self.activation_offload = offload_counter(model)
        parameters = [p for p in model.parameters() if p.requires_grad]
        # DeepSpeed builds the optimizer from ds_config when it knows it (AdamW, Muon, Adafactor) and
        # always the scheduler; bitsandbytes' AdamW8bit and Prodigy are handed over built (engine.optimizers).
        client = build_client_optimizer(self.config.train, parameters)
        with fast_op_loads():  # CPU Adam, FusedAdam...: as in setup
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, model_parameters=parameters, optimizer=client, config=self.ds_config, mpu=self.mpu
            )
        # train.ema: this rank's EMA of its own partition of the trained weights (engine/ema.py).
        self.ema = EmaWeights.for_engine(self.engine, self.config.train.ema) if self.config.train.ema else None
        self.task.after_initialize()

    def resume(self) -> None:
        tag = self.plan.resume_from
        if not tag:
            return
        # A checkpoint saved by another number of ranks is read from its universal copy
        # (ds_config.json then has checkpoint.load_universal, set by the launcher).
        load_dir = manager.universal_dir(self.run.path) if self.plan.resume_universal else self.run.checkpoints
        from zeropipe.checkpoint import safeload

        safeload.install()  # DeepSpeed's checkpoint readers load tensors and its own records only, never code (issue 46)
        load_path, client_state = self.engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {tag} from {load_dir}")
        self.step = int(client_state["step"])
        # On more ranks than saved it, the new ranks keep the seed's streams.
        rng_file = self.run.checkpoints / tag / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            restore_rng_state(safeload.load(rng_file))
        if self.ema is not None:
            self.ema.load(self.run.checkpoints / tag, self.rank, self.world_size)
        log.info("resumed from %s at step %d%s", tag, self.step, f" (its universal copy, on {self.world_size} ranks)" if self.plan.resume_universal else "")

    # ------------------------------------------------------------------ train
    def train(self) -> None:
        total = self.plan.total_steps
        save_every = self.config.train.save_every
        batches = self.batches = self.task.batches(self.step)
        self.engine.train()
        log.info("training steps %d..%d of %d", self.step + 1, total, total)
        # A step's time runs from the end of the previous step's own work, so that it includes
        # the previous step's metrics gathering and logging: tokens/s is what the run really
        # achieves. Evaluation, samples and checkpoints (after_step, save) are not training time.
        previous_end = time.perf_counter()
        while self.step < total:
            epoch, loss, lr, tokens, samples = self.train_step(batches)
            now = time.perf_counter()
            self.record_metrics(epoch, loss, lr, tokens, samples, now - previous_end)
            recorded = time.perf_counter()
            self.task.after_step()
            if self.samples_asked:
                self.samples_asked = False
                self.sample_now()
            if save_every and self.step % save_every == 0 and self.step < total:
                self.save_checkpoint()
            previous_end = now + (time.perf_counter() - recorded)
        self.save_checkpoint()

    def sampling_weights(self):
        """The weights samples are drawn with: the EMA's inside the block with train.ema.sample_from_ema, else the trained ones. A collective."""
        import contextlib

        if self.ema is not None and self.config.train.ema.sample_from_ema:
            return self.ema.in_module(self.engine)
        return contextlib.nullcontext()

    def sample_now(self) -> None:
        """Every rank draws the run's samples (answers) with the current weights; rank 0 then removes the request.

        The UI asks by writing ``RUN/sample_request.json``. Sampling is a collective under ZeRO
        (every rank runs the partitioned model), so no rank decides alone from a file it sees at
        a slightly different time: rank 0 looks when the metrics are flushed and its answer
        travels with the flush's one collective (:meth:`flush_metrics`), so asking costs the
        steps between flushes nothing.
        """
        log.info("step %d: samples asked for from the UI", self.step)
        self.task.generate_samples()
        if self.rank == 0:
            self.run.sample_request.unlink(missing_ok=True)

    def train_step(self, batches: Iterator[tuple[int, Any]]) -> tuple[int, torch.Tensor, float, float, float]:
        """One optimizer step over ``accumulation`` micro-batches from ``batches``.

        Returns:
            (epoch, mean loss, learning rate, tokens, samples) of the step, this rank's; the
            loss stays a tensor on the device (float64: the sum a Python float would give),
            so that the step waits for no device work to finish.
        """
        loss_sum: torch.Tensor | float = 0.0
        tokens = samples = 0.0
        lr = self.current_lr()
        for _ in range(self.accumulation):
            epoch, batch = next(batches)
            loss, batch_tokens, batch_samples = self.task.forward_loss(batch)
            self.engine.backward(loss)
            self.engine.step()
            # Under sequence parallelism a rank's loss is its shard's part; the task keeps the group's mean.
            reported = getattr(self.task, "reported_loss", None) if self.sequence_parallel > 1 else None
            loss_sum = loss_sum + (reported if reported is not None else loss.detach().double())
            tokens += batch_tokens
            samples += batch_samples
        self.step += 1
        if self.ema is not None and self.step % self.config.train.ema.every == 0:
            self.ema.update()  # after the accumulation boundary: the optimizer has stepped
        return epoch, loss_sum / self.accumulation, lr, tokens, samples

    def current_lr(self) -> float:
        # The rate this step will use: the scheduler set it on the optimizer after the last step.
        return float(self.engine.optimizer.param_groups[0]["lr"])

    def record_metrics(self, epoch: int, loss: torch.Tensor | float, lr: float, tokens: float, samples: float, step_time: float) -> None:
        """Keep this step's figures; every ``log_every`` steps (and before a checkpoint and at the end) write them all.

        A step that does not log copies nothing from the device and makes no collective: its
        loss (and grad norm, and the task's extra figures) stay tensors until the flush, which
        gathers every rank's figures of all pending steps in one collective and one host copy.
        metrics.jsonl still gets a row for every step, written at the flush.
        """
        # The caching allocator's own counters (host-side, no sync): allocated is what tensors hold,
        # reserved what the allocator took from the driver (what nvidia-smi and an OOM see).
        gpu = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        reserved = torch.cuda.max_memory_reserved(self.device) if self.device.type == "cuda" else 0
        grad_norm = self.engine.get_global_grad_norm()
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.detach().clone()  # DeepSpeed may reuse the tensor next step
        self.pending_metrics.append(
            PendingStep(
                step=self.step,
                epoch=epoch,
                loss=loss,
                lr=lr,
                tokens=tokens,
                samples=samples,
                step_time=step_time,
                rss=self.process.memory_info().rss,
                gpu=gpu,
                reserved=reserved,
                grad_norm=grad_norm,
                time=time.time(),
                extra=self.task.extra_metrics() | self.offload_figures(),
            )
        )
        if self.step % self.config.train.log_every == 0 or self.step >= self.plan.total_steps:
            self.flush_metrics()

    def offload_figures(self) -> dict[str, int]:
        """Bytes activation offload copied to host RAM this step (each copy comes back once in backward): the planner's host-link term."""
        counter = getattr(self, "activation_offload", None)
        if counter is None:
            return {}
        moved, counter.bytes = counter.bytes, 0
        return {"activation_offload_bytes": moved}

    def flush_metrics(self) -> None:
        """One collective gathers every rank's pending steps; rank 0 appends their rows to metrics.jsonl.

        Every rank calls it at the same steps (a function of the step number), with the same
        number of pending steps.
        """
        import deepspeed.comm as dist

        pending, self.pending_metrics = self.pending_metrics, []
        if not pending:
            return
        losses = torch.stack([torch.as_tensor(p.loss, dtype=torch.float64, device=self.device) for p in pending])
        asked = float(self.rank == 0 and self.run.sample_request.is_file())
        figures = torch.tensor([[p.tokens, p.samples, p.rss, p.gpu, asked, p.reserved] for p in pending], dtype=torch.float64).to(self.device)
        local = torch.cat([losses.reshape(-1, 1), figures], dim=1)  # steps x (loss, tokens, samples, rss, gpu, samples asked, gpu reserved)
        gathered = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        if self.rank != 0:
            self.samples_asked = bool(gathered[0][-1, 5].item())  # rank 0's answer, read where it is read anyway: at the flush
            return
        table = torch.stack(gathered).cpu()  # ranks x steps x figures: the flush's one host copy
        self.samples_asked = bool(asked)
        lines = []
        for number, p in enumerate(pending):
            rows = table[:, number, :]
            record = {
                "step": p.step,
                "epoch": p.epoch,
                "loss": float(rows[:, 0].mean()),
                "lr": p.lr,
                "grad_norm": float(p.grad_norm) if p.grad_norm is not None else None,
                "samples_per_s": float(rows[:, 2].sum()) / p.step_time,
                "step_time_s": p.step_time,
                "host_rss_bytes": [int(v) for v in rows[:, 3]],
                "time": p.time,
            }
            if float(rows[:, 1].sum()) > 0:  # families without tokens (diffusion) report samples/s only
                record["tokens_per_s"] = float(rows[:, 1].sum()) / p.step_time
            record.update({key: host_value(value) for key, value in p.extra.items()})
            if self.device.type == "cuda":
                record["gpu_max_allocated_bytes"] = [int(v) for v in rows[:, 4]]
                record["gpu_max_reserved_bytes"] = [int(v) for v in rows[:, 6]]
            lines.append(record)
        with open(self.run.metrics, "a") as handle:
            handle.write("".join(json.dumps(record) + "\n" for record in lines))
        for record in lines:
            self.sinks.log(record)
        record = lines[-1]
        speed = f"{record['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in record else f"{record['samples_per_s']:.2f} samples/s"
        log.info("step %d/%d loss %.4f lr %.3g grad_norm %s %s", record["step"], self.plan.total_steps, record["loss"], record["lr"], record["grad_norm"], speed)

    # ------------------------------------------------------------- checkpoint
    def save_checkpoint(self) -> None:
        """Every rank saves its shards (a collective); rank 0 then seals the checkpoint."""
        import deepspeed.comm as dist

        self.flush_metrics()  # the rows of every step the checkpoint holds
        tag = manager.tag_for(self.step)
        if (self.run.checkpoints / tag / manager.COMPLETE_MARKER).is_file():
            return
        # The data position for all ranks together, so that a resume on another rank count continues it.
        position = getattr(self.batches, "position", None)
        client_state = {"step": self.step}
        if position is not None:
            client_state["data_position"] = position.to_dict()
        self.engine.save_checkpoint(str(self.run.checkpoints), tag=tag, client_state=client_state, save_latest=False)
        # Per-rank RNG: dropout and LoRA dropout must continue exactly after a resume.
        torch.save(rng_state(), self.run.checkpoints / tag / f"rng_rank{self.rank}.pt")
        if self.ema is not None:
            self.ema.save(self.run.checkpoints / tag, self.rank, self.world_size)
        dist.barrier()
        if self.rank == 0:
            meta = {
                "world_size": self.world_size,
                "zero_stage": self.plan.zero_stage,
                "total_steps": self.plan.total_steps,
                "micro_batch_size": self.micro_batch_size,
                "gradient_accumulation_steps": self.accumulation,
            }
            if self.sequence_parallel > 1:
                meta["sequence_parallel_size"] = self.sequence_parallel
            if position is not None:
                meta["data_position"] = position.to_dict()
            manager.mark_complete(self.run.path, self.step, meta)
            removed = manager.prune(self.run.path, self.config.train.keep_last)
            log.info("checkpoint %s saved%s", tag, f"; removed {', '.join(removed)}" if removed else "")
        dist.barrier()

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
                # The largest rank's peaks on its GPU (CUDA runs): what the plan's per-GPU figure is compared with.
                "gpu_max_allocated_peak_bytes": max((max(m["gpu_max_allocated_bytes"]) for m in metrics if m.get("gpu_max_allocated_bytes")), default=None),
                "gpu_max_reserved_peak_bytes": max((max(m["gpu_max_reserved_bytes"]) for m in metrics if m.get("gpu_max_reserved_bytes")), default=None),
                "parameters": self.parameter_counts,
                "world_size": self.world_size,
                "zero_stage": self.plan.zero_stage,
                "latest_checkpoint": manager.tag_for(self.step),
                **self.task.summary_fields(),
            }
            if evals:
                summary.update(final_eval_loss=evals[-1]["eval_loss"], final_eval_perplexity=evals[-1].get("eval_perplexity"))  # a diffusion run's validation loss has none
            manager.write_atomic(self.run.summary, json.dumps(summary, indent=2))
        self.sinks.close()
        dist.barrier()
        dist.destroy_process_group()

    def run_all(self) -> None:
        self.setup()
        self.task.before_train()
        self.train()
        self.task.after_train()
        self.task.generate_samples()
        self.cleanup()
