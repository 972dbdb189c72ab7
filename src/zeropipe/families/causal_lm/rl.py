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
- ``num_iterations`` optimisation passes per generation (TRL's): the first step of every
  ``num_iterations`` samples each micro-batch's completions and keeps them, with the sampling
  policy's log-probs (``old``), the reference's and the advantages; the next ``num_iterations`` - 1
  steps train on the kept rounds again, the importance ratio against ``old`` clipped (TRL's
  ``_buffered_inputs``). With 1 (TRL's default) the sampling policy is the policy: the ratio is 1.
- Reference (``beta`` > 0): with LoRA the base with the adapters disabled, as DPO's
  (``preference.reference: adapters_off``); a full fine-tune's a frozen copy of ``model.path``
  built beside the policy, partitioned over the ranks under ZeRO-3 (``zero.Init``: 1/ranks of
  its weights per rank) and gathered once per generation round for its forward pass.

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
from zeropipe.engine.generation import gathered_for_generation, gathered_reference, sample_completions
from zeropipe.engine.grpo import GRPOSettings, completion_figures, completion_logps, group_advantages, grpo_loss
from zeropipe.engine.rewards import build_rewards, reward_problems
from zeropipe.engine.task import sampler_batches
from zeropipe.families.causal_lm.model import build_model
from zeropipe.families.causal_lm.prepare import data_columns, prepare_data_file, prepare_tokenizer
from zeropipe.families.causal_lm.task import CausalLMTask
from zeropipe.models.common import hidden_size_of, model_config
from zeropipe.rundir import PreparedData, RunDir

log = logging.getLogger("zeropipe")


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
    if section.beta > 0 and config.model.lora is None and not config.model.path:
        problems.append(("grpo.beta", "a full fine-tune's KL reference is a frozen copy of model.path, and this model is built from model.config: "
                         "start from a saved model (model.path), add model.lora, or set beta 0 (TRL's default)"))
    if section.beta > 0 and config.model.lora is None and section.reference == "adapters_off":
        problems.append(("grpo.reference", "adapters_off needs LoRA adapters, and this run trains every weight: set reference: auto (a frozen copy of model.path) or add model.lora"))
    if section.num_iterations > 1 and config.train.save_every and config.train.save_every % section.num_iterations:
        problems.append(("train.save_every", f"a checkpoint between the {section.num_iterations} passes over one generation cannot resume exactly "
                         f"(the kept completions are not saved): make save_every a multiple of grpo.num_iterations ({section.num_iterations})"))
    if section.loss_type == "luspo" and section.importance_sampling_level != "sequence":
        problems.append(("grpo.importance_sampling_level", "luspo is meant with sequence-level importance weights (TRL warns the same): set importance_sampling_level: sequence"))
    if section.importance_sampling_level == "sequence" and section.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        problems.append(("grpo.importance_sampling_level", f"{section.loss_type} sums per-token losses, which a sequence-level weight does not fit (TRL refuses it too): use token, or loss_type grpo"))
    return problems + reward_problems(config)


def reference_kind(config: RunConfig) -> str | None:
    """The KL reference of a GRPO run: None (beta 0), ``adapters_off`` (the LoRA base) or ``copy`` (a frozen copy of model.path)."""
    section = config.grpo
    if section is None or section.beta == 0:
        return None
    if section.reference == "copy" or (section.reference == "auto" and config.model.lora is None):
        return "copy"
    return "adapters_off"


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
    examples, passes = int(info["examples"]), config.grpo.num_iterations
    if reference_kind(config) == "copy":
        notes.append(f"grpo: the KL reference is a frozen copy of {config.model.path} (partitioned over the ranks under ZeRO-3)")
    return PreparedData(
        examples=examples,
        hidden_size=hidden_size_of(model_config(config.model)),
        # num_iterations steps train on each generation: an epoch of prompts takes that many times the steps.
        micro_batches_per_epoch=lambda micro, world_size: (examples // world_size) // micro * passes,
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


class GenerationSteps:
    """The prompts of each micro-batch of a generation step; ``None`` for a micro-batch that trains on a kept round again.

    With ``num_iterations`` k, steps 0, k, 2k... sample; the k - 1 steps after each train on the
    rounds it kept and read no prompts (TRL's ``_buffered_inputs``), so the data position moves
    only when prompts are read. A resumed run whose rounds were not kept samples afresh.
    """

    def __init__(self, inner, task: "GRPOTask"):
        self.inner, self.task, self.epoch = inner, task, 0

    position = property(lambda self: self.inner.position)

    def __iter__(self) -> "GenerationSteps":
        return self

    def __next__(self) -> tuple[int, Any]:
        task = self.task
        step, slot = divmod(task.micro_step, task.trainer.accumulation)
        if step % task.settings_passes == 0 or slot not in task.kept:
            self.epoch, batch = next(self.inner)
            return self.epoch, batch
        return self.epoch, None


class GRPOTask(CausalLMTask):
    """A causal LM trained online: it answers each prompt ``num_generations`` times and learns from the rewards."""

    def setup_data(self) -> None:
        from transformers import AutoTokenizer

        trainer = self.trainer
        self.settings = GRPOSettings.of(trainer.config.grpo)
        self.settings = GRPOSettings(**{**self.settings.__dict__, "reward_weights": tuple(r.weight for r in trainer.config.grpo.rewards)})
        self.settings_passes = trainer.config.grpo.num_iterations
        self.tokenizer = AutoTokenizer.from_pretrained(str(trainer.run.tokenizer))
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.dataset = PromptDataset(trainer.run.cache)
        self.collate = list  # prompts stay records: they are rendered and padded at generation
        self.sampler = ResumableDistributedSampler(len(self.dataset), trainer.rank, trainer.world_size, seed=trainer.config.run.seed, shuffle=True)
        self.eval_dataset = None
        self.rewards = build_rewards(trainer.config.grpo.rewards, trainer.device)
        self.step_figures: list[dict[str, torch.Tensor]] = []
        self.kept: dict[int, dict[str, Any]] = {}  # num_iterations > 1: each micro-batch slot's round, trained on again
        self.micro_step = 0

    def build_model(self) -> tuple[torch.nn.Module, dict[str, Any]]:
        model, counts = super().build_model()
        self.reference_kind = reference_kind(self.trainer.config)
        self.reference = self.build_reference() if self.reference_kind == "copy" else None
        return model, counts

    def build_reference(self) -> torch.nn.Module:
        """A full fine-tune's KL reference: model.path again, frozen; built inside zero.Init under ZeRO-3, so each rank keeps 1/ranks of it."""
        trainer = self.trainer
        section = trainer.config.model.model_copy(update={"lora": None})
        reference = build_model(section, model_config(section), trainer.config.deepspeed.precision, trainer.plan.zero_stage)
        reference.requires_grad_(False)
        reference.eval()
        held = sum(getattr(p, "ds_tensor", p).numel() for p in reference.parameters())
        log.info("KL reference: a frozen copy of %s, %s of its parameters on each rank", section.path, f"{held:,}")
        return reference

    def after_initialize(self) -> None:
        super().after_initialize()
        if self.reference is not None and self.trainer.plan.zero_stage != 3:
            self.reference.to(self.trainer.device)

    def batches(self, start_step: int):
        trainer, passes = self.trainer, self.settings_passes
        # Prompts are read only on generation steps: ceil(start_step / num_iterations) of them so far.
        generations = -(-start_step // passes)
        start = trainer.data_position or DataPosition.at_micro_step(
            generations * trainer.accumulation, trainer.plan.micro_batches_per_epoch // passes, trainer.world_size, trainer.micro_batch_size
        )
        self.micro_step = start_step * trainer.accumulation
        return GenerationSteps(sampler_batches(self.sampler, self.dataset, self.collate, trainer.micro_batch_size, start), self)

    # ---------------------------------------------------------------- one micro-batch
    def generate_round(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """Sample the group of every prompt of the micro-batch with the current weights; decode, score and weigh them.

        The round keeps what every pass over it needs: the sampling policy's log-probs
        (num_iterations > 1), the reference's (beta > 0), the advantages and the reward figures.
        """
        trainer, settings, tokenizer = self.trainer, self.settings, self.tokenizer
        pad = pad_token_id(tokenizer)
        rendered = [render_prompt(tokenizer, item["prompt"]) for item in items]
        width = max(len(ids) for ids in rendered)
        prompt_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in rendered], device=trainer.device)
        prompt_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rendered], device=trainer.device)
        seed = (trainer.config.run.seed * 1_000_003 + self.micro_step * 1009 + trainer.rank) % 2**63
        group = settings.num_generations
        round_: dict[str, Any] = {"prompt_ids": prompt_ids.repeat_interleave(group, 0), "prompt_mask": prompt_mask.repeat_interleave(group, 0),
                                  "old_logps": None, "ref_logps": None}
        with gathered_for_generation(trainer.engine, trainer.plan.zero_stage) as model:
            completions, mask, truncated = sample_completions(
                model, prompt_ids, prompt_mask, num_generations=group, max_new_tokens=settings.max_completion_length,
                temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=pad, seed=seed,
            )
            round_.update(completions=completions, mask=mask, truncated=truncated)
            # With the weights gathered anyway: the sampling policy's log-probs and the LoRA base's, one forward each.
            with torch.no_grad():
                if self.settings_passes > 1:
                    round_["old_logps"] = self.policy_logps(model, round_)[0]
                if self.reference_kind == "adapters_off":
                    with model.disable_adapter():
                        round_["ref_logps"] = self.policy_logps(model, round_)[0]
        if self.reference_kind == "copy":
            with gathered_reference(self.reference, trainer.plan.zero_stage) as reference, torch.no_grad():
                round_["ref_logps"] = self.policy_logps(reference, round_)[0]
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
        advantages, figures = group_advantages(settings, rewards, [r.name for r in self.rewards])
        figures.update(completion_figures(mask.sum(1), truncated))
        if settings.mask_truncated_completions:
            mask = mask * (~truncated).unsqueeze(1)
        round_.update(texts=texts, prompts=prompts, rewards=rewards, advantages=advantages, figures=figures, loss_mask=mask)
        return round_

    def policy_logps(self, model, round_: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.cat([round_["prompt_ids"], round_["completions"]], dim=1)
        attention = torch.cat([round_["prompt_mask"], round_["mask"]], dim=1)
        width = round_["prompt_ids"].shape[1]
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, width - 1 : -1]
        return completion_logps(logits, round_["completions"], self.settings.temperature)

    def forward_loss(self, batch: list[dict[str, Any]] | None) -> tuple[torch.Tensor, float, float]:
        import deepspeed.comm as dist

        trainer, settings = self.trainer, self.settings
        slot = self.micro_step % trainer.accumulation
        if batch is not None:
            round_ = self.generate_round(batch)
            self.write_samples(round_, round_["advantages"])
            if self.settings_passes > 1:
                self.kept[slot] = round_
        else:
            round_ = self.kept[slot]  # a later pass over a kept generation (GenerationSteps)
        mask = round_["loss_mask"]
        logps, entropies = self.policy_logps(trainer.engine, round_)
        tokens_per_rank = None
        if settings.loss_type in ("dapo", "cispo", "vespo"):
            total = mask.sum().float().reshape(1)
            if trainer.world_size > 1:
                dist.all_reduce(total)
            tokens_per_rank = total / trainer.world_size
        loss, loss_figures = grpo_loss(settings, logps, mask, round_["advantages"], entropies, round_["old_logps"], round_["ref_logps"], tokens_per_rank)
        self.step_figures.append({**round_["figures"], **loss_figures})
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
        with open(trainer.run.completions, "a") as handle:
            handle.write("".join(json.dumps(row) + "\n" for row in rows))

    def extra_metrics(self) -> dict[str, Any]:
        """The step's GRPO figures: this rank's means over its micro-batches, still on the device."""
        figures, self.step_figures = self.step_figures, []
        if not figures:
            return {}
        return {key: torch.stack([f[key].float() for f in figures]).mean() for key in figures[0] if key != "policy_loss"}
