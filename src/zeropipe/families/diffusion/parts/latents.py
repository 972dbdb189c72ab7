"""The latent codecs of entries whose VAE differs from the plain image and video codecs (``codec.py``), one class each.

Qwen-Image's VAE is a video VAE that takes images as one-frame clips (Qwen-Image 2.1's adds an alpha
channel; Cosmos-Predict2's is Wan 2.1's); FLUX.2's folds 2x2 latent patches into channels and normalises
them by batch-norm statistics its VAE keeps as weights (ERNIE-Image and Ideogram 4 reuse it, Ideogram 4
in its own channel order); LTX-Video's keeps per-channel statistics as weights and is decoded at a
timestep (LTX-2's data has sound); HunyuanVideo 1.5's encodes one clip at a time; Kandinsky 5's scales
without a shift. Each entry names its codec in its record (``Architecture.codec``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.families.diffusion.parts.codec import ImageLatents, PerChannelVideoLatents, VideoLatents, per_channel_normalization, per_channel_statistics

IDEOGRAM4_PATCH = 2  # Ideogram4Pipeline folds 2x2 latent patches into a token


@dataclass(frozen=True)
class QwenImageLatents(ImageLatents):
    """Qwen-Image's VAE: Wan's video VAE, given images as one-frame clips, latents normalised per channel from its config."""

    def vae_pixels(self, pixels):
        return pixels.unsqueeze(2) if pixels.dim() == 4 else pixels

    def vae_images(self, decoded):
        return decoded[:, :, 0] if decoded.dim() == 5 else decoded

    def normalization(self, vae_config, vae_dir=None):
        return per_channel_normalization(vae_config)

    def statistics_config(self, latents):
        return per_channel_statistics(latents)


@dataclass(frozen=True)
class QwenImage21Latents(QwenImageLatents):
    """Qwen-Image 2.1's VAE: one-frame clips of RGBA images (an opaque alpha added to the data, dropped from samples), per-channel statistics."""

    def vae_pixels(self, pixels):
        if pixels.shape[1] == 3:  # (B, 3, H, W) or (B, 3, T, H, W): opaque, as the pipeline's convert("RGBA") of an RGB image
            pixels = torch.cat([pixels, pixels.new_ones(pixels.shape[0], 1, *pixels.shape[2:])], dim=1)
        return super().vae_pixels(pixels)

    def vae_images(self, decoded):
        return super().vae_images(decoded)[:, :3]


def torchvision_problems(config: Any, arch: Any) -> list[tuple[str, str]]:
    """A run whose transformer resizes its padding mask (``concat_padding_mask``) where torchvision, which diffusers resizes it with, is missing."""
    if importlib.util.find_spec("torchvision") is not None or not concatenates_padding_mask(config, arch):
        return []
    why = (
        f"{arch.record.name}: diffusers' CosmosTransformer3DModel resizes its padding mask with torchvision (concat_padding_mask, which every "
        "Cosmos-Predict2 checkpoint sets), and torchvision is not installed: pip install torchvision (the release made for your torch)"
    )
    return [("model.path", why)]


def concatenates_padding_mask(config: Any, arch: Any) -> bool:
    """Whether the run's transformer config sets ``concat_padding_mask`` (a folder's ``transformer/config.json``, or a preset and its overrides)."""
    model = config.model
    if model.path:
        from zeropipe.config.pipeline_index import read_pipeline_index

        try:
            return bool(read_pipeline_index(Path(model.path).expanduser()).component_config(arch.record.denoiser).get("concat_padding_mask", True))
        except Exception:  # noqa: BLE001 - an unreadable folder is reported by the checks that read it, with its own fix
            return False
    inline = dict(model.config or {})
    return bool({**arch.record.preset.get(arch.record.denoiser, {}), **(inline.get(arch.record.denoiser) or {})}.get("concat_padding_mask", True))


@dataclass(frozen=True)
class CosmosLatents(QwenImageLatents):
    """The Wan 2.1 VAE given images as one-frame clips, normalised per channel (Qwen-Image's codec with Wan's VAE).

    It also refuses, before anything starts, a transformer that cannot run here: with ``concat_padding_mask``
    (every published Cosmos-Predict2 checkpoint) diffusers resizes the padding mask with torchvision.
    """

    def problems(self, config, arch):
        return torchvision_problems(config, arch)


@dataclass(frozen=True)
class CosmosVideoLatents(PerChannelVideoLatents):
    """The Wan 2.1 VAE on clips at 16 fps, normalised per channel; refuses a transformer that needs torchvision where it is missing."""

    def problems(self, config, arch):
        return torchvision_problems(config, arch)


def batch_norm_statistics(vae_dir: Path) -> dict[str, torch.Tensor]:
    """The VAE's batch-norm running mean and variance (``bn.running_mean`` / ``bn.running_var``), read from its safetensors files alone."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for path in sorted(Path(vae_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in ("bn.running_mean", "bn.running_var"):
                if name in handle.keys():
                    found[name] = handle.get_tensor(name).float()
    return found


@dataclass(frozen=True)
class Flux2Latents(ImageLatents):
    """FLUX.2's codec: the VAE's latents folded 2x2 into channels, normalised by the batch-norm statistics the VAE keeps as weights."""

    def from_vae(self, latents):
        from diffusers import Flux2Pipeline

        return Flux2Pipeline._patchify_latents(latents)

    def decode(self, vae, latents):
        from diffusers import Flux2Pipeline

        return vae.decode(Flux2Pipeline._unpatchify_latents(latents)).sample

    def normalization(self, vae_config, vae_dir=None):
        channels = int(vae_config.get("latent_channels", 32)) * 4  # 2x2 patches
        statistics = batch_norm_statistics(vae_dir) if vae_dir is not None else {}
        mean = statistics.get("bn.running_mean", torch.zeros(channels))
        variance = statistics.get("bn.running_var", torch.ones(channels))
        # Flux2Pipeline: (latents - running_mean) / sqrt(running_var + batch_norm_eps).
        return mean, 1.0 / torch.sqrt(variance + float(vae_config.get("batch_norm_eps", 1e-4)))

    def store_statistics(self, vae, latents):
        with torch.no_grad():
            vae.bn.running_mean.copy_(latents.mean(dim=(0, 2, 3)))
            vae.bn.running_var.copy_(latents.var(dim=(0, 2, 3)))


ERNIE_BATCH_NORM_EPS = 1e-5  # ErnieImagePipeline's constant (its TODO: the hub config's batch_norm_eps is not the trained value)


@dataclass(frozen=True)
class ErnieImageLatents(Flux2Latents):
    """FLUX.2's codec, normalised with ErnieImagePipeline's eps."""

    def normalization(self, vae_config, vae_dir=None):
        return super().normalization({**vae_config, "batch_norm_eps": ERNIE_BATCH_NORM_EPS}, vae_dir)


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) VAE latents -> (B, 4C, H/2, W/2), channels ordered (patch row, patch column, channel) as Ideogram4Pipeline's tokens."""
    batch, channels, height, width = latents.shape
    grid = latents.reshape(batch, channels, height // IDEOGRAM4_PATCH, IDEOGRAM4_PATCH, width // IDEOGRAM4_PATCH, IDEOGRAM4_PATCH)
    return grid.permute(0, 3, 5, 1, 2, 4).reshape(batch, channels * IDEOGRAM4_PATCH * IDEOGRAM4_PATCH, height // IDEOGRAM4_PATCH, width // IDEOGRAM4_PATCH)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of ``patchify``: what Ideogram4Pipeline hands its VAE."""
    batch, channels, rows, columns = latents.shape
    grid = latents.reshape(batch, IDEOGRAM4_PATCH, IDEOGRAM4_PATCH, channels // IDEOGRAM4_PATCH**2, rows, columns)
    return grid.permute(0, 3, 4, 1, 5, 2).reshape(batch, channels // IDEOGRAM4_PATCH**2, rows * IDEOGRAM4_PATCH, columns * IDEOGRAM4_PATCH)


@dataclass(frozen=True)
class Ideogram4Latents(Flux2Latents):
    """FLUX.2's VAE and batch-norm statistics, its 2x2 patches in Ideogram 4's channel order (patch position first)."""

    def from_vae(self, latents):
        return patchify(latents)

    def decode(self, vae, latents):
        return vae.decode(unpatchify(latents)).sample


@dataclass(frozen=True)
class HunyuanVideo15Latents(VideoLatents):
    """HunyuanVideo 1.5's VAE, encoded one clip at a time.

    Its causal mid-block attention builds a (batch, tokens, tokens) mask that scaled-dot-product
    attention broadcasts against the batch as if it were heads (diffusers 0.42): a batch of more
    than one clip fails, so the clips of a chunk are encoded one by one (the pipeline encodes one image).
    """

    def encode(self, vae, pixels):
        means, stds = zip(*(super(HunyuanVideo15Latents, self).encode(vae, clip[None]) for clip in pixels))
        return torch.cat(means), torch.cat(stds)


@dataclass(frozen=True)
class KandinskyLatents(ImageLatents):
    """The Flux VAE as Kandinsky5T2IPipeline decodes it: latents times ``scaling_factor``, no shift (whatever the config says)."""

    def normalization(self, vae_config, vae_dir=None):
        return torch.tensor(0.0), torch.tensor(float(vae_config.get("scaling_factor") or 1.0))

    def statistics_config(self, latents):
        return {"scaling_factor": round(1.0 / float(latents.std()), 5)}


def latents_statistics(vae_dir: Path) -> dict[str, torch.Tensor]:
    """The VAE's ``latents_mean`` / ``latents_std`` buffers, read from its safetensors files alone (no model is built)."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for path in sorted(Path(vae_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in ("latents_mean", "latents_std"):
                if name in handle.keys():
                    found[name] = handle.get_tensor(name).float()
    return found


@dataclass(frozen=True)
class LTXVideoLatents(VideoLatents):
    """LTX-Video's VAE: its factors from older configs, per-channel statistics kept as weights, decoded at a timestep."""

    def vae_factors(self, vae_config):
        # Only LTX-Video 0.9.5+ configs say the ratios; older ones give the patch size and the blocks that halve space and time.
        scaling = sum(bool(s) for s in vae_config.get("spatio_temporal_scaling", (True, True, True, False)))
        spatial = vae_config.get("spatial_compression_ratio") or int(vae_config.get("patch_size", 4)) * 2**scaling
        temporal = vae_config.get("temporal_compression_ratio") or int(vae_config.get("patch_size_t", 1)) * 2**scaling
        return int(spatial), int(temporal)

    def normalization(self, vae_config, vae_dir=None):
        channels = int(vae_config.get("latent_channels", 128))
        statistics = latents_statistics(vae_dir) if vae_dir is not None else {}
        mean = statistics.get("latents_mean", torch.zeros(channels))
        std = statistics.get("latents_std", torch.ones(channels))
        # LTXPipeline._normalize_latents: (latents - mean) * scaling_factor / std.
        return mean, float(vae_config.get("scaling_factor") or 1.0) / std

    def decode(self, vae, latents):
        # LTX-Video 0.9.1+ VAEs are conditioned on a decode timestep: LTXPipeline's default is 0 (and no added noise).
        temb = torch.zeros(latents.shape[0], device=latents.device, dtype=latents.dtype) if vae.config.timestep_conditioning else None
        return vae.decode(latents, temb=temb).sample


@dataclass(frozen=True)
class LTX2Latents(LTXVideoLatents):
    """LTX-2's video VAE: per-channel statistics kept as weights, as LTX-Video's; its pipeline uses the VAE's statistics even for latent output."""

    def sample_kwargs(self, plan):
        return {"num_frames": plan.sample_frames, "frame_rate": float(plan.fps or self.frame_rate)}

    def synthetic_folder(self, root, config):
        """``data.synthetic``: moving shapes with a tone per shape as their sound (a circle hums at 220 Hz)."""
        from zeropipe.data.audio import generate_sounding_shapes_dataset

        synthetic, resolution = config.data.synthetic, config.data.images.resolution
        frames = max(config.data.video.frame_buckets)
        return root / f"sounding-shapes-n{synthetic.examples}-seed{synthetic.seed}-res{resolution}-f{frames}", lambda folder: generate_sounding_shapes_dataset(
            folder, synthetic.examples, synthetic.seed, resolution=resolution, frames=frames, fps=self.frame_rate
        )


IMAGENET_MEAN = (0.485, 0.456, 0.406)  # MiniMaxH3ModularPipeline.pixel_mean / pixel_std: the video VAE's pixel convention
IMAGENET_STD = (0.229, 0.224, 0.225)


def imagenet_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [-1, 1] (B, 3, ...) as MiniMax-H3's video VAE takes them: ImageNet-normalised RGB over [0, 1] (``encode_vae_condition``)."""
    shape = (1, 3) + (1,) * (pixels.dim() - 2)
    mean, std = torch.tensor(IMAGENET_MEAN, device=pixels.device).view(shape), torch.tensor(IMAGENET_STD, device=pixels.device).view(shape)
    return ((pixels.float() + 1) / 2 - mean) / std


@dataclass(frozen=True)
class MiniMaxH3Latents(PerChannelVideoLatents):
    """MiniMax-H3's video VAE (``AutoencoderKLMiniMaxH3``): ``17k+5`` frames to ``5k+2`` latent frames (17-frame chunks, the last
    3 latent frames dropped; one frame alone is one latent frame), 16x space, per-channel ``latents_mean`` / ``latents_std``, and
    ImageNet-normalised pixels in and out (``MiniMaxH3VideoDecodeStep``), which this codec converts from and to [-1, 1].

    The sound is the ``WaveformAudioTrack`` condition's; ``data.synthetic`` writes moving shapes with a tone at the audio VAE's 32 kHz.
    """

    def problems(self, config, arch):
        """Samples of one frame, which the VAE's decoder cannot decode (it encodes a single frame, but ``_decode`` of one latent frame
        yields nothing in diffusers 0.42.1): refused up front, naming the setting."""
        video = config.data.video
        sample_frames = video.sample_frames or max(video.frame_buckets or [1])
        if sample_frames == 1:
            return [*super().problems(config, arch), ("data.video.sample_frames", f"{arch.record.name}'s VAE cannot decode a one-frame sample (its decoder "
                                                      f"needs a chunk of latent frames): set data.video.sample_frames: {self.clip_length(1)} or longer (17k+5 frames)")]
        return super().problems(config, arch)

    def vae_factors(self, vae_config):
        import math

        return math.prod(vae_config.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1))), math.prod(vae_config.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1)))

    def encode(self, vae, pixels):
        return super().encode(vae, imagenet_pixels(pixels))

    def decode(self, vae, latents):
        decoded = vae.decode(latents).sample.float()
        shape = (1, 3) + (1,) * (decoded.dim() - 2)
        mean, std = torch.tensor(IMAGENET_MEAN, device=decoded.device).view(shape), torch.tensor(IMAGENET_STD, device=decoded.device).view(shape)
        return (decoded * std + mean).clamp(0, 1) * 2 - 1

    def synthetic_folder(self, root, config):
        """``data.synthetic``: moving shapes with a tone per shape as their sound, at the audio VAE's 32 kHz and the model's 24 fps."""
        from zeropipe.data.audio import generate_sounding_shapes_dataset

        synthetic, resolution = config.data.synthetic, config.data.images.resolution
        frames = max(config.data.video.frame_buckets)
        return root / f"sounding-shapes-32k-n{synthetic.examples}-seed{synthetic.seed}-res{resolution}-f{frames}", lambda folder: generate_sounding_shapes_dataset(
            folder, synthetic.examples, synthetic.seed, resolution=resolution, frames=frames, fps=self.frame_rate, sample_rate=32000
        )


@dataclass(frozen=True)
class SoundingVideoLatents(VideoLatents):
    """A video VAE scaled by its ``scaling_factor`` (``VideoLatents``) for a model that trains video with its sound (Kandinsky 6):
    ``data.synthetic`` writes moving shapes with a tone per shape as their sound, so that the audio condition has clips to encode."""

    def synthetic_folder(self, root, config):
        from zeropipe.data.audio import generate_sounding_shapes_dataset

        synthetic, resolution = config.data.synthetic, config.data.images.resolution
        frames = max(config.data.video.frame_buckets)
        return root / f"sounding-shapes-n{synthetic.examples}-seed{synthetic.seed}-res{resolution}-f{frames}", lambda folder: generate_sounding_shapes_dataset(
            folder, synthetic.examples, synthetic.seed, resolution=resolution, frames=frames, fps=self.frame_rate
        )
