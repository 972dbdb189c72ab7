"""The model-level knobs the search turns beside the ZeRO ones: caches, the frozen base's storage, image size and clip length.

A ``Setting`` is one value of one such knob, with what it costs: an *exact* setting (caching
latents and text) changes no result and may be picked; an *offered* one (an fp8 or nf4 base, a
lower resolution or fewer frames) changes what is trained and is only offered, with its price,
as "fits if you ...". Each returns a new ``ModelSpec``; nothing here touches a device.

Activations at another resolution or clip length are scaled from the one trace the spec holds
(tracing again costs seconds per shape): with fused attention a diffusion transformer's saved
activations are linear in its tokens, text tokens (constant) plus latent tokens (pixels x
latent frames). The scale is an upper bound both ways: below the traced size the text tokens'
share is taken at its largest (the latent counted in 2x2 patches, the coarsest any catalog
entry uses), above it every byte is scaled with the latent tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from zeropipe.plan.model_spec import CATALOG_DIR, ModelSpec, QuantizedBase, catalog_names

# Quality price order of the offered changes (lower is offered first); exact settings cost 0.
RANK_FP8 = 1.0
RANK_NF4 = 2.0
RANK_SHAPE = 3.0  # plus the share of pixels x frames given up

# What a quantized base costs in result, as measured in this project (docs/plan.md, docs/diffusion.md).
FP8_PRICE = "the frozen base's block linears rounded to fp8 (e4m3, a scale per channel: 2.6% RMS per weight on random-normal blocks; mean LoRA loss within 0.8% of bf16's on tiny Wan, Qwen-Image, FLUX.1)"
NF4_PRICE = "the frozen base's block linears in 4-bit NF4 (a layer's output 8.9% RMS from bf16's on a 256->512 layer, 2.3% on the tiny Wan denoiser; every rank holds the whole base: ZeRO-0..2)"


@dataclass(frozen=True)
class Setting:
    """One value of a model-level knob, as a run-config key, with whether it changes the result and what it costs."""

    knob: str  # "cache", "base", "resolution_frames", "lora_targets", "sequence_parallel"
    key: str  # the run-config keys and values, e.g. "model.quantization: fp8"
    exact: bool
    price: str = ""  # what it changes in the result (offered settings), or what it costs in time
    rank: float = 0.0  # order among the offered changes: the cheapest in quality first
    value: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"knob": self.knob, "key": self.key, "exact": self.exact, "price": self.price, "value": self.value}


# ------------------------------------------------------------------ caches (exact)
def with_caches(spec: ModelSpec, latents: bool = True, text: bool = True) -> ModelSpec:
    """The run ``data.cache.latents`` / ``data.cache.text`` make: cached encoders are loaded once per node before the ranks, never by a rank."""
    models = spec.frozen_models + spec.cached_models
    cached = {m.name for m in models if (latents and m.name.startswith("vae")) or (text and not m.name.startswith("vae"))}
    return replace(spec, frozen_models=tuple(m for m in models if m.name not in cached), cached_models=tuple(m for m in models if m.name in cached))


def cache_settings(spec: ModelSpec) -> list[tuple[Setting, ModelSpec]]:
    """Caching latents and text (the config defaults), when the spec still loads encoders on every rank."""
    if not spec.frozen_models:
        return []
    cached = with_caches(spec)
    return [(Setting("cache", "data.cache: {latents: true, text: true}", True, "one pass over the data before training, encoders loaded once per node", 0.0, True), cached)]


# ------------------------------------------------------------------ the frozen base's storage (offered)
def base_settings(spec: ModelSpec) -> list[tuple[Setting, ModelSpec]]:
    """An fp8 base (any family, any ZeRO stage) and an nf4 base (causal LMs any stage; diffusion denoisers ZeRO-0..2), for a LoRA run on a 16-bit base."""
    if spec.lora is None or spec.fp8_base is not None or spec.quantized is not None or spec.block_linear_params == 0:
        return []
    out = [(Setting("base", "model.quantization: fp8", False, FP8_PRICE, RANK_FP8, "fp8"), spec.with_fp8_base("fp8"))]
    if spec.block is not None:  # a decoder (causal LM, VLM): transformers quantizes every linear but the head
        nf4 = QuantizedBase(spec.quantizable_params, spec.frozen_base_params - spec.quantizable_params, True)
    else:
        nf4 = QuantizedBase(spec.block_linear_params, spec.frozen_base_params - spec.block_linear_params, True)
    out.append((Setting("base", "model.quantization: nf4", False, NF4_PRICE, RANK_NF4, "nf4"), replace(spec, quantized=nf4)))
    return out


def stages_for(setting_values: dict[str, Any], spec: ModelSpec) -> tuple[int, ...] | None:
    """ZeRO stages a model-level setting allows (None: all): a denoiser's bitsandbytes base (no decoder block) is refused under ZeRO-3."""
    if setting_values.get("base") == "nf4" and spec.block is None:
        return (0, 1, 2)
    return None


# ------------------------------------------------------------------ resolution and frames
@dataclass(frozen=True)
class Shape:
    resolution: int
    frames: int

    def describe(self) -> str:
        return f"{self.resolution}x{self.resolution} px" + (f" x {self.frames} frames" if self.frames > 1 else "")


def traced_shape(spec: ModelSpec) -> Shape | None:
    trace = spec.activation_trace
    return None if trace is None else Shape(trace.resolution, trace.frames)


def shape_scale(spec: ModelSpec, shape: Shape) -> float:
    """The upper-bound factor on the traced activations at ``shape`` (see the module docstring)."""
    trace = spec.activation_trace
    assert trace is not None
    temporal = max(1, getattr(trace, "temporal_factor", 0) or _entry_value(spec, "vae_temporal_factor", 4))
    latent_frames = lambda f: (f - 1) // temporal + 1 if f > 1 else 1  # noqa: E731
    ratio = (shape.resolution / trace.resolution) ** 2 * latent_frames(shape.frames) / latent_frames(trace.frames)
    if ratio >= 1:
        return ratio
    text = getattr(trace, "text_tokens", 0) or _entry_value(spec, "text_tokens", 0)
    vae = getattr(trace, "vae_factor", 0) or _entry_value(spec, "vae_factor", 8)
    latent_tokens = (trace.resolution // vae // 2) ** 2 * latent_frames(trace.frames)
    share = text / (text + latent_tokens) if text + latent_tokens else 0.0
    return share + (1 - share) * ratio


def with_shape(spec: ModelSpec, shape: Shape) -> ModelSpec:
    """The spec with its activations (and forward FLOPs) at ``shape``, scaled from its trace."""
    trace = spec.activation_trace
    assert trace is not None
    if (shape.resolution, shape.frames) == (trace.resolution, trace.frames):
        return spec
    k = shape_scale(spec, shape)
    scaled = replace(
        trace,
        resolution=shape.resolution,
        frames=shape.frames,
        saved_bytes=int(trace.saved_bytes * k),
        checkpointed_bytes=int(trace.checkpointed_bytes * k),
        largest_block_bytes=int(trace.largest_block_bytes * k),
        forward_flops=int(trace.forward_flops * k),
    )
    # What activation offload moves and leaves (where the trace counts it) scales with the same tokens.
    extra = {}
    if getattr(trace, "offloaded_sizes", None):
        extra["offloaded_sizes"] = tuple(int(size * k) for size in trace.offloaded_sizes)
    if getattr(trace, "offload_resident_bytes", None):
        extra["offload_resident_bytes"] = int(trace.offload_resident_bytes * k)
    return replace(spec, activation_trace=replace(scaled, **extra))


def smaller_shapes(spec: ModelSpec) -> list[Shape]:
    """Shapes below the traced one, largest first: resolutions in steps of 64 px down to 256, and for video fewer frames."""
    base = traced_shape(spec)
    if base is None:
        return []
    return [s for s in shape_grid(spec) if s.resolution * s.resolution * s.frames < base.resolution * base.resolution * base.frames]


def shape_grid(spec: ModelSpec, up_to: float = 1.5) -> list[Shape]:
    """Resolutions from 256 px to ``up_to`` x the traced one (steps of 64), x frame counts the VAE takes (steps of 4 latent frames), largest first."""
    base = traced_shape(spec)
    if base is None:
        return []
    top = int(base.resolution * up_to) // 64 * 64
    resolutions = list(range(256, top + 1, 64)) or [base.resolution]
    if base.resolution not in resolutions:
        resolutions.append(base.resolution)
    if base.frames > 1:
        temporal = max(1, _entry_value(spec, "vae_temporal_factor", 4))
        frames = sorted({base.frames, *range(1 + temporal, base.frames * 2, 4 * temporal)})
        frames = [f for f in frames if f <= int(base.frames * up_to)]
    else:
        frames = [1]
    grid = [Shape(r, f) for r in resolutions for f in frames]
    return sorted(grid, key=lambda s: (s.resolution * s.resolution * s.frames, s.frames), reverse=True)


def shape_setting(spec: ModelSpec, shape: Shape) -> Setting:
    base = traced_shape(spec)
    assert base is not None
    kept = shape.resolution**2 * shape.frames / (base.resolution**2 * base.frames)
    keys = [f"data.images.resolution: {shape.resolution}"]
    if shape.frames != base.frames:
        keys.append(f"data.video.frame_buckets: [{shape.frames}]")
    return Setting(
        "resolution_frames",
        ", ".join(keys),
        False,
        f"trains at {shape.describe()} instead of {base.describe()} ({kept:.0%} of the pixels x frames)",
        RANK_SHAPE + (1 - kept),
        {"resolution": shape.resolution, "frames": shape.frames},
    )


# ------------------------------------------------------------------ hooks for later issues
SEQUENCE_PARALLEL_PRICE = "each attention layer's q, k, v and output cross the group's links in an all-to-all, priced in the step time"


def sequence_parallel_degrees(spec: ModelSpec, world_size: int) -> list[int]:
    """The degrees > 1 that split this model's attention heads and these ranks evenly, where ZeRO-Pipe trains it with sequence parallelism."""
    if spec.block is not None and spec.block.heads:  # a language model counted by its layer shape
        heads = spec.block.heads
        kv = max(1, spec.block.kv_dim // max(1, spec.block.q_dim // heads))

        def splits(d: int) -> bool:
            return heads % d == 0 and (kv % d == 0 or d % kv == 0)
    elif spec.sequence_parallel_heads:  # a denoiser the diffusion family trains split (its spec builder says so)
        heads = spec.sequence_parallel_heads

        def splits(d: int) -> bool:
            return heads % d == 0
    else:
        return []
    return [d for d in range(2, world_size + 1) if world_size % d == 0 and splits(d)]


def sequence_parallel_settings(spec: ModelSpec, world_size: int) -> list[Setting]:
    """``parallel.sequence_parallel_size`` at each degree that splits the heads and the ranks (an exact knob: its price is time)."""
    return [
        Setting("sequence_parallel", f"parallel.sequence_parallel_size: {d}", True, SEQUENCE_PARALLEL_PRICE, 0.0, d)
        for d in sequence_parallel_degrees(spec, world_size)
    ]


def lora_target_settings(spec: ModelSpec) -> list[tuple[Setting, ModelSpec]]:
    """Narrower LoRA targets where an entry offers a narrower set: no catalog entry declares one yet (the spec would be traced again)."""
    return []


# ------------------------------------------------------------------ the catalog by Hub id
def _entry_value(spec: ModelSpec, key: str, default: int) -> int:
    entry = catalog_entry(spec.name)
    return int(entry.get(key, default)) if entry else default


def catalog_entries() -> dict[str, dict[str, Any]]:
    return {name: json.loads((CATALOG_DIR / f"{name}.json").read_text()) for name in catalog_names()}


def hub_id(entry: dict[str, Any]) -> str | None:
    """The Hugging Face repository an entry counts (``hub_id``, else the first word of its ``source``)."""
    if entry.get("hub_id"):
        return str(entry["hub_id"])
    first = str(entry.get("source", "")).split(" ", 1)[0].rstrip(",;:")
    return first if first.count("/") == 1 else None


def catalog_entry(name: str) -> dict[str, Any] | None:
    for stem, entry in catalog_entries().items():
        if name.lower() in (stem, str(entry.get("name", "")).lower()):
            return entry
    return None


def _normal(name: str) -> str:
    """A name as the match compares it: lower case, letters and digits only, without a "-Diffusers" suffix (HunyuanVideo-1.5 = hunyuan-video-1.5)."""
    name = re.sub(r"[-_]?diffusers$", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]", "", name)


def catalog_match(path: str) -> str | None:
    """The catalog entry a model path or Hub id names: its last component (or the whole id) equal to an entry's Hub repository name or catalog name.

    Compared without case, punctuation or a "-Diffusers" suffix; an exact match of the whole id wins over a last component's.
    """
    text = str(path).rstrip("/")
    last = _normal(text.rsplit("/", 1)[-1])
    whole = text.lower()
    matches = []
    for stem, entry in catalog_entries().items():
        repo = hub_id(entry)
        if repo and whole.endswith(repo.lower()):
            return stem
        names = {_normal(stem), _normal(str(entry.get("name", "")))}
        if repo:
            names.add(_normal(repo.rsplit("/", 1)[-1]))
        if last in names:
            matches.append(stem)
    return matches[0] if len(matches) == 1 else None


__all__ = [
    "Setting",
    "Shape",
    "base_settings",
    "cache_settings",
    "catalog_match",
    "shape_grid",
    "shape_setting",
    "smaller_shapes",
    "with_caches",
    "with_shape",
]
