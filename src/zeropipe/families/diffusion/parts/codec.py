"""The latent codec part: what the VAE encodes, how its latents are normalised and decoded, and what the data are.

:class:`ImageLatents` is the codec of image models (latents (batch, channels, height, width),
data are images, samples PNG files); :class:`VideoLatents` that of video models (latents with a
time axis, data are clips of videos and images, samples mp4 videos). An entry whose VAE differs
subclasses one in its own module: FLUX.2 folds 2x2 latent patches into channels and normalises
them by batch-norm statistics its VAE keeps as weights, LTX-Video's VAE is decoded at a
timestep, Qwen-Image's is a video VAE that takes images as one-frame clips.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.families.diffusion.parts.base import Part, Sampling


@dataclass(frozen=True)
class ImageLatents(Part):
    """The codec of an image model.

    Attributes:
        vae_class: the diffusers class of the VAE (what a tiny preset builds).
        shifted: the VAE has a shift factor (latents are (z - shift) * scale).
        vae_while_sampling: the pipeline uses its VAE even when asked for latents (FLUX.2 [klein]
            returns them denormalised and unpatched): every rank holds the VAE while drawing samples.
        frame_multiple: the clip lengths the VAE accepts are ``frame_multiple * k + frame_remainder`` (1: images only).
        frame_remainder: see ``frame_multiple``: 1 for most video VAEs (``4k+1``), 5 for MiniMax-H3's (``17k+5``).
        frame_rate: frames per second the model was trained at (video codecs).
    """

    vae_class: str = "AutoencoderKL"
    shifted: bool = False
    vae_while_sampling: bool = False
    frame_multiple: int = 1
    frame_rate: float | None = None
    frame_remainder: int = 1

    video = False  # latents have no time axis (the planner and the config converter read it)
    noun = "image(s)"  # what an item is, in notes
    file_noun = "image"  # what a data file is, in notes
    sample_noun = "image(s)"  # what a sample is, in the log

    # ------------------------------------------------------------------ planner
    def planned_shape(self, frame_buckets: list[int], prompt_tokens: int) -> dict[str, int]:
        """What the planner traces a run config of this codec at, besides its resolution: images are one frame, at the entry's own prompt length."""
        return {"frames": 1}

    # ------------------------------------------------------------------ data
    def scan(self, image_dir: Path, caption_ext: str):
        from zeropipe.data.images import scan_image_folder

        return scan_image_folder(image_dir, caption_ext=caption_ext)

    def take_clips(self, config: Any, name: str, items: list[dict[str, Any]], buckets: list[tuple[int, ...]]):
        """(items, their buckets, the frame rate, the sample length, notes): images are trained as they are."""
        return items, buckets, None, 1, []

    def clip(self, item: dict[str, Any], fps: float | None) -> tuple[int, float] | None:
        """The clip of a file an item is (part of its cache key); None for an image."""
        return None

    def synthetic_folder(self, root: Path, config: Any) -> tuple[Path, Any]:
        """(folder, a function writing the generated data set into a folder) for ``data.synthetic``."""
        from zeropipe.data.images import generate_shapes_dataset

        synthetic, resolution = config.data.synthetic, config.data.images.resolution
        return root / f"shapes-n{synthetic.examples}-seed{synthetic.seed}-res{resolution}", lambda folder: generate_shapes_dataset(
            folder, synthetic.examples, synthetic.seed, resolution=resolution
        )

    def synthetic_prompts(self, count: int, seed: int) -> list[str]:
        from zeropipe.data.images import shape_prompts

        return shape_prompts(count, seed=seed)

    def batching_note(self) -> str:
        return "a micro-batch takes images of one bucket only"

    def load_pixels(self, plan: Any, index: int, bucket: tuple[int, ...], crop: str, flip: bool, rng=None):
        """An item's pixels at its bucket: an image (3, H, W) in [-1, 1]."""
        from zeropipe.data.images import load_image_for_bucket

        return load_image_for_bucket(Path(plan.items[index]["path"]), tuple(bucket), crop=crop, flip=flip, rng=rng)

    def sample_bucket(self, size: int) -> tuple[int, ...]:
        return (size, size)

    # ------------------------------------------------------------------ the VAE
    def vae_factors(self, vae_config: dict[str, Any]) -> tuple[int, int]:
        """(pixels per latent along a side, frames per latent frame after the first) of the VAE, from its config.

        Video VAEs say both (Wan: ``scale_factor_spatial``/``_temporal``, HunyuanVideo:
        ``spatial_compression_ratio``/``temporal_compression_ratio``); an image VAE halves per block.
        """
        if not vae_config.get("scale_factor_spatial") and "block_out_channels" not in vae_config and "temperal_downsample" in vae_config:
            # Qwen-Image's VAE: Wan's layout without the field, one spatial halving per temperal_downsample entry.
            return 2 ** len(vae_config["temperal_downsample"]), 1
        spatial = vae_config.get("scale_factor_spatial") or vae_config.get("spatial_compression_ratio") or 2 ** (len(vae_config["block_out_channels"]) - 1)
        temporal = vae_config.get("scale_factor_temporal") or vae_config.get("temporal_compression_ratio") or 1
        return int(spatial), int(temporal)

    def accepts_frames(self, frames: int) -> bool:
        """Whether the VAE encodes a clip of this many frames (an image is one frame)."""
        return frames == 1 or (self.video and frames > 1 and frames % self.frame_multiple == self.frame_remainder % self.frame_multiple)

    def clip_length(self, k: int) -> int:
        """The k-th clip length the VAE accepts (``frame_multiple * k + frame_remainder``)."""
        return self.frame_multiple * k + self.frame_remainder

    @property
    def frame_rule(self) -> str:
        return f"{self.frame_multiple}k+{self.frame_remainder}"

    def vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """What the VAE encodes for a batch of pixels: as they are, or with a time axis for a video VAE used on images (Qwen-Image)."""
        return pixels

    def vae_images(self, decoded: torch.Tensor) -> torch.Tensor:
        """The VAE's decoded output as a batch of images (B, 3, H, W) or clips (B, 3, T, H, W): the inverse of ``vae_pixels``."""
        return decoded

    def encode(self, vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the VAE's latent distribution for a batch of what ``vae_pixels`` gave (cached; a sample is drawn per step)."""
        from zeropipe.families.diffusion import cache

        return cache.encode_latent_distribution(vae, pixels)

    def from_vae(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's latents laid out as they are normalised and the denoiser sees them (FLUX.2 folds 2x2 patches first); ``decode`` undoes it."""
        return latents

    def normalization(self, vae_config: dict[str, Any], vae_dir: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(shift, scale): the denoiser sees (VAE latents - shift) * scale; scalars, or one value per latent channel.

        ``vae_dir`` is the VAE's folder, for VAEs that keep their statistics as weights (LTX-Video) rather than config.
        """
        return torch.tensor(float(vae_config.get("shift_factor") or 0.0)), torch.tensor(float(vae_config.get("scaling_factor") or 1.0))

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] of (denormalised) latents, decoded as the architecture's pipeline decodes them."""
        return vae.decode(latents).sample

    def statistics_config(self, latents: torch.Tensor) -> dict[str, Any]:
        """The VAE config fields that normalise these latents (of a fitted tiny VAE) to zero mean and unit variance."""
        shift = float(latents.mean()) if self.shifted else 0.0
        fields: dict[str, Any] = {"scaling_factor": round(1.0 / float((latents - shift).std()), 5)}
        if self.shifted:
            fields["shift_factor"] = round(shift, 5)
        return fields

    def store_statistics(self, vae, latents: torch.Tensor) -> None:
        """Make a fitted tiny VAE normalise these latents (``from_vae``'s layout) to zero mean and unit variance: into its config by default."""
        vae.register_to_config(**self.statistics_config(latents))

    def fitting_pixels(self, vae, seed: int) -> torch.Tensor:
        """Shape images (N, 3, H, W) in [-1, 1] at the tiny VAE's size, which a tiny VAE learns to reconstruct."""
        import tempfile

        from zeropipe.data.images import generate_shapes_dataset, load_image_for_bucket, scan_image_folder

        size = int(getattr(vae.config, "sample_size", 32))
        from zeropipe.confine import also_allowing, confining

        with tempfile.TemporaryDirectory() as folder, confining(also_allowing(Path(folder))):  # its own generated images
            generate_shapes_dataset(Path(folder), 256, seed=seed + 7, resolution=size)
            items = scan_image_folder(Path(folder)).items
            return torch.stack([load_image_for_bucket(Path(item.path), (size, size), crop="center", flip=False).pixels for item in items])

    def fitting_batch(self, batch: int) -> int:
        return batch

    # ------------------------------------------------------------------ samples
    def sample_components(self, sampling: Sampling) -> dict[str, Any]:
        return {"vae": sampling.vae()} if self.vae_while_sampling else {}

    def sample_kwargs(self, plan: Any) -> dict[str, Any]:
        """The sampling pipeline's arguments for the shape of a sample (a video's length)."""
        return {}

    def write_samples(self, folder: Path, prompts: list[str], pixels: torch.Tensor, plan: Any, step: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Write decoded samples (uint8, (B, 3, H, W)) as PNG files; the samples' index rows."""
        from PIL import Image

        written = []
        for number, (prompt, image, extra) in enumerate(zip(prompts, pixels.permute(0, 2, 3, 1).cpu().numpy(), rows)):
            name = f"{number:02d}.png"
            Image.fromarray(image).save(folder / name)
            written.append({"step": step, "prompt": prompt, "file": f"{folder.name}/{name}", **extra})
        return written


@dataclass(frozen=True)
class VideoLatents(ImageLatents):
    """The codec of a video model: latents (batch, channels, frames, height, width), data are clips of videos (and images, one frame), samples mp4 videos."""

    frame_multiple: int = 4
    frame_rate: float | None = 16.0

    video = True
    noun = "clip(s)"
    file_noun = "file"
    sample_noun = "video(s)"

    def problems(self, config, arch):
        """Frame buckets and a sample length the VAE cannot decode, as take_clips refuses them when the data is prepared: said by check too."""
        from zeropipe.data.videos import check_frame_buckets

        video = config.data.video
        try:
            buckets = check_frame_buckets(video.frame_buckets, self.accepts_frames, self.frame_multiple, self.frame_remainder)
        except ValueError as err:
            return [*super().problems(config, arch), ("data.video.frame_buckets", f"{err} for this {arch.record.name} pipeline")]
        if video.sample_frames and not self.accepts_frames(video.sample_frames):
            return [*super().problems(config, arch), ("data.video.sample_frames", f"{video.sample_frames} frames cannot be decoded by this {arch.record.name} pipeline's VAE: "
                                                      f"use {self.frame_rule} (e.g. {buckets[-1]})")]
        return super().problems(config, arch)

    def planned_shape(self, frame_buckets, prompt_tokens):
        """The longest clip the run trains on, and the prompt length its tokenizer pads to."""
        return {"frames": max(frame_buckets), "text_tokens": prompt_tokens}

    def scan(self, image_dir, caption_ext):
        from zeropipe.data.images import scan_image_folder
        from zeropipe.data.videos import VIDEO_SUFFIXES, probe_video

        return scan_image_folder(image_dir, caption_ext=caption_ext, video_probe=probe_video, video_suffixes=VIDEO_SUFFIXES)

    def take_clips(self, config, name, items, buckets):
        """The clips a video model trains on: per video, clips of the longest frame bucket it fills, taken as data.video.clip_mode says.

        Raises:
            ConfigError: frame buckets or a sample length the VAE does not accept.
            DataError: no file fills a frame bucket.
        """
        from zeropipe.data.videos import check_frame_buckets, clip_starts, resampled_frames
        from zeropipe.errors import ConfigError, DataError

        video = config.data.video
        try:
            frame_buckets = check_frame_buckets(video.frame_buckets, self.accepts_frames, self.frame_multiple, self.frame_remainder)
        except ValueError as err:
            raise ConfigError([("data.video.frame_buckets", f"{err} for this {name} pipeline")]) from None
        fps = self.frame_rate if video.fps == "auto" else float(video.fps)
        sample_frames = video.sample_frames or frame_buckets[-1]
        if not self.accepts_frames(sample_frames):
            raise ConfigError([("data.video.sample_frames", f"{sample_frames} frames cannot be decoded by this {name} pipeline's VAE: use {self.frame_rule} (e.g. {frame_buckets[-1]})")])
        clips, clip_buckets, too_short = [], [], []
        for item, (width, height) in zip(items, buckets):
            available = resampled_frames(item["frames"], item["fps"], fps)
            fitting = [count for count in frame_buckets if count <= available]
            if not fitting:
                too_short.append(f"{item['path']} ({available} frame(s))")
                continue
            length = fitting[-1]
            for start in clip_starts(available, length, video.clip_mode):
                clips.append({**item, "start": start})
                clip_buckets.append((width, height, length))
        notes = []
        if too_short:
            smallest = frame_buckets[0]
            notes.append(f"{len(too_short)} file(s) are shorter than the shortest frame bucket ({smallest}) and do not train (e.g. {too_short[0]}): add 1 to data.video.frame_buckets to train images and short clips")
        if not clips:
            raise DataError(f"no video or image fills a frame bucket of {frame_buckets}: lower data.video.frame_buckets (1 trains images, 17 clips of a second at 16 fps)")
        counts = Counter(bucket[2] for bucket in clip_buckets)
        notes.append("clips per length: " + ", ".join(f"{count} of {frames} frame(s)" for frames, count in sorted(counts.items())) + f" at {fps:g} fps ({video.clip_mode})")
        return clips, clip_buckets, fps, sample_frames, notes

    def clip(self, item, fps):
        return (item["start"], fps)

    def synthetic_folder(self, root, config):
        from zeropipe.data.videos import generate_moving_shapes_dataset

        synthetic, resolution = config.data.synthetic, config.data.images.resolution
        frames = max(config.data.video.frame_buckets)
        return root / f"moving-shapes-n{synthetic.examples}-seed{synthetic.seed}-res{resolution}-f{frames}", lambda folder: generate_moving_shapes_dataset(
            folder, synthetic.examples, synthetic.seed, resolution=resolution, frames=frames
        )

    def synthetic_prompts(self, count, seed):
        from zeropipe.data.videos import moving_shapes_prompts

        return moving_shapes_prompts(count, seed=seed)

    def batching_note(self):
        return "a micro-batch takes clips of one bucket (size and length) only"

    def load_pixels(self, plan, index, bucket, crop, flip, rng=None):
        """An item's clip (3, T, H, W) at its bucket (an image is one frame)."""
        from zeropipe.data.videos import load_clip_for_bucket

        item = plan.items[index]
        return load_clip_for_bucket(Path(item["path"]), tuple(bucket), item["start"], item["fps"], plan.fps, crop=crop, flip=flip, rng=rng)

    def sample_bucket(self, size):
        return (size, size, 1)

    def fitting_pixels(self, vae, seed):
        """Moving-shape clips (N, 3, T, H, W) in [-1, 1] of 2 latent frames after the first."""
        import random

        import numpy as np

        from zeropipe.data.videos import moving_example, moving_shape_frames

        rng = random.Random(seed + 7)
        size, frames = 32, self.clip_length(2)
        clips = [moving_shape_frames(*moving_example(rng)[:3], direction, (size, size), frames, rng) for direction in ("left", "right", "up", "down", None) * 24]
        return torch.from_numpy(np.stack(clips)).float().div(127.5).sub(1.0).permute(0, 4, 1, 2, 3).contiguous()

    def fitting_batch(self, batch):
        return max(2, batch // 4)

    def sample_kwargs(self, plan):
        return {"num_frames": plan.sample_frames}

    def write_samples(self, folder, prompts, pixels, plan, step, rows):
        """Write decoded clips (uint8, (B, 3, T, H, W)) as H.264 mp4 files with an animated WebP beside each (the run page shows it in place)."""
        from zeropipe.data.videos import write_preview, write_video

        written = []
        clips = pixels.permute(0, 2, 3, 4, 1).cpu().numpy()
        for number, (prompt, frames, extra) in enumerate(zip(prompts, clips, rows)):
            write_video(folder / f"{number:02d}.mp4", frames, plan.fps or 16.0)
            write_preview(folder / f"{number:02d}.webp", frames, plan.fps or 16.0)
            written.append({
                "step": step, "prompt": prompt, "file": f"{folder.name}/{number:02d}.webp", "video": f"{folder.name}/{number:02d}.mp4", "frames": len(frames), **extra,
            })
        return written


def per_channel_normalization(vae_config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(shift, scale) per channel from ``latents_mean`` / ``latents_std`` in a VAE config (Wan's and Qwen-Image's VAEs)."""
    mean = torch.tensor(vae_config["latents_mean"], dtype=torch.float32)
    return mean, 1.0 / torch.tensor(vae_config["latents_std"], dtype=torch.float32)


def per_channel_statistics(latents: torch.Tensor) -> dict[str, Any]:
    """The ``latents_mean`` / ``latents_std`` config fields that normalise these latents per channel."""
    per_channel = latents.transpose(0, 1).flatten(1)
    return {"latents_mean": [round(float(v), 5) for v in per_channel.mean(1)], "latents_std": [round(float(v), 5) for v in per_channel.std(1)]}


@dataclass(frozen=True)
class PerChannelVideoLatents(VideoLatents):
    """Wan's VAE: latents normalised per channel by ``latents_mean`` / ``latents_std`` in its config."""

    def normalization(self, vae_config, vae_dir=None):
        return per_channel_normalization(vae_config)

    def statistics_config(self, latents):
        return per_channel_statistics(latents)
