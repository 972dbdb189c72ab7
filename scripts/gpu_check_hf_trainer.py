"""gpu-check's baseline: transformers' Trainer on a run directory ZeRO-Pipe prepared (``torchrun ... RUN_DIR OUT.json``).

The same model (built from the run's config, seeded), the same token cache and collator, the
same DeepSpeed JSON (its optimizer and scheduler left to the Trainer, which refuses values
that disagree with its own arguments), the same micro-batch, accumulation and steps.
Rank 0 writes the tokens per second of the steps after the first ten.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

from zeropipe.data.token_cache import TokenDataset, collate
from zeropipe.rundir import RunDir

WARMUP_STEPS = 10


def main() -> int:
    run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    run = RunDir(run_dir)
    config = run.read_config()  # config.yaml with learned.json (the vocabulary size)
    plan = run.read_plan()
    ds_config = {k: v for k, v in run.read_ds_config().items() if k not in ("optimizer", "scheduler")}
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "tokenizer"))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dataset = TokenDataset(run_dir / "cache")
    fields = dict(config.model.config)
    torch.manual_seed(config.run.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    tokens_seen = [0]

    def collator(examples):
        batch = collate(examples, pad_token_id=pad_id)
        tokens_seen[0] += int(batch["attention_mask"].sum())
        return batch

    class Timer(TrainerCallback):
        started = tokens_at_start = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == WARMUP_STEPS:
                torch.cuda.synchronize()
                Timer.started, Timer.tokens_at_start = time.perf_counter(), tokens_seen[0]

    args = TrainingArguments(
        output_dir=str(run_dir.parent / "hf-trainer-output"),
        per_device_train_batch_size=plan.micro_batch_size,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
        max_steps=plan.total_steps,
        learning_rate=config.train.lr,
        warmup_steps=config.train.warmup_steps,
        lr_scheduler_type="cosine",
        bf16=config.deepspeed.precision == "bf16",
        deepspeed=ds_config,
        logging_steps=plan.total_steps,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=config.run.seed,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[Timer()])
    trainer.train()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - Timer.started
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    local = torch.tensor([tokens_seen[0] - Timer.tokens_at_start], dtype=torch.float64, device="cuda")
    if world > 1:
        torch.distributed.all_reduce(local)
    if int(torch.distributed.get_rank() if world > 1 else 0) == 0:
        out.write_text(json.dumps({"tokens_per_s": float(local) / elapsed, "steps_timed": plan.total_steps - WARMUP_STEPS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
