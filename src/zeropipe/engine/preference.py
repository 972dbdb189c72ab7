"""Preference objectives on a model's outputs: DPO and its loss variants, ORPO, CPO/SimPO, KTO and the reward model's pairwise loss.

Each function takes the policy's logits (or a reward model's scores) for a collated batch
(``data.preference.collate_pairs`` / ``collate_unpaired``: chosen rows then rejected rows,
``completion_mask`` marking the answer tokens) and the reference log-probs where the method
has one, and returns the loss and the step's figures as detached 0-d tensors on the device, so
that the trainer's deferred metrics copy them to the host only when it flushes.

The formulas are TRL 1.x's (``trl.trainer.dpo_trainer``, ``kto_trainer``, ``reward_trainer``;
``trl.experimental.orpo`` and ``cpo``), written out here because TRL's trainers are whole
``transformers.Trainer`` loops, not functions a DeepSpeed engine can call; TRL is a test
dependency only, and ``tests/unit/engine/test_preference_parity.py`` holds every loss and figure
equal to TRL's trainers' to 1e-5 from the same records.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PreferenceSettings:
    """The preference section's values the losses read (``config.schema.PreferenceSection``)."""

    method: str = "dpo"
    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float | None = None
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @classmethod
    def of(cls, section: Any) -> "PreferenceSettings":
        return cls(
            method=section.method,
            loss_type=tuple(section.loss_type),
            loss_weights=tuple(section.loss_weights) if section.loss_weights else None,
            beta=section.beta,
            label_smoothing=section.label_smoothing,
            simpo_gamma=section.simpo_gamma,
            cpo_alpha=section.cpo_alpha,
            desirable_weight=section.desirable_weight,
            undesirable_weight=section.undesirable_weight,
        )

    @property
    def uses_reference(self) -> bool:
        return self.method in ("dpo", "kto")

    @property
    def nll_weight(self) -> float:
        if self.cpo_alpha is not None:
            return self.cpo_alpha
        return 0.0 if self.method == "simpo" else 1.0


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-prob under ``logits`` (shifted: position t predicts token t+1), zero elsewhere, and the shifted mask."""
    logits = logits[:, :-1].float()
    labels = input_ids[:, 1:]
    mask = completion_mask[:, 1:].bool()
    # log_softmax gathered at the label, without materialising the whole log_softmax (TRL's selective_log_softmax).
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    per_token = picked - torch.logsumexp(logits, dim=-1)
    return per_token * mask, mask


def sequence_logps(logits: torch.Tensor, batch: dict[str, torch.Tensor], prefix: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed completion log-prob per row, per-token log-probs, shifted completion mask)."""
    per_token, mask = token_logps(logits, batch[f"{prefix}input_ids"], batch[f"{prefix}completion_mask"])
    return per_token.sum(-1), per_token, mask


def _figures(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> dict[str, torch.Tensor]:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards_chosen": chosen_rewards.mean(),
        "rewards_rejected": rejected_rewards.mean(),
        "rewards_margin": (chosen_rewards - rejected_rewards).mean(),
        "rewards_accuracy": (chosen_rewards > rejected_rewards).float().mean(),
        "logps_chosen": chosen_logps.detach().mean(),
        "logps_rejected": rejected_logps.detach().mean(),
    }


def dpo_loss(
    settings: PreferenceSettings,
    logits: torch.Tensor,
    batch: dict[str, torch.Tensor],
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (TRL's DPOTrainer, reverse KL): the weighted sum of ``settings.loss_type``'s losses, and the figures."""
    logps, per_token, mask = sequence_logps(logits, batch)
    chosen_logps, rejected_logps = logps.chunk(2)
    chosen_logratios = chosen_logps - ref_chosen
    rejected_logratios = rejected_logps - ref_rejected
    delta = chosen_logratios - rejected_logratios
    beta, smoothing = settings.beta, settings.label_smoothing
    weights = settings.loss_weights or (1.0,) * len(settings.loss_type)
    loss = logits.new_zeros((), dtype=torch.float32)
    for loss_type, weight in zip(settings.loss_type, weights, strict=True):
        if loss_type == "sigmoid":
            per_pair = -F.logsigmoid(beta * delta)
        elif loss_type == "hinge":
            per_pair = torch.relu(1 - beta * delta)
        elif loss_type == "ipo":
            # Per-token averages, as TRL does (confirmed with IPO's authors): the squared loss must not grow with length.
            chosen_count, rejected_count = batch["completion_mask"].chunk(2)
            average = chosen_logratios / chosen_count.sum(1).clamp(min=1.0) - rejected_logratios / rejected_count.sum(1).clamp(min=1.0)
            per_pair = (average - 1 / (2 * beta)) ** 2
        elif loss_type == "robust":
            per_pair = (-(1 - smoothing) * F.logsigmoid(beta * delta) + smoothing * F.logsigmoid(-beta * delta)) / (1 - 2 * smoothing)
        elif loss_type == "sft":
            # Masked sums, not boolean indexing: indexing by a mask waits for the device (its size is data).
            chosen_mask = mask.chunk(2)[0]
            per_pair = (-per_token.chunk(2)[0].sum() / chosen_mask.sum()).expand(chosen_logps.shape[0])
        else:
            raise ValueError(f"unknown DPO loss {loss_type!r}")
        loss = loss + per_pair.mean() * weight
    figures = _figures(beta * chosen_logratios, beta * rejected_logratios, chosen_logps, rejected_logps)
    return loss, figures


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (branch at -ln 2, as TRL's ORPO)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _chosen_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    rows = labels.shape[0] // 2
    return F.cross_entropy(logits[:rows, :-1].float().reshape(-1, logits.shape[-1]), labels[:rows, 1:].reshape(-1), ignore_index=-100)


def orpo_loss(settings: PreferenceSettings, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO (TRL's experimental ORPOTrainer): the chosen NLL minus beta x log-sigmoid of the log odds ratio of mean log-probs.

    As in TRL, the NLL covers the chosen row's prompt and answer (every attended token).
    """
    logps, _, mask = sequence_logps(logits, batch)
    average = logps / mask.sum(-1)
    chosen_logps, rejected_logps = average.chunk(2)
    log_odds = (chosen_logps - rejected_logps) - (_log1mexp(chosen_logps) - _log1mexp(rejected_logps))
    ratio = F.logsigmoid(log_odds)
    nll = _chosen_nll(logits, batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))
    loss = nll - (settings.beta * ratio).mean()
    figures = _figures(settings.beta * chosen_logps, settings.beta * rejected_logps, chosen_logps, rejected_logps)
    figures.update(nll_loss=nll.detach(), log_odds_ratio=ratio.detach().mean(), log_odds_chosen=log_odds.detach().mean())
    return loss, figures


def cpo_loss(settings: PreferenceSettings, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CPO and SimPO (TRL's experimental CPOTrainer, loss_type sigmoid or simpo): reference-free, plus cpo_alpha x the chosen NLL."""
    logps, _, mask = sequence_logps(logits, batch)
    if settings.method == "simpo":
        logps = logps / mask.sum(-1)  # SimPO's length-normalised reward
    chosen_logps, rejected_logps = logps.chunk(2)
    margin = chosen_logps - rejected_logps
    if settings.method == "simpo":
        margin = margin - settings.simpo_gamma / settings.beta
    beta, smoothing = settings.beta, settings.label_smoothing
    losses = -F.logsigmoid(beta * margin) * (1 - smoothing) - F.logsigmoid(-beta * margin) * smoothing
    alpha = settings.nll_weight
    nll = _chosen_nll(logits, batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)) if alpha else losses.new_zeros(())
    loss = losses.mean() + alpha * nll
    figures = _figures(beta * chosen_logps, beta * rejected_logps, chosen_logps, rejected_logps)
    figures["nll_loss"] = nll.detach()
    return loss, figures


def kto_loss(
    settings: PreferenceSettings,
    logits: torch.Tensor,
    batch: dict[str, torch.Tensor],
    ref_logps: torch.Tensor,
    kl_logps: torch.Tensor,
    ref_kl_logps: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO (TRL's KTOTrainer, loss_type kto): desirable and undesirable completions against the batch's KL estimate.

    ``kl_logps`` are the policy's log-probs (without gradient) of the KL rows, each prompt with
    another example's completion; the KL term is their mean log-ratio, clamped at zero. The
    rewards are averaged over the desirable and the undesirable examples apart.
    """
    logps, _, _ = sequence_logps(logits, batch)
    labels = batch["label"].bool()
    kl = (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    logratios = logps - ref_logps
    # One loss per example, by its label (TRL concatenates the two groups: the same mean). Selected with
    # where and masked sums, not boolean indexing, which waits for the device to learn the groups' sizes.
    chosen_losses = settings.desirable_weight * (1 - torch.sigmoid(settings.beta * (logratios - kl)))
    rejected_losses = settings.undesirable_weight * (1 - torch.sigmoid(settings.beta * (kl - logratios)))
    loss = torch.where(labels, chosen_losses, rejected_losses).mean()
    rewards = settings.beta * logratios.detach()
    desirable, undesirable = labels.float(), (~labels).float()
    chosen_count, rejected_count = desirable.sum().clamp(min=1), undesirable.sum().clamp(min=1)
    chosen_rewards = (rewards * desirable).sum() / chosen_count
    rejected_rewards = (rewards * undesirable).sum() / rejected_count
    figures = {
        "rewards_chosen": chosen_rewards,
        "rewards_rejected": rejected_rewards,
        "rewards_margin": chosen_rewards - rejected_rewards,
        "logps_chosen": (logps.detach() * desirable).sum() / chosen_count,
        "logps_rejected": (logps.detach() * undesirable).sum() / rejected_count,
        "kl": kl,
    }
    return loss, figures


def reward_loss(scores: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A reward model's pairwise (Bradley-Terry) loss on its scores of chosen rows then rejected rows (TRL's RewardTrainer)."""
    scores = scores.float().reshape(-1)
    chosen, rejected = scores.chunk(2)
    loss = -F.logsigmoid(chosen - rejected).mean()
    detached = scores.detach()
    return loss, {
        "rewards_accuracy": (chosen > rejected).float().mean().detach(),
        "rewards_margin": (chosen - rejected).mean().detach(),
        "rewards_chosen": chosen.detach().mean(),
        "rewards_rejected": rejected.detach().mean(),
        "min_reward": detached.min(),
        "mean_reward": detached.mean(),
        "max_reward": detached.max(),
    }


def policy_loss(
    settings: PreferenceSettings, logits: torch.Tensor, batch: dict[str, torch.Tensor], reference: tuple[torch.Tensor, ...] | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The paired methods' loss: DPO with ``reference`` = (chosen, rejected) log-probs, or ORPO / CPO / SimPO without."""
    if settings.method == "dpo":
        assert reference is not None
        return dpo_loss(settings, logits, batch, *reference)
    if settings.method == "orpo":
        return orpo_loss(settings, logits, batch)
    return cpo_loss(settings, logits, batch)


# ---------------------------------------------------------------------- what every family's preference task shares
REFERENCE_FILE = "reference_logps.npy"


def reference_mode(config: Any) -> str | None:
    """Where a run's reference log-probs come from: adapters_off, precomputed, or None (a method without a reference)."""
    section = config.preference
    if section is None or section.method not in ("dpo", "kto"):
        return None
    if section.reference != "auto":
        return section.reference
    return "adapters_off" if config.model.lora is not None else "precomputed"


def preference_section_problems(config: Any) -> list[tuple[str, str]]:
    """(key, message with the fix) for a ``preference:`` section that cannot work in any family; checked before any process starts."""
    section = config.preference
    if section is None:
        return []
    problems = []
    for key in ("packing", "mixture", "eval_path", "eval_fraction", "synthetic"):
        if getattr(config.data, key):
            problems.append((f"data.{key}", f"preference tuning reads pairs from data.path and does not use data.{key}: remove it"))
    if section.loss_weights is not None and len(section.loss_weights) != len(section.loss_type):
        problems.append(("preference.loss_weights", f"{len(section.loss_weights)} weights for {len(section.loss_type)} losses {section.loss_type}: give one weight per loss"))
    if section.method != "dpo" and section.loss_type != ["sigmoid"]:
        problems.append(("preference.loss_type", f"loss_type chooses DPO's losses; method {section.method} has its own: remove loss_type or use method dpo"))
    if reference_mode(config) == "adapters_off" and config.model.lora is None:
        problems.append(("preference.reference", "adapters_off needs model.lora (the reference is the base with the adapters disabled): use precomputed, or add model.lora"))
    if section.label_smoothing and not ({"robust"} & set(section.loss_type) or section.method in ("cpo", "simpo")):
        problems.append(("preference.label_smoothing", "label smoothing applies to DPO's robust loss and to CPO/SimPO: add robust to loss_type, or remove it"))
    return problems


class PreferenceObjective:
    """The preference part of a family's rank task: the reference model, the loss of a micro-batch and the step's figures.

    Mixed into a family's task (the causal LM's, the VLM's) ahead of it, so that the same
    reference (LoRA adapters off, or log-probs precomputed once by the ranks) and losses serve
    every family; the family supplies its data (``self.dataset``: items with an ``index``,
    ``self.collate``: ``collate_pairs``' layout plus whatever else its model reads),
    ``self.settings``, ``self.reference_mode``, and how a batch becomes logits
    (:meth:`logits`) and moves to the device (:meth:`batch_to_device`).
    """

    reference: torch.Tensor | None = None  # precomputed: (examples, 2) log-probs
    step_figures: list[dict[str, torch.Tensor]]

    def logits(self, model, batch: dict[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
        """The model's logits for a collated batch: each family's task supplies it (the causal LM's, the VLM's)."""
        raise NotImplementedError(f"{type(self).__name__} mixes in PreferenceObjective without defining logits(model, batch, prefix)")

    def batch_to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: value.to(self.device) for key, value in batch.items()}

    def after_initialize(self) -> None:
        """Precomputed reference log-probs: read back, or computed now, from the starting weights (a resume loads later)."""
        import numpy as np

        if self.reference_mode != "precomputed":
            return
        path = self.run.cache / REFERENCE_FILE
        if not path.is_file():
            if self.plan.resume_from:
                raise RuntimeError(f"{path} is missing: a resumed run cannot recompute the reference from trained weights; start the run again")
            self.compute_reference(path)
        self.reference = torch.from_numpy(np.load(path)).to(self.device)

    def compute_reference(self, path) -> None:
        """Every example's reference log-probs, each rank a share (the same number of forward passes: under ZeRO-3 each gathers weights)."""
        from pathlib import Path

        import deepspeed.comm as dist
        import numpy as np

        count, world, rank = len(self.dataset), self.world_size, self.rank
        per_rank = -(-count // world)
        mine = [(rank + world * i) % count for i in range(per_rank)]  # a short last share repeats examples: equal passes
        rows = []
        model = self.engine.module
        model.eval()
        with torch.no_grad():
            for start in range(0, per_rank, self.micro_batch_size):
                indices = mine[start : start + self.micro_batch_size]
                batch = self.batch_to_device(self.collate([self.dataset[i] for i in indices]))
                first, second = self.reference_pass(model, batch)
                rows.append(torch.stack([batch["index"].double(), first.double(), second.double()], dim=1))
        model.train()
        local = torch.cat(rows)
        gathered = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        table = torch.cat(gathered).cpu().numpy()
        values = np.zeros((count, 2), dtype=np.float32)
        values[table[:, 0].astype(np.int64)] = table[:, 1:]
        if rank == 0:
            partial = Path(path).with_suffix(".partial.npy")
            partial.parent.mkdir(parents=True, exist_ok=True)  # a VLM run has no pair cache there
            np.save(partial, values)
            partial.replace(path)
            logging.getLogger("zeropipe").info("reference log-probs of %d examples computed from the starting weights (%s)", count, path)
        dist.barrier()

    def reference_pass(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference log-probs of a batch: (chosen, rejected) per pair, or (completion, KL row) per KTO example."""
        logps = sequence_logps(self.logits(model, batch), batch)[0]
        if "label" not in batch:  # paired
            return logps.chunk(2)
        return logps, sequence_logps(self.logits(model, batch, "KL_"), batch, "KL_")[0]

    def reference_of(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reference is not None:
            values = self.reference[batch["index"]]
            return values[:, 0], values[:, 1]
        model = self.engine.module
        with torch.no_grad(), model.disable_adapter():
            return self.reference_pass(model, batch)

    def preference_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of a micro-batch already on the device; its figures kept for the step's metrics."""
        settings = self.settings
        if settings.method == "reward":
            loss, figures = reward_loss(self.logits(self.engine, batch))
        elif settings.method == "kto":
            ref_logps, ref_kl = self.reference_of(batch)
            with torch.no_grad():
                kl_logps = sequence_logps(self.logits(self.engine.module, batch, "KL_"), batch, "KL_")[0]
            loss, figures = kto_loss(settings, self.logits(self.engine, batch), batch, ref_logps, kl_logps, ref_kl)
        else:
            reference = self.reference_of(batch) if settings.uses_reference else None
            loss, figures = policy_loss(settings, self.logits(self.engine, batch), batch, reference)
        figures["preference_loss"] = loss.detach()
        self.step_figures.append(figures)
        return loss

    def extra_metrics(self) -> dict[str, Any]:
        """The step's preference figures: this rank's means over its micro-batches, still on the device."""
        figures, self.step_figures = self.step_figures, []
        if not figures:
            return {}
        return {key: torch.stack([f[key].float() for f in figures]).mean() for key in figures[0] if key != "preference_loss"}
