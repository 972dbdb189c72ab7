"""The flow-map objective: LoRA training that keeps a step-distilled flow map able to jump (FLUX.3 [distilled]).

A flow map ``F(x_t, t, s)`` is a denoiser told two times: the noise level ``t`` of its input and the level ``s <= t``
it jumps to, and its output is the average velocity of that jump, ``x_s = x_t + (s - t) F(x_t, t, s)``
(``Flux3DistilledLoopDenoiser`` passes ``target_timestep`` = the next scheduler timestep and the Euler scheduler
makes exactly that step, so 16 steps land on the image). At ``s = t`` the map is the instantaneous velocity the flow
objective fits. Plain flow matching trains only that diagonal: the long jumps the distilled sampler takes are then
whatever the adapter leaves of them, and the few-step sampling drifts (the step distillation is trained away).

This objective adds the flow map's own law, that one jump equals two half jumps (the semigroup property; the
self-consistency term of shortcut models, Frans et al. 2024, "One Step Diffusion via Shortcut Models"):

- the diagonal: ``F(x_t, t, t)`` fitted to the data's velocity ``noise - x0`` (flow matching, what the adapter learns);
- the jumps: for ``s`` drawn uniformly in ``[0, t)`` and the midpoint ``m``, the model's own two half jumps taken
  without gradient, ``u1 = F(x_t, t, m)``, ``x_m = x_t + (m - t) u1``, ``u2 = F(x_m, m, s)``, give the target
  ``(u1 + u2) / 2`` that ``F(x_t, t, s)`` is fitted to, so the jumps follow what the adapted velocity field does.

The loss is the sum of both terms. The diagonal and the jump are one call of the denoiser on the micro-batch twice
(one forward with gradient), the two half jumps two calls without gradient: four times plain flow matching's
denoiser work without gradient, twice with it. The entry selects it through its call's ``loss``
(``bases/flux3.Flux3DistilledCall``); it takes no setting. ``benchmarks/flow_map.py`` measures it against plain flow
matching on a tiny flow map with an exact answer (BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Callable

import torch

Predict = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


# What the loss calls the denoiser on, per example of the micro-batch (the planner reads them from the entry's call,
# ``DenoiserCall.gradient_batch`` / ``gradient_free_batch``): the diagonal and the jump in one call with gradient on the
# micro-batch twice, and the two half jumps, each a call on the micro-batch without gradient.
GRADIENT_BATCH = 2
GRADIENT_FREE_BATCH = 2


def doubled(condition: dict[str, torch.Tensor], batch: int) -> dict[str, torch.Tensor]:
    """The conditioning of a micro-batch given twice along the batch (each tensor of ``batch`` rows repeated; others as they are)."""
    return {key: torch.cat([value, value]) if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch else value for key, value in condition.items()}


def flow_map_loss(predict: Predict, noised, condition: dict[str, torch.Tensor], jump_to: torch.Tensor | None = None) -> torch.Tensor:
    """Flow matching on the diagonal plus the jumps' self-consistency (module docstring).

    Args:
        predict: the flow map ``(latents, timesteps, target timesteps, condition) -> average velocity``, times in scheduler units.
        noised: the objective's ``NoisedBatch`` (flow: ``timesteps`` = sigma * 1000, ``target`` = noise - latents).
        jump_to: the fraction of ``t`` each example jumps to (``s = t * jump_to``), in [0, 1); drawn uniformly (this rank's
            stream) when not given.
    """
    from zeropipe.families.diffusion.objectives import weighted_mse

    latents, t = noised.model_input, noised.timesteps.float()
    batch = latents.shape[0]
    fraction = torch.rand(t.shape, dtype=torch.float32) if jump_to is None else jump_to.float()
    s = t * fraction.to(t)
    m = (t + s) / 2
    shape = (-1, *([1] * (latents.dim() - 1)))
    with torch.no_grad():  # the model's own two half jumps: the target of the whole jump, fixed
        first = predict(latents, t, m, condition).float()
        halfway = latents.float() + ((m - t) / 1000).view(shape) * first
        second = predict(halfway.to(latents.dtype), m, s, condition).float()
        jump_target = ((first + second) / 2).detach()
    both = predict(torch.cat([latents, latents]), torch.cat([t, t]), torch.cat([t, s]), doubled(condition, batch))
    diagonal, jump = both[:batch], both[batch:]
    return weighted_mse(diagonal, noised.target, noised.weights) + weighted_mse(jump, jump_target.to(jump.dtype), noised.weights)


__all__ = ["GRADIENT_BATCH", "GRADIENT_FREE_BATCH", "doubled", "flow_map_loss"]
