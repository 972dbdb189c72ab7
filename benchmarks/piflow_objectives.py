"""Why ZeRO-Pipe refuses Kandinsky 6's pi-Flow distilled checkpoints: flow matching on data, through the policy, against pi-Flow's
imitation distillation (which needs the teacher), on a toy whose teacher is exact.

    python benchmarks/piflow_objectives.py [--points 16] [--steps 400]

A distilled Kandinsky 6 transformer gives, at the step's start ``x_src``, not a velocity but ``n_grid`` (10) predictions per
channel: ``PiflowScheduler`` reads them as a DX policy (``DXPolicy``: a grid of x0 predictions over the step, interpolated in
time; the velocity at any ``(x_t, t)`` inside the step is ``(x_t - x0(t)) / sigma_t``) and integrates it in 128 substeps
(``policy_rollout_fm``). The toy isolates the objective: the network's output at ``x_src`` is free parameters (the grid), the
data are two points, ``x0 = -1`` or ``+1``, whose flow's velocity is a formula (the teacher:
``E[x0 | x_t] = tanh(x_t (1 - sigma) / sigma^2)``, ``v = (x_t - E[x0 | x_t]) / sigma``). For each of ``--points`` noises
``x_src`` (sigma 1), the grid is fitted (Adam, ``--steps`` steps of 128 sampled times, the scheduler's shift 5 and 10 grids):

- **data**: flow matching on data through the policy, what fine-tuning on a data set can give: ``x_t`` on the data's noising
  path ``(1 - sigma) x0 + sigma x_src``, the target ``x_src - x0``, matched by ``DXPolicy.pi(x_t, sigma)``;
- **pi-ID**: pi-Flow's imitation distillation (arXiv 2510.14974): ``x_t`` on the policy's own trajectory
  (``policy_rollout_fm`` from ``x_src``, without gradient), the target the teacher's velocity there.

The figure: one ``PiflowScheduler`` step (``set_timesteps(1)``, ``step``) from each ``x_src`` with the fitted grid, its distance
to the teacher's own ODE solution from the same noise (4,096 Euler steps) and to the nearest data point; and the spread of the
grid's x0 predictions (what the policy varies over the step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from diffusers import PiflowScheduler
from diffusers.schedulers.scheduling_piflow import DXPolicy, policy_rollout_fm, shift_timesteps

N_GRID = 10
SHIFT = 5.0  # PiflowScheduler's default shift (the Kandinsky 6 distilled scheduler's)
SUBSTEPS = 128  # PiflowScheduler's num_policy_substeps


def teacher(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The exact flow velocity of data at -1 and +1 (equally likely): ``(x - E[x0 | x_t = x]) / sigma``."""
    sigma = sigma.clamp(min=1e-3)
    return (x - torch.tanh(x * (1 - sigma) / sigma**2)) / sigma


def teacher_endpoint(x_src: torch.Tensor, steps: int = 4096) -> torch.Tensor:
    """The teacher's probability-flow ODE from sigma 1 to 0 (Euler, fine)."""
    x, sigmas = x_src.clone(), torch.linspace(1, 0, steps + 1)
    for now, after in zip(sigmas[:-1], sigmas[1:]):
        x = x + (after - now) * teacher(x, now)
    return x


def policy(grid: torch.Tensor, x_src: torch.Tensor, rows: int) -> DXPolicy:
    """The scheduler's DX policy over one step from sigma 1 (raw time 1 to 0) given the network's output ``grid`` (1, N_GRID, 1)."""
    return DXPolicy(grid.expand(rows, N_GRID, 1), x_src.expand(rows, 1), torch.ones(rows, 1), torch.ones(rows), shift=SHIFT, mode="grid")


def fit(objective: str, x_src: torch.Tensor, steps: int, batch: int = 128, seed: int = 0, substeps: int = SUBSTEPS) -> torch.Tensor:
    """The grid (the network's output at ``x_src``, as velocity predictions) fitted with ``objective`` (data or pi-ID)."""
    generator = torch.Generator().manual_seed(seed)
    grid = torch.zeros(1, N_GRID, 1, requires_grad=True)
    optimizer = torch.optim.Adam([grid], lr=0.05)
    for _ in range(steps):
        raw = torch.rand(batch, 1, generator=generator) * 0.98 + 0.02
        sigma = shift_timesteps(raw, SHIFT)
        if objective == "data":
            x0 = torch.randint(0, 2, (batch, 1), generator=generator).float() * 2 - 1
            x_t, target = (1 - sigma) * x0 + sigma * x_src, x_src - x0
        else:
            with torch.no_grad():
                ones = torch.ones(batch)
                x_t, _, _ = policy_rollout_fm(x_src.expand(batch, 1), ones, ones, raw.flatten(), substeps, policy(grid.detach(), x_src, batch))
                target = teacher(x_t, sigma)
        loss = (policy(grid, x_src, batch).pi(x_t, sigma) - target).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return grid.detach()


def one_step(grid: torch.Tensor, x_src: torch.Tensor) -> torch.Tensor:
    """One PiflowScheduler step from sigma 1 with the grid as the transformer's widened output (channels-last, N_GRID x 1 channels)."""
    scheduler = PiflowScheduler(shift=SHIFT, n_grid=N_GRID)
    scheduler.set_timesteps(1)
    return scheduler.step(grid.reshape(1, N_GRID), scheduler.timesteps[0], x_src, return_dict=False)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=16)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    started = time.perf_counter()
    noises = torch.randn(args.points, 1, 1, generator=torch.Generator().manual_seed(1234))
    rows = {name: {"teacher": [], "data": [], "spread": []} for name in ("data", "pi-ID")}
    for index, x_src in enumerate(noises):
        reference = float(teacher_endpoint(x_src))
        for name in rows:
            grid = fit("data" if name == "data" else "pi-ID", x_src, args.steps, seed=index)
            drawn = float(one_step(grid, x_src))
            x0 = x_src.flatten() - grid.flatten()  # the grid's x0 predictions (sigma 1 at the step's start)
            rows[name]["teacher"].append(abs(drawn - reference))
            rows[name]["data"].append(min(abs(drawn - 1), abs(drawn + 1)))
            rows[name]["spread"].append(float(x0.max() - x0.min()))
    print(f"{args.points} noises, {args.steps} steps each, {time.perf_counter() - started:.0f} s")
    print("| objective | distance to the teacher's sample | distance to the nearest data point | spread of the grid's x0 predictions |")
    print("|---|---|---|---|")
    for name, figures in rows.items():
        cells = " | ".join(f"{statistics.mean(values):.3f} (max {max(values):.3f})" for values in figures.values())
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
