"""Online reinforcement learning of a causal LM (``grpo:`` in the run config): the launcher's prompts and the rank task.

The task is the causal LM's (same model building, LoRA, ZeRO-3, checkpoints, resume) with
another micro-batch: ``train.micro_batch_size`` prompts per rank, each answered
``grpo.num_generations`` times by the policy itself, the completions scored by the reward
functions (``engine.rewards``), each group's advantages computed and the policy trained with
GRPO's clipped objective (``engine.grpo``, TRL 1.16's formulas and loss variants).

- Generation: the whole model gathered once per micro-batch and sampled with DeepSpeed's hooks
  off (``engine.generation``): no collective inside generate, so ranks never wait on each other
  there. Each rank samples from a generator seeded by (run seed, micro-step, rank), so a
  resumed run samples what the uninterrupted one would have.
- A group lives on one rank: its advantages need no communication. ``scale_rewards: batch``
  scales by the rank's micro-batch (TRL: the generation batch of all ranks). dapo/cispo/vespo
  divide by the micro-step's completion tokens of all ranks over the rank count (one all-reduce
  of a number), as TRL divides by its generation batch's.
- One optimisation pass per generation (TRL's ``num_iterations`` 1, its default): the sampling
  policy is the policy, the importance ratio is 1 in value and the clip figures are 0.
- Reference (``beta`` > 0): the base with the LoRA adapters disabled, as DPO's
  (``preference.reference: adapters_off``); a full fine-tune's reference copy is not built yet.

Metrics per step (this rank's means over its micro-batches): ``reward``, ``reward_std``,
``rewards/<name>/mean`` and ``/std``, ``frac_reward_zero_std``, ``kl``, ``entropy``,
``clip_ratio/*``, ``completions/*`` (TRL's names). Every ``grpo.samples_every`` steps rank 0
appends its first prompt's completions, rewards and advantages to ``RUN/completions.jsonl``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from zeropipe.config.schema import RunConfig
from zeropipe.data.records import iter_records
from zeropipe.data.rl import read_prompts, write_prompts
from zeropipe.data.sampler import DataPosition, ResumableDistributedSampler
from zeropipe.data.tokenize import pad_token_id, render_prompt
from zeropipe.engine.generation import gathered_for_generation, sample_completions
from zeropipe.engine.grpo import GRPOSettings, completion_figures, completion_logps, group_advantages, grpo_loss
from zeropipe.engine.rewards import build_rewards, reward_problems
from zeropipe.engine.task import sampler_batches
from zeropipe.families.causal_lm.prepare import data_columns, prepare_data_file, prepare_tokenizer
from zeropipe.families.causal_lm.task import CausalLMTask
from zeropipe.models.common import hidden_size_of, model_config
from zeropipe.rundir import PreparedData, RunDir

log = logging.getLogger("zeropipe")
COMPLETIONS_FILE = "completions.jsonl"


def grpo_problems(config: RunConfig) -> list[tuple[str, str]]:
    """(key, message with the fix) for a GRPO run that cannot work; checked before any process starts."""
    section = config.grpo
    if section is None:
        return []
    problems = []
    if config.preference is not None:
        problems.append(("grpo", "a run is either preference tuning or GRPO: remove preference or grpo"))
    for key in ("packing", "mixture", "eval_path", "eval_fraction"):
        if getattr(config.data, key):
            problems.append((f"data.{key}", f"GRPO reads prompts from data.path and does not use data.{key}: remove it"))
    if section.beta > 0 and config.model.lora is None:
        problems.append(("grpo.beta", "a KL reference is the base with the LoRA adapters off, and this run trains every weight: add model.lora, or set beta 0 (TRL's default)"))
    if section.loss_type == "luspo" and section.importance_sampling_level != "sequence":
        problems.append(("grpo.importance_sampling_level", "luspo is meant with sequence-level importance weights (TRL warns the same): set importance_sampling_level: sequence"))
    if section.importance_sampling_level == "sequence" and section.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        problems.append(("grpo.importance_sampling_level", f"{section.loss_type} sums per-token losses, which a sequence-level weight does not fit (TRL refuses it too): use token, or loss_type grpo"))
    return problems + reward_problems(config)


def prepare_grpo_data(config: RunConfig, run: RunDir, reuse: bool) -> PreparedData:
    """The prompt records read into ``RUN/cache/prompts.jsonl`` and the run's tokenizer."""
    records_path = prepare_data_file(config, run)
    info = write_prompts(iter_records(records_path, data_columns(config, records_path)), config.data.format, run.cache)
    prompts = read_prompts(run.cache)

    def texts():
        for row in prompts:
            yield " ".join(turn["content"] for turn in row["prompt"]) + (" " + row["answer"] if row["answer"] else "")

    tokenizer = prepare_tokenizer(config, run, records_path, reuse, texts=texts)
    notes = [f"grpo ({config.grpo.loss_type}): {info['examples']} prompts ({info['with_answers']} with answers) from {records_path}, "
             f"{config.grpo.num_generations} completions each of up to {config.grpo.max_completion_length} tokens; "
             f"rewards: {', '.join(r.name or r.function or r.kind for r in config.grpo.rewards)}"]
    if info["bad_record_count"]:
        shown = ", ".join(f"line {b.get('line')}: {b.get('reason')}" for b in info["bad_records"][:3])
        notes.append(f"skipped {info['bad_record_count']} record(s) without a prompt in {records_path} ({shown})")
    if config.model.config is not None and config.model.config.get("vocab_size") in (None, "auto"):
        config.model.config = {**config.model.config, "vocab_size": len(tokenizer)}
        notes.append(f"model.config.vocab_size = {len(tokenizer)} (from the tokenizer)")
    examples = int(info["examples"])
    return PreparedData(
        examples=examples,
        hidden_size=hidden_size_of(model_config(config.model)),
        micro_batches_per_epoch=lambda micro, world_size: (examples // world_size) // micro,
        prompts=list(config.generate.prompts or []),
        notes=notes,
    )


class PromptDataset:
    def __init__(self, cache: Path):
        self.rows = read_prompts(cache)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.rows[index], "index": index}


class GRPOTask(CausalLMTask):
    """A causal LM trained online: it answers each prompt ``num_generations`` times and learns from the rewards."""

    def setup_data(self) -> None:
        from transformers import AutoTokenizer

        trainer = self.trainer
        self.settings = GRPOSettings.of(trainer.config.grpo)
        self.settings = GRPOSettings(**{**self.settings.__dict__, "reward_weights": tuple(r.weight for r in trainer.config.grpo.rewards)})
        self.tokenizer = AutoTokenizer.from_pretrained(str(trainer.run.tokenizer))
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.dataset = PromptDataset(trainer.run.cache)
        self.collate = list  # prompts stay records: they are rendered and padded at generation
        self.sampler = ResumableDistributedSampler(len(self.dataset), trainer.rank, trainer.world_size, seed=trainer.config.run.seed, shuffle=True)
        self.eval_dataset = None
        self.rewards = build_rewards(trainer.config.grpo.rewards, trainer.device)
        self.step_figures: list[dict[str, torch.Tensor]] = []
        self.micro_step = 0

    def batches(self, start_step: int):
        trainer = self.trainer
        start = trainer.data_position or DataPosition.at_micro_step(
            start_step * trainer.accumulation, trainer.plan.micro_batches_per_epoch, trainer.world_size, trainer.micro_batch_size
        )
        self.micro_step = start_step * trainer.accumulation
        return sampler_batches(self.sampler, self.dataset, self.collate, trainer.micro_batch_size, start)

    # ---------------------------------------------------------------- one micro-batch
    def generate_round(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """Sample the group of every prompt of the micro-batch with the current weights; decode and score them."""
        trainer, settings, tokenizer = self.trainer, self.settings, self.tokenizer
        pad = pad_token_id(tokenizer)
        rendered = [render_prompt(tokenizer, item["prompt"]) for item in items]
        width = max(len(ids) for ids in rendered)
        prompt_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in rendered], device=trainer.device)
        prompt_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rendered], device=trainer.device)
        seed = (trainer.config.run.seed * 1_000_003 + self.micro_step * 1009 + trainer.rank) % 2**63
        with gathered_for_generation(trainer.engine, trainer.plan.zero_stage) as model:
            completions, mask, truncated = sample_completions(
                model, prompt_ids, prompt_mask, num_generations=settings.num_generations, max_new_tokens=settings.max_completion_length,
                temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=pad, seed=seed,
            )
        group = settings.num_generations
        texts = tokenizer.batch_decode(completions.masked_fill(mask == 0, pad).tolist(), skip_special_tokens=True)
        expanded = [item for item in items for _ in range(group)]
        prompts = [next((t["content"] for t in reversed(item["prompt"]) if t["role"] == "user"), "") for item in expanded]
        fields: dict[str, list] = {"answer": [item.get("answer") for item in expanded]}
        for key in {key for item in items for key in item.get("fields", {})} - {"answer"}:
            fields[key] = [item.get("fields", {}).get(key) for item in expanded]
        columns = []
        for reward in self.rewards:
            values = reward.function(prompts=prompts, completions=texts, **fields)
            columns.append([float("nan") if v is None else float(v) for v in values])
        rewards = torch.tensor(columns, dtype=torch.float32, device=trainer.device).T.reshape(len(texts), len(self.rewards))
        return {"prompt_ids": prompt_ids.repeat_interleave(group, 0), "prompt_mask": prompt_mask.repeat_interleave(group, 0),
                "completions": completions, "mask": mask, "truncated": truncated, "texts": texts, "prompts": prompts, "rewards": rewards}

    def policy_logps(self, model, round_: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.cat([round_["prompt_ids"], round_["completions"]], dim=1)
        attention = torch.cat([round_["prompt_mask"], round_["mask"]], dim=1)
        width = round_["prompt_ids"].shape[1]
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, width - 1 : -1]
        return completion_logps(logits, round_["completions"], self.settings.temperature)

    def forward_loss(self, batch: list[dict[str, Any]]) -> tuple[torch.Tensor, float, float]:
        import deepspeed.comm as dist

        trainer, settings = self.trainer, self.settings
        round_ = self.generate_round(batch)
        mask = round_["mask"]
        if settings.mask_truncated_completions:
            mask = mask * (~round_["truncated"]).unsqueeze(1)
        advantages, figures = group_advantages(settings, round_["rewards"], [r.name for r in self.rewards])
        figures.update(completion_figures(round_["mask"].sum(1), round_["truncated"]))
        ref_logps = None
        if settings.beta:
            model = trainer.engine.module
            with torch.no_grad(), model.disable_adapter():
                ref_logps = self.policy_logps(model, round_)[0]
        logps, entropies = self.policy_logps(trainer.engine, round_)
        tokens_per_rank = None
        if settings.loss_type in ("dapo", "cispo", "vespo"):
            total = mask.sum().float().reshape(1)
            if trainer.world_size > 1:
                dist.all_reduce(total)
            tokens_per_rank = total / trainer.world_size
        loss, loss_figures = grpo_loss(settings, logps, mask, advantages, entropies, None, ref_logps, tokens_per_rank)
        figures.update(loss_figures)
        self.step_figures.append(figures)
        self.write_samples(round_, advantages)
        self.micro_step += 1
        tokens = float(round_["prompt_mask"].sum() + round_["mask"].sum())
        return loss, tokens, float(len(round_["texts"]))

    def write_samples(self, round_: dict[str, Any], advantages: torch.Tensor) -> None:
        trainer = self.trainer
        every = trainer.config.grpo.samples_every
        # The first micro-batch of a step that will be numbered step + 1.
        if trainer.rank != 0 or not every or (trainer.step + 1) % every or self.micro_step % trainer.accumulation:
            return
        group = self.settings.num_generations
        rows = []
        for index in range(group):
            rewards = {reward.name: (None if value != value else value) for reward, value in zip(self.rewards, round_["rewards"][index].tolist(), strict=True)}
            rows.append({"step": trainer.step + 1, "prompt": round_["prompts"][index], "completion": round_["texts"][index],
                         "rewards": rewards, "advantage": float(advantages[index])})
        with open(trainer.run.path / COMPLETIONS_FILE, "a") as handle:
            handle.write("".join(json.dumps(row) + "\n" for row in rows))

    def extra_metrics(self) -> dict[str, Any]:
        """The step's GRPO figures: this rank's means over its micro-batches, still on the device."""
        figures, self.step_figures = self.step_figures, []
        if not figures:
            return {}
        return {key: torch.stack([f[key].float() for f in figures]).mean() for key in figures[0] if key != "policy_loss"}
