"""Does the guidance-preserving objective keep a guidance-distilled teacher's guided output? Against plain flow matching.

    python benchmarks/guidance_preserving.py [--seeds 3] [--steps 400] [--scale 4]

A tiny guidance-distilled teacher, made here in three stages on a class-conditional mixture of
Gaussians in 8 dimensions (4 classes plus the empty class, so there is an unconditional velocity):

1. a base flow model ``b(x, t, c)`` trained with 10% of the labels dropped (classifier-free guidance);
2. the teacher ``T``, distilled from it so that one call gives what guidance at scale ``w`` gave the
   base: ``T(x, t, c) = b(x, t, 0) + w (b(x, t, c) - b(x, t, 0))``, and ``T(x, t, 0) = b(x, t, 0)``;
3. a LoRA (peft, rank 8, on every linear layer) trained on the teacher, on samples of the very
   distribution it was made from, with the shared flow-matching noise draw (``FlowObjective``), once
   with plain flow matching and once with ``parts.guidance.guidance_preserving_loss`` at scale ``w``.

The data holds nothing the teacher does not know, so an ideal adapter leaves its guided output as it
was. The figure is how far each adapter moved it: the mean squared distance between the trained
model's conditional output and the teacher's, on fixed noisy inputs, relative to the mean squared
size of the teacher's output, and the same distance to the base's *unguided* conditional output (where
plain flow matching drifts to). Each objective's own training loss is printed so that one can see both
trained. Same seeds, same batches and noise for both objectives.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from zeropipe.config.schema import DiffusionSection
from zeropipe.families.diffusion.objectives import FlowObjective, weighted_mse
from zeropipe.families.diffusion.parts.guidance import guidance_preserving_loss

DIM, CLASSES, EMPTY = 8, 4, 0  # class 0 is the empty prompt; 1..4 the classes


class Denoiser(nn.Module):
    """A conditional velocity model: x, t and a class (0: none) in, velocity out."""

    def __init__(self, width: int = 128):
        super().__init__()
        self.classes = nn.Embedding(CLASSES + 1, 32)
        self.net = nn.Sequential(nn.Linear(DIM + 32 + 16, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, DIM))

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        freqs = torch.arange(8, dtype=torch.float32) + 1.0
        angles = t.view(-1, 1) * freqs * torch.pi
        return self.net(torch.cat([x, self.classes(c), angles.sin(), angles.cos()], dim=-1))


def make_data(seed: int):
    generator = torch.Generator().manual_seed(seed)
    means = torch.randn(CLASSES, DIM, generator=generator) * 1.5

    def sample(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.randint(1, CLASSES + 1, (n,), generator=gen)
        # Each class is itself two modes, so the conditional velocity is not a straight line and guidance matters.
        side = torch.randint(0, 2, (n, 1), generator=gen).float() * 2 - 1
        offset = torch.zeros(n, DIM)
        offset[:, 0] = side[:, 0] * 0.8
        return means[c - 1] + offset + 0.25 * torch.randn(n, DIM, generator=gen), c

    return sample


def train_base(sample, steps: int, seed: int) -> Denoiser:
    torch.manual_seed(seed)
    model = Denoiser()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x0, c = sample(256, gen)
        c = torch.where(torch.rand(c.shape, generator=gen) < 0.1, torch.zeros_like(c), c)
        t = torch.rand(256, generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        xt = (1 - t[:, None]) * x0 + t[:, None] * noise
        loss = ((model(xt, t, c) - (noise - x0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


def guided(model: Denoiser, x, t, c, scale: float) -> torch.Tensor:
    empty = model(x, t, torch.zeros_like(c))
    return torch.where((c == EMPTY)[:, None], empty, empty + scale * (model(x, t, c) - empty))


def distill_teacher(base: Denoiser, sample, steps: int, scale: float, seed: int) -> Denoiser:
    teacher = copy.deepcopy(base).requires_grad_(True).train()
    opt = torch.optim.AdamW(teacher.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed + 2)
    for _ in range(steps):
        x0, c = sample(256, gen)
        c = torch.where(torch.rand(c.shape, generator=gen) < 0.2, torch.zeros_like(c), c)
        t = torch.rand(256, generator=gen)
        xt = (1 - t[:, None]) * x0 + t[:, None] * torch.randn(x0.shape, generator=gen)
        with torch.no_grad():
            goal = guided(base, xt, t, c, scale)
        loss = ((teacher(xt, t, c) - goal) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return teacher.eval().requires_grad_(False)


def lora_train(teacher: Denoiser, sample, objective: str, steps: int, scale: float, seed: int) -> tuple[nn.Module, float, float]:
    """The teacher with a LoRA trained by one objective; (model, its loss over the first 20 steps, over the last 20)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed + 3)
    model = get_peft_model(copy.deepcopy(teacher), LoraConfig(r=8, lora_alpha=8, target_modules=["net.0", "net.2", "net.4", "net.6"], init_lora_weights="gaussian"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    flow = FlowObjective({"num_train_timesteps": 1000, "shift": 1.0}, DiffusionSection())  # logit-normal noise levels, as the trainer draws them
    gen = torch.Generator().manual_seed(seed + 4)
    losses = []
    for _ in range(steps):
        x0, c = sample(64, gen)
        noised = flow.noise(x0, generator=gen)
        t = noised.timesteps / 1000.0

        def predict(condition: dict[str, torch.Tensor]) -> torch.Tensor:
            return model(noised.model_input, t, condition["class"])

        if objective == "flow":
            loss = weighted_mse(predict({"class": c}), noised.target, None)
        else:
            loss = guidance_preserving_loss(predict, noised.target, {"class": c}, {"class": torch.zeros_like(c)}, scale)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.eval(), statistics.mean(losses[:20]), statistics.mean(losses[-20:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400, help="LoRA steps per objective")
    parser.add_argument("--scale", type=float, default=4.0, help="the guidance scale distilled into the teacher (and baked in by the objective)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.time()
    rows = []
    for seed in range(args.seeds):
        sample = make_data(seed)
        base = train_base(sample, 3000, seed)
        teacher = distill_teacher(base, sample, 3000, args.scale, seed)
        gen = torch.Generator().manual_seed(10_000 + seed)
        x0, c = sample(4096, gen)
        t = torch.rand(4096, generator=gen)
        xt = (1 - t[:, None]) * x0 + t[:, None] * torch.randn(x0.shape, generator=gen)
        with torch.no_grad():
            reference = teacher(xt, t, c)
            unguided = base(xt, t, c)
        size = float((reference**2).mean())
        for objective in ("flow", "guidance_preserving"):
            model, first, last = lora_train(teacher, sample, objective, args.steps, args.scale, seed)
            with torch.no_grad():
                out = model(xt, t, c)
            rows.append({
                "seed": seed, "objective": objective, "to_teacher": float(((out - reference) ** 2).mean()) / size,
                "to_unguided": float(((out - unguided) ** 2).mean()) / size, "loss_first": first, "loss_last": last,
            })
            print(f"seed {seed} {objective:20s} distance to the teacher's guided output {rows[-1]['to_teacher']:.4f}, "
                  f"to the base's unguided output {rows[-1]['to_unguided']:.4f}; loss {first:.3f} -> {last:.3f}", flush=True)
        start_gap = float(((reference - unguided) ** 2).mean()) / size
        print(f"seed {seed} (the teacher itself: distance 0 to its guided output, {start_gap:.4f} to the base's unguided output)")
    print()
    print(f"| objective | distance to the teacher's guided output (mean of {args.seeds} seeds) | to the base's unguided output | training loss, first 20 -> last 20 steps |")
    print("|---|---|---|---|")
    for objective in ("flow", "guidance_preserving"):
        mine = [row for row in rows if row["objective"] == objective]
        print(f"| {objective} | {statistics.mean(r['to_teacher'] for r in mine):.4f} ({', '.join(format(r['to_teacher'], '.4f') for r in mine)}) "
              f"| {statistics.mean(r['to_unguided'] for r in mine):.4f} | {statistics.mean(r['loss_first'] for r in mine):.3f} -> {statistics.mean(r['loss_last'] for r in mine):.3f} |")
    flow = statistics.mean(r["to_teacher"] for r in rows if r["objective"] == "flow")
    kept = statistics.mean(r["to_teacher"] for r in rows if r["objective"] == "guidance_preserving")
    print(f"\nplain flow matching moved the guided output {flow / kept:.1f}x as far as the guidance-preserving objective ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
