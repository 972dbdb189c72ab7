"""A model family added from outside the package, through the registry alone (tests/integration/test_toy_family.py).

A two-layer MLP that learns y = 3x - 1 from generated points. Everything ZeRO-Pipe needs to
train, check, plan and export it is in this one module; it registers itself when imported
(``ZEROPIPE_PLUGINS=toy_family``), in the launcher and in every rank.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from zeropipe.engine.task import TaskDefaults
from zeropipe.errors import ZeroPipeError
from zeropipe.families import register
from zeropipe.plan.model_spec import spec_from_params
from zeropipe.rundir import PreparedData

POINTS = 512


def build() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


class ToyTask(TaskDefaults):
    def setup_data(self) -> None:
        data = torch.load(self.run.data / "points.pt")
        self.x, self.y = data["x"], data["y"]

    def build_model(self):
        model = build()
        count = sum(p.numel() for p in model.parameters())
        return model, {"trainable": count, "total": count}

    def batches(self, start_step: int):
        micro, per_epoch = self.micro_batch_size, self.plan.micro_batches_per_epoch
        micro_step = start_step * self.accumulation
        while True:
            epoch, position = divmod(micro_step, per_epoch)
            order = torch.randperm(POINTS, generator=torch.Generator().manual_seed(epoch))[self.rank :: self.world_size]
            for index in range(position, per_epoch):
                chosen = order[index * micro : (index + 1) * micro]
                yield epoch, (self.x[chosen], self.y[chosen])
                micro_step += 1

    def forward_loss(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.engine(x), y), 0.0, float(len(x))

    def extra_metrics(self):
        # TOY_METRICS_DELAY_S: per-step work between steps (the trainer calls this while it
        # records a step's metrics), for the test that a step's time counts it.
        time.sleep(float(os.environ.get("TOY_METRICS_DELAY_S", "0")))
        return {}


class ToyRegression:
    name = "toy_regression"
    trains_tokenizer = False
    answers_prompts = False
    takes_images = False
    streams_answers = False

    def detect(self, section) -> bool:
        return (section.config or {}).get("model_type") == "toy_regression"

    def detect_dir(self, path: Path) -> bool:
        return (Path(path) / "toy.pt").is_file()

    def config_problems(self, config):
        return [("train.micro_batch_size", "the toy deals 512 points: keep it at 64 or below")] if config.train.micro_batch_size > 64 else []

    def curriculum_problems(self, config):
        return [("stages", "the toy family has no curricula")]

    def hidden_size(self, config):
        return None

    def prepare_data(self, config, run, reuse: bool) -> PreparedData:
        run.data.mkdir(exist_ok=True)
        x = torch.rand(POINTS, 1, generator=torch.Generator().manual_seed(config.run.seed)) * 2 - 1
        torch.save({"x": x, "y": 3 * x - 1}, run.data / "points.pt")
        return PreparedData(POINTS, None, lambda micro, world_size: (POINTS // world_size) // micro, notes=["toy: 512 generated points"])

    def rank_task(self, trainer) -> ToyTask:
        return ToyTask(trainer)

    def model_spec(self, config):
        return spec_from_params(sum(p.numel() for p in build().parameters()))

    def export(self, job) -> Path:
        job.out.mkdir(parents=True, exist_ok=True)
        torch.save(job.state_dict(), job.out / "toy.pt")
        return job.out

    def load_for_generate(self, source, device, dtype):
        raise ZeroPipeError("the toy family answers no prompts")

    def generate(self, loaded, prompts, images, tokens, temperature, top_p, seed, raw, streamer=None):
        raise ZeroPipeError("the toy family answers no prompts")


register(ToyRegression(), first=True)
