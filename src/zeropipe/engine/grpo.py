"""Group Relative Policy Optimization (GRPO) and TRL 1.16's loss variants, as functions a DeepSpeed rank calls.

Online reinforcement learning: for each prompt the policy samples ``num_generations``
completions (a group), reward functions score them, each completion's advantage is its reward
against its group's (``scale_rewards``), and the policy is trained with a clipped importance-
weighted objective, optionally with a KL penalty to a reference model.

The formulas are TRL 1.16's ``GRPOTrainer`` (``_generate_and_score_completions`` for the
advantages, ``_compute_loss`` for the loss and its figures), written out as functions because
TRL's trainer is a whole ``transformers.Trainer`` loop; ``tests/unit/engine/test_grpo_parity.py``
holds the loss and every figure equal to TRL's trainer's to 1e-5 from the same prompts,
completions and rewards, for every ``loss_type``.

The losses, by ``loss_type`` (TRL's names):

- ``grpo``: per-sequence token means, averaged (DeepSeekMath's GRPO);
- ``bnpo``: the token mean over the whole batch;
- ``dr_grpo``: the token sum over (sequences x ``max_completion_length``) (Dr. GRPO: no length bias);
- ``dapo`` (TRL's default): the token sum over the generation batch's tokens (all ranks together);
- ``cispo``: clipped importance-sampling weights on the log-prob (MiniMax-M1), normalised as dapo;
- ``sapo``: a soft, temperature-controlled gate instead of the clip (SAPO), normalised as grpo;
- ``luspo``: per-sequence token sums, averaged (LUSPO; meant with importance_sampling_level sequence);
- ``vespo``: gamma-shaped sequence weights on the log-prob (VESPO), normalised as dapo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


@dataclass(frozen=True)
class GRPOSettings:
    """The ``grpo:`` section's values the objective reads (``config.schema.GRPOSection``); TRL's GRPOConfig defaults."""

    loss_type: str = "dapo"
    num_generations: int = 8
    max_completion_length: int = 512
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    scale_rewards: str = "group"
    importance_sampling_level: str = "token"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    mask_truncated_completions: bool = False
    reward_weights: tuple[float, ...] | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_bias_correction_kl: bool = True

    @classmethod
    def of(cls, section: Any) -> "GRPOSettings":
        values = {name: getattr(section, name) for name in cls.__dataclass_fields__ if hasattr(section, name)}
        if values.get("reward_weights") is not None:
            values["reward_weights"] = tuple(values["reward_weights"])
        return cls(**values)

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon_high if self.epsilon_high is not None else self.epsilon


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased standard deviation ignoring NaNs (TRL's ``nanstd``)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=keepdim)
    count = torch.sum(~torch.isnan(values), dim=dim, keepdim=keepdim)
    return torch.sqrt(variance * (count / (count - 1)))


def group_advantages(
    settings: GRPOSettings, rewards_per_func: torch.Tensor, names: list[str]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each completion's advantage from its rewards, and the reward figures TRL logs.

    Args:
        rewards_per_func: (completions, reward functions), groups of ``num_generations`` consecutive
            rows; NaN where a function did not score a completion (TRL's ``None``).
        names: the reward functions' names, for ``rewards/<name>/mean`` and ``/std``.

    Returns:
        (advantages (completions,), figures as 0-d tensors).
    """
    group = settings.num_generations
    count = rewards_per_func.shape[1]
    weights = torch.tensor(settings.reward_weights or (1.0,) * count, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
    if settings.scale_rewards in ("group", "none"):
        std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0) if group > 1 else torch.zeros_like(rewards)
    elif settings.scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"unknown scale_rewards {settings.scale_rewards!r}: use group, batch or none")
    advantages = rewards - mean
    if settings.scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    figures: dict[str, torch.Tensor] = {}
    for column, name in enumerate(names):
        figures[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, column])
        figures[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, column])
    figures["reward"] = torch.nanmean(rewards)
    figures["reward_std"] = nanstd(rewards)
    figures["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean()
    return advantages, figures


def completion_figures(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's ``completions/*`` figures from each completion's length and whether it hit max_completion_length without EOS."""
    lengths = lengths.float()
    terminated = lengths[~truncated]
    if terminated.numel() == 0:
        terminated = torch.zeros(1, device=lengths.device)
    return {
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": truncated.float().mean(),
        "completions/mean_terminated_length": terminated.mean(),
        "completions/min_terminated_length": terminated.min(),
        "completions/max_terminated_length": terminated.max(),
    }


def completion_logps(logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-prob and the entropy of its distribution, from the logits that predict it.

    ``logits`` (sequences, completion length, vocabulary) are the positions that predict the
    completion's tokens (the last prompt position on); divided by the sampling temperature, as
    TRL scores completions.
    """
    logits = logits.float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    per_token = torch.gather(log_probs, -1, completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return per_token, entropy


@torch.no_grad()
def gamma_weights(settings: GRPOSettings, advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """VESPO's sequence weights phi(w) = e^lambda w^k e^(-lambda w), w the sequence's importance ratio (TRL's get_gamma_weights)."""
    lower = math.log(1e-8)
    sequence = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
    log_w = torch.clamp(sequence, lower, 20.0)
    positive = advantages >= 0
    k = torch.where(positive, settings.vespo_k_pos, settings.vespo_k_neg)
    lam = torch.where(positive, settings.vespo_lambda_pos, settings.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def grpo_loss(
    settings: GRPOSettings,
    per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    entropies: torch.Tensor,
    old_per_token_logps: torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None,
    tokens_per_rank: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of a micro-batch of completions (TRL's ``_compute_loss``) and its figures.

    Args:
        per_token_logps: (completions, length) the policy's log-probs of the completion tokens, with gradient.
        mask: (completions, length) 1 for the completion's tokens (through its EOS), 0 for padding.
        advantages: (completions,) from :func:`group_advantages`.
        entropies: (completions, length) the policy's entropy at each completion token (a figure only).
        old_per_token_logps: the sampling policy's log-probs; None: this very policy (one
            optimisation pass per generation, TRL's num_iterations 1), the ratio is 1.
        ref_per_token_logps: the reference's log-probs; needed when ``settings.beta`` > 0.
        tokens_per_rank: dapo/cispo/vespo's normaliser: the completion tokens of the whole
            generation batch (every rank's) divided by the number of ranks; default this batch's.

    Returns:
        (loss, figures): the loss is TRL's before its division by gradient accumulation (DeepSpeed's
        backward divides by it); figures are detached 0-d tensors: this micro-batch's masked means.
    """
    mask = mask.to(per_token_logps.dtype)
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    log_ratio = per_token_logps - old
    if settings.importance_sampling_level == "token":
        log_weights = log_ratio
    elif settings.importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        raise ValueError(f"unknown importance_sampling_level {settings.importance_sampling_level!r}: use token or sequence")
    coef_1 = torch.exp(log_weights)
    per_token_kl = None
    if settings.beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probs")
        difference = ref_per_token_logps - per_token_logps
        per_token_kl = torch.exp(difference) - difference - 1
        if settings.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    eps_low, eps_high = settings.epsilon_low, settings.epsilon_upper
    loss_type = settings.loss_type
    phi = None
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=eps_high).detach() * advantages * per_token_logps
    elif loss_type in CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        unclipped = torch.clamp(coef_1, max=settings.delta) if settings.delta is not None else coef_1
        per_token_loss = -torch.min(unclipped * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        temperatures = torch.where(advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
        per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    elif loss_type == "vespo":
        phi = gamma_weights(settings, advantages, log_ratio, mask)
        per_token_loss = -phi * advantages * per_token_logps
    else:
        raise ValueError(f"unknown GRPO loss_type {loss_type!r}: use one of {', '.join(LOSS_TYPES)}")
    if per_token_kl is not None:
        per_token_loss = per_token_loss + settings.beta * per_token_kl

    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * settings.max_completion_length)
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean()
    else:  # dapo, cispo, vespo
        normaliser = mask.sum() if tokens_per_rank is None else torch.as_tensor(tokens_per_rank, dtype=mask.dtype, device=mask.device)
        loss = (per_token_loss * mask).sum() / normaliser.clamp(min=1.0)

    def masked_mean(values: torch.Tensor) -> torch.Tensor:
        if values.shape[1] == 1:  # sequence-level: one value per completion
            return values.sum() / max(values.shape[0], 1)
        return (values * mask).sum() / mask.sum().clamp(min=1.0)

    def sequence_means(values: torch.Tensor) -> torch.Tensor:
        return values.squeeze(1) if values.shape[1] == 1 else (values * mask).sum(-1) / mask.sum(-1)

    figures: dict[str, torch.Tensor] = {"policy_loss": loss.detach()}
    if per_token_kl is not None:
        figures["kl"] = masked_mean(per_token_kl.detach())
    figures["entropy"] = masked_mean(entropies.detach())
    ratio = coef_1.detach()
    if loss_type in CLIPPED:
        low = ((ratio < 1 - eps_low) & (advantages < 0)).float()
        high = ((ratio > 1 + eps_high) & (advantages > 0)).float()
        region = torch.maximum(low, high)
        figures["clip_ratio/low_mean"] = masked_mean(low)
        figures["clip_ratio/high_mean"] = masked_mean(high)
        figures["clip_ratio/region_mean"] = masked_mean(region)
        # TRL's min and max over sequences ignore NaN (a sequence without tokens).
        low_seq, high_seq = sequence_means(low), sequence_means(high)
        figures["clip_ratio/low_min"] = torch.nan_to_num(low_seq, nan=math.inf).min()
        figures["clip_ratio/high_max"] = torch.nan_to_num(high_seq, nan=-math.inf).max()
    elif loss_type == "cispo":
        figures["cispo_clip_ratio"] = masked_mean(((ratio > eps_high) & (advantages > 0)).float())
    elif loss_type == "vespo":
        assert phi is not None
        figures["vespo/phi_seq_mean"] = masked_mean(phi)
    return loss, figures
