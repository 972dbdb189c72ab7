"""Latent and text-embedding caches: encoded once per node before the ranks start, reused by later runs.

Each entry is one safetensors file named by a key that hashes everything it depends on:

- a latent entry: the image or video file (absolute path, size, modification time), its
  bucket (with the clip length for videos), crop, the clip's first frame and frame rate, and
  the VAE's fingerprint (a hash of its weights and config);
- a text entry: the caption and the fingerprint of the text encoders and tokenizers;
- edit training: a latent entry also holds its control image's latents and keys on that file
  too, and where the text encoder sees the control image (Qwen-Image-Edit), a text entry is
  one per (caption, control image file, bucket).

So a later run with the same inputs finds every entry and encodes nothing, and a changed
image, caption, resolution or model changes only the keys that depend on it. Entries are
written under a temporary name and renamed, so a run killed while caching leaves no
half-written entry behind. The folder is shared by runs (``data.cache.dir``); deleting it is
always safe.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save_file

CACHE_VERSION = 1  # bump when what an entry holds changes
# Entries up to this size are read in one call and parsed from the bytes (see load_entry).
SMALL_ENTRY_BYTES = 256 * 1024


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps([CACHE_VERSION, *parts], default=str).encode()).hexdigest()[:32]


def file_identity(path: Path) -> list:
    """What a cache entry keys on for one input file: its absolute path, size and modification time."""
    stat = Path(path).stat()
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


def latent_key(
    image: Path, bucket: tuple[int, ...], crop: str, vae_fingerprint: str, clip: tuple[int, float] | None = None, control: Path | None = None,
    files: list[tuple[str, Path]] | tuple[tuple[str, Path], ...] = (),
) -> str:
    """The key of one image's (or one video clip's: its first frame and frame rate) latents.

    ``files``: (label, file) pairs whose identity is part of the key besides the image's, from the
    conditions cached with the latents (edit training's control image); ``control`` is ("control", control).
    """
    parts = ["latent", *file_identity(image), list(bucket), crop, vae_fingerprint]
    if clip is not None:
        parts.append(list(clip))
    for label, path in ([("control", control)] if control is not None else []) + list(files):
        parts += [label, *file_identity(path)]
    return _digest(*parts)


def control_text_key(text: str, text_fingerprint: str, control: Path, bucket: tuple[int, ...]) -> str:
    """The key of a caption's conditioning computed with a control image at a bucket (Qwen-Image-Edit's text encoder sees the image)."""
    return _digest("text", text, text_fingerprint, "control", *file_identity(control), list(bucket))


def text_key(text: str, text_fingerprint: str) -> str:
    return _digest("text", text, text_fingerprint)


def entry_path(cache_dir: Path, kind: str, key: str) -> Path:
    return Path(cache_dir) / kind / key[:2] / f"{key}.safetensors"


def has_entry(cache_dir: Path, kind: str, key: str) -> bool:
    return entry_path(cache_dir, kind, key).is_file()


def save_entry(cache_dir: Path, kind: str, key: str, tensors: dict[str, torch.Tensor]) -> None:
    path = entry_path(cache_dir, kind, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({name: value.contiguous() for name, value in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def load_entry(cache_dir: Path, kind: str, key: str) -> dict[str, torch.Tensor]:
    """The tensors of one entry.

    A training step reads two entries per image, so this is on every step's path. For a small
    entry (latents of small images, short captions) safetensors' ``load_file`` costs mostly
    the mapping of the file, its page faults and its unmapping: one ``read`` and parsing the
    bytes took 0.08-0.1 ms against 0.8-1.1 ms for entries of 16-64 KB on a busy 2-core
    machine. From about 256 KB on, the mapping is the faster of the two.
    """
    path = entry_path(cache_dir, kind, key)
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size <= SMALL_ENTRY_BYTES:
            return load(handle.read())
    return load_file(str(path))


@torch.no_grad()
def encode_latent_distribution(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE's latent distribution for a batch of images (or clips, (B, 3, T, H, W)) in [-1, 1].

    The distribution is stored, not one sample of it, so that training still draws a fresh
    sample each time it sees the image (as it would without a cache).
    """
    dist = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist
    return dist.mean.float().cpu(), dist.std.float().cpu()
