"""Training objectives: DDPM noise/velocity prediction (UNets) and rectified flow (SD3, Flux).

Both follow the reference training scripts of diffusers (train_text_to_image_sdxl.py,
train_dreambooth_lora_sd3.py / _flux.py) and use the scheduler classes for the arithmetic
they define (add_noise, get_velocity, the alphas), so the trained model matches the sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zeropipe.config.schema import DiffusionSection
from zeropipe.errors import ConfigError


@dataclass
class NoisedBatch:
    model_input: torch.Tensor  # what the denoiser sees
    timesteps: torch.Tensor  # what it is told about the noise level (scheduler units)
    target: torch.Tensor
    weights: torch.Tensor | None  # per-example loss weights (min-SNR), or None


class DDPMObjective:
    """Noise (epsilon) or velocity (v) prediction on the DDPM schedule, with min-SNR weighting and noise offset."""

    def __init__(self, scheduler_config: dict, section: DiffusionSection):
        from diffusers import DDPMScheduler

        fields = {k: v for k, v in scheduler_config.items() if not k.startswith("_")}
        self.scheduler = DDPMScheduler.from_config(fields)
        prediction = section.prediction_type
        if prediction == "auto":
            prediction = self.scheduler.config.prediction_type
        if prediction not in ("epsilon", "v_prediction"):

            raise ConfigError([("model.diffusion.prediction_type", f"{prediction} does not apply to a UNet on a DDPM schedule: use epsilon or v_prediction")])
        self.prediction_type = prediction
        self.section = section
        alphas = self.scheduler.alphas_cumprod
        self.snr = alphas / (1 - alphas)

    def noise(self, latents: torch.Tensor, generator: torch.Generator | None = None, quantiles: torch.Tensor | None = None) -> NoisedBatch:
        """The batch noised at drawn timesteps, or with ``quantiles`` at those quantiles of the training distribution (the validation loss's fixed timesteps)."""
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents)
        if self.section.noise_offset:
            # A per-channel constant shift: the model can then change an image's mean brightness.
            offset = torch.randn((latents.shape[0], latents.shape[1], 1, 1), generator=generator, dtype=torch.float32).to(latents)
            noise = noise + self.section.noise_offset * offset
        count = self.scheduler.config.num_train_timesteps
        if quantiles is not None:
            q = quantiles.double().clamp(1e-7, 1 - 1e-7)
            u = torch.sigmoid(self.section.logit_mean + self.section.logit_std * torch.special.ndtri(q)) if self.section.timestep_sampling == "logit_normal" else q
            timesteps = (u * count).long().clamp(0, count - 1)
        elif self.section.timestep_sampling == "logit_normal":
            u = torch.sigmoid(self.section.logit_mean + self.section.logit_std * torch.randn((latents.shape[0],), generator=generator))
            timesteps = (u * count).long().clamp(0, count - 1)
        else:
            timesteps = torch.randint(0, count, (latents.shape[0],), generator=generator)
        noisy = self.scheduler.add_noise(latents, noise, timesteps)
        target = noise if self.prediction_type == "epsilon" else self.scheduler.get_velocity(latents, noise, timesteps)
        weights = None
        if self.section.min_snr_gamma is not None:
            snr = self.snr[timesteps]
            clipped = torch.clamp(snr, max=self.section.min_snr_gamma)
            weights = clipped / snr if self.prediction_type == "epsilon" else clipped / (snr + 1)
        return NoisedBatch(noisy, timesteps.to(latents.device), target, weights)


class FlowObjective:
    """Rectified flow: x_t = (1 - s) x0 + s noise, predict noise - x0; logit-normal timesteps with a shift (SD3 paper).

    ``min_t`` / ``max_t`` restrict the noise levels to a range of the shifted distribution (its
    conditional distribution there, as diffusion-pipe slices it): the way Wan 2.2's high-noise
    and low-noise experts are trained each on its own side of the boundary.
    """

    def __init__(self, scheduler_config: dict, section: DiffusionSection):
        prediction = section.prediction_type
        if prediction not in ("auto", "flow"):

            raise ConfigError([("model.diffusion.prediction_type", f"SD3/Flux transformers are trained with flow matching, not {prediction}: set auto or flow")])
        self.section = section
        self.num_train_timesteps = int(scheduler_config.get("num_train_timesteps", 1000))
        # FlowMatchEuler schedulers call it shift, the UniPC flow schedulers Wan ships flow_shift.
        configured = scheduler_config.get("shift", scheduler_config.get("flow_shift", 1.0)) if scheduler_config.get("use_flow_sigmas", True) else 1.0
        self.shift = float(configured) if section.shift == "auto" else float(section.shift)
        self.min_t, self.max_t = float(section.min_t), float(section.max_t)
        if self.min_t >= self.max_t:
            raise ConfigError([("model.diffusion.min_t", f"{self.min_t} must be below model.diffusion.max_t ({self.max_t})")])

    def sigmas(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Noise levels drawn by inverse transform: a quantile in [F(min_t), F(max_t)] mapped through F's inverse.

        F is the distribution of the shifted noise level; without a range this is the plain draw.
        """
        if self.min_t == 0 and self.max_t == 1:  # the whole range: the direct draw (the same stream as before ranges existed)
            if self.logit_normal:
                u = torch.sigmoid(self.section.logit_mean + self.section.logit_std * torch.randn((batch,), generator=generator))
            else:
                u = torch.rand((batch,), generator=generator)
            return self.shift * u / (1 + (self.shift - 1) * u)
        return self.sigmas_at(torch.rand((batch,), generator=generator, dtype=torch.float64))

    def sigmas_at(self, quantiles: torch.Tensor) -> torch.Tensor:
        """The noise levels at these quantiles (0-1) of the distribution training draws from, within min_t/max_t (diffusion-pipe's eval quantiles)."""
        low, high = self.quantile(self.min_t), self.quantile(self.max_t)
        q = (low + (high - low) * quantiles.double()).clamp(1e-7, 1 - 1e-7)
        if self.logit_normal:
            u = torch.sigmoid(self.section.logit_mean + self.section.logit_std * torch.special.ndtri(q))
        else:
            u = q
        # The shift spends more training on high noise levels, as the sampler's schedule does.
        sigmas = self.shift * u / (1 + (self.shift - 1) * u)
        return sigmas.clamp(self.min_t, self.max_t).float()

    @property
    def logit_normal(self) -> bool:
        return self.section.timestep_sampling in ("auto", "logit_normal")

    def quantile(self, sigma: float) -> float:
        """F(sigma): the probability that a drawn (shifted) noise level is at most sigma."""
        if sigma <= 0 or sigma >= 1:
            return float(sigma >= 1)
        u = sigma / (self.shift - (self.shift - 1) * sigma)  # the shift's inverse
        if not self.logit_normal:
            return u
        z = (math.log(u / (1 - u)) - self.section.logit_mean) / self.section.logit_std
        return float(torch.special.ndtr(torch.tensor(z, dtype=torch.float64)))

    def noise(self, latents: torch.Tensor, generator: torch.Generator | None = None, quantiles: torch.Tensor | None = None) -> NoisedBatch:
        """The batch noised at drawn noise levels, or with ``quantiles`` at those quantiles of the training distribution (the validation loss's fixed timesteps)."""
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32).to(latents)
        sigmas = (self.sigmas(latents.shape[0], generator) if quantiles is None else self.sigmas_at(quantiles)).to(latents)
        shaped = sigmas.view(-1, *([1] * (latents.dim() - 1)))
        noisy = (1 - shaped) * latents + shaped * noise
        return NoisedBatch(noisy, sigmas * self.num_train_timesteps, noise - latents, None)


def weighted_mse(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Mean squared error in fp32, per example weighted when weights are given."""
    per_example = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=tuple(range(1, prediction.dim())))
    if weights is not None:
        per_example = per_example * weights.to(per_example)
    return per_example.mean()
