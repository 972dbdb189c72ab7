"""Does the flow-map objective keep a step-distilled flow map's few-step sampling? Against plain flow matching.

    python benchmarks/flow_map.py [--seeds 3] [--steps 600]

A tiny flow map whose exact answer is known, in 2 dimensions: for data ``x0 ~ N(mu, s^2 I)`` and the flow
``x_t = (1 - t) x0 + t noise``, the marginal at t is ``N((1 - t) mu, ((1 - t)^2 s^2 + t^2) I)`` and the probability-flow
ODE moves a point affinely between marginals, so the exact map ``x_t -> x_s`` (and its average velocity
``(x_s - x_t) / (s - t)``) is a formula.

1. The teacher: an MLP ``F(x, t, s)`` (the two times as FLUX.3 [distilled]'s transformer takes them) fitted to the exact
   map of data A (``mu = (2, -1), s = 0.5``): a step-distilled flow map of A.
2. Fine-tuning on data B (``mu = (-1, 2), s = 0.8``), the same steps, batches and noise for both objectives: once with
   plain flow matching (the map's diagonal ``F(x, t, t)`` fitted to ``noise - x0``, as a plain LoRA trains it), once with
   ``parts.flow_map.flow_map_loss`` (the code the trainer runs: the diagonal plus the jumps' self-consistency).

The figure: sampling B with the fine-tuned map in 1, 2 and 4 Euler steps of the map (``x_s = x_t + (s - t) F``, as
``Flux3DistilledLoopDenoiser`` and the scheduler step), the mean squared distance of the samples to where B's exact map
takes the same noise, relative to B's variance; and the diagonal's error against B's exact velocity.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from torch import nn

from zeropipe.families.diffusion.objectives import weighted_mse
from zeropipe.families.diffusion.parts.flow_map import flow_map_loss

DIM = 2
A = (torch.tensor([2.0, -1.0]), 0.5)
B = (torch.tensor([-1.0, 2.0]), 0.8)


def marginal(data, t):
    mu, s = data
    return (1 - t)[:, None] * mu, torch.sqrt((1 - t) ** 2 * s**2 + t**2)[:, None]


def exact_jump(data, x, t, s):
    """Where the probability-flow ODE of ``data`` takes x from t to s (affine between the Gaussian marginals)."""
    mean_t, std_t = marginal(data, t)
    mean_s, std_s = marginal(data, s)
    return mean_s + std_s / std_t * (x - mean_t)


def exact_velocity(data, x, t, s):
    tau = (s - t)[:, None]
    safe = torch.where(tau.abs() < 1e-4, torch.full_like(tau, -1e-4), tau)
    return (exact_jump(data, x, t, t + safe[:, 0]) - x) / safe


class FlowMap(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM + 2, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(), nn.Linear(128, DIM))

    def forward(self, x, t, s):
        return self.net(torch.cat([x, t[:, None], s[:, None]], dim=1))


def distill_teacher(seed: int, steps: int = 3000) -> FlowMap:
    torch.manual_seed(seed)
    model = FlowMap()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for _ in range(steps):
        t = torch.rand(256)
        s = t * torch.rand(256) * (torch.rand(256) > 0.1)  # a tenth of the jumps go all the way to 0
        mean, std = marginal(A, t)
        x = mean + std * torch.randn(256, DIM)
        loss = ((model(x, t, s) - exact_velocity(A, x, t, s)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def fine_tune(teacher: FlowMap, objective: str, seed: int, steps: int) -> FlowMap:
    model = FlowMap()
    model.load_state_dict(teacher.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-4)
    generator = torch.Generator().manual_seed(seed)

    def predict(latents, t, s, condition):  # times in scheduler units, as the entry's call takes them
        return model(latents, t / 1000, s / 1000)

    for _ in range(steps):
        mu, std = B
        x0 = mu + std * torch.randn(128, DIM, generator=generator)
        noise = torch.randn(128, DIM, generator=generator)
        t = torch.rand(128, generator=generator)
        noised = SimpleNamespace(model_input=(1 - t)[:, None] * x0 + t[:, None] * noise, timesteps=t * 1000, target=noise - x0, weights=None)
        if objective == "flow":
            loss = weighted_mse(predict(noised.model_input, noised.timesteps, noised.timesteps, {}), noised.target, None)
        else:
            loss = flow_map_loss(predict, noised, {}, torch.rand(128, generator=generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


@torch.no_grad()
def sample_error(model: FlowMap, steps: int, seed: int) -> float:
    noise = torch.randn(4096, DIM, generator=torch.Generator().manual_seed(seed + 100))
    times = torch.linspace(1.0, 0.0, steps + 1)
    x = noise
    for t, s in zip(times[:-1], times[1:]):
        x = x + (s - t) * model(x, t.expand(len(x)), s.expand(len(x)))
    # the exact sample: B's map from t = 1 (a hair below, where the marginal is pure noise) to 0
    exact = exact_jump(B, noise, torch.full((len(x),), 1 - 1e-6), torch.zeros(len(x)))
    return float(((x - exact) ** 2).sum(dim=1).mean() / (DIM * B[1] ** 2))


@torch.no_grad()
def diagonal_error(model: FlowMap, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed + 200)
    t = torch.rand(4096, generator=generator) * 0.98 + 0.01
    mean, std = marginal(B, t)
    x = mean + std * torch.randn(4096, DIM, generator=generator)
    return float(((model(x, t, t) - exact_velocity(B, x, t, t)) ** 2).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    start = time.time()
    rows = {name: {"1": [], "2": [], "4": [], "diag": []} for name in ("teacher", "flow", "flow-map")}
    for seed in range(args.seeds):
        teacher = distill_teacher(seed)
        for name, model in (("teacher", teacher), ("flow", fine_tune(teacher, "flow", seed, args.steps)), ("flow-map", fine_tune(teacher, "flow-map", seed, args.steps))):
            for steps in (1, 2, 4):
                rows[name][str(steps)].append(sample_error(model, steps, seed))
            rows[name]["diag"].append(diagonal_error(model, seed))
    print(f"{args.seeds} seeds, {args.steps} fine-tuning steps of 128, {time.time() - start:.0f} s")
    print("| model | 1-step error | 2-step error | 4-step error | diagonal error |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        cells = [f"{statistics.mean(row[key]):.4f} ({', '.join(f'{v:.4f}' for v in row[key])})" for key in ("1", "2", "4", "diag")]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
