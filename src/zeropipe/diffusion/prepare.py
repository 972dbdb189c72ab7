"""The launcher's part of a diffusion run: the pipeline, the images, the buckets and the cache plan.

Everything here happens once, before any rank starts: an unreadable image or an impossible
bucket is reported now, not hours in. The result is ``RUN/data/diffusion.json``, which every
rank reads: the items with their buckets and cache keys, and which cache entries are
missing (the ranks encode those, each its share, before training).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from zeropipe.checkpoint.manager import write_atomic
from zeropipe.config.schema import RunConfig
from zeropipe.diffusion import cache
from zeropipe.diffusion.architectures import architecture_of
from zeropipe.diffusion.images import (
    assign_bucket,
    generate_shapes_dataset,
    make_buckets,
    micro_batches_per_rank,
    scan_image_folder,
    shape_prompts,
)
from zeropipe.diffusion.pipelines import build_tiny_pipeline, fingerprint_files, vae_scale_factor
from zeropipe.errors import ConfigError, DataError
from zeropipe.rundir import PreparedData, RunDir

PLAN_FILE = "diffusion.json"
BAD_SHOWN = 3


def pipeline_dir_for(config: RunConfig, run: RunDir) -> Path:
    return Path(config.model.path).expanduser() if config.model.path else run.pipeline


def cache_dir_for(config: RunConfig) -> Path:
    return Path(config.data.cache.dir).expanduser() if config.data.cache.dir else Path(config.run.output_dir) / ".zeropipe-cache"


@dataclass
class DiffusionPlan:
    """The launcher's hand-over to the ranks (``RUN/data/diffusion.json``): items, buckets and the cache plan."""

    pipeline_dir: str
    architecture: str
    image_dir: str
    cache_dir: str
    items: list[dict[str, Any]]  # ImageItem fields: path, caption, width, height, repeats
    buckets: list[list[int]]  # per item: (width, height) of its bucket
    repeats: list[int]
    flips: list[bool]
    latent_keys: list[list[str]]  # per item, per flip
    text_keys: dict[str, str]  # caption -> cache key
    missing_latents: list[int]  # items whose latents the ranks encode before training
    missing_texts: list[str]
    prompts: list[str]
    bad_images: list[str]

    def write(self, run: RunDir) -> None:
        run.data.mkdir(exist_ok=True)
        write_atomic(run.data / PLAN_FILE, json.dumps(asdict(self)))


def read_plan(run: RunDir) -> DiffusionPlan:
    return DiffusionPlan(**json.loads((run.data / PLAN_FILE).read_text()))


def prepare_diffusion_data(config: RunConfig, run: RunDir, reuse: bool) -> PreparedData:
    notes: list[str] = []
    pipeline_dir = pipeline_dir_for(config, run)
    if config.model.path is None and not (pipeline_dir / "model_index.json").is_file():
        build_tiny_pipeline(config.model.config or {}, pipeline_dir, seed=config.run.seed)
        notes.append(f"built the {config.model.config['pipeline']} pipeline with random weights in {pipeline_dir}")
    arch = architecture_of(pipeline_dir)
    images = config.data.images
    if images.crop == "random" and config.data.cache.latents:
        raise ConfigError([("data.images.crop", "random crops cannot come from cached latents: set crop: center, or data.cache.latents: false")])

    image_dir = prepare_image_folder(config, run)
    scan = scan_image_folder(image_dir, caption_ext=images.caption_ext)
    problems = [f"{bad.path}: {bad.reason}" for bad in scan.bad] + list(scan.bad_lines)
    total = len(scan.items) + len(problems)
    if problems:
        allowed = config.data.max_bad_records if config.data.max_bad_records is not None else config.data.max_bad_fraction * total
        shown = "; ".join(problems[:BAD_SHOWN])
        if len(problems) > allowed:
            raise DataError(
                f"{len(problems)} of {total} images in {image_dir} cannot be used ({shown}{' ...' if len(problems) > BAD_SHOWN else ''}): "
                "fix or remove them, or raise data.max_bad_fraction"
            )
        notes.append(f"skipped {len(problems)} unusable image(s) in {image_dir} ({shown})")
    if scan.missing_captions:
        notes.append(f"{len(scan.missing_captions)} image(s) have no caption file and train on the empty caption (e.g. {scan.missing_captions[0]})")

    # Bucket sides must give whole latents, and whole patches for the transformers.
    factor = vae_scale_factor(pipeline_dir) * arch.patch_factor
    if images.bucket_step % factor or images.resolution % factor:
        raise ConfigError(
            [("data.images.bucket_step", f"{images.bucket_step} (and the resolution {images.resolution}) must be multiples of {factor} for this {arch.name} pipeline")]
        )
    buckets = make_buckets(images.resolution, images.bucket_step, images.max_aspect) if images.bucketing else [(images.resolution, images.resolution)]
    items = scan.items
    item_buckets = [assign_bucket(item.width, item.height, buckets) for item in items]
    repeats = [item.repeats for item in items]

    cache_dir = cache_dir_for(config).resolve()
    fingerprints = cache_dir / "fingerprints.json"
    vae_fp = fingerprint_files(pipeline_dir / "vae", fingerprints)
    text_fp = "+".join(fingerprint_files(pipeline_dir / name, fingerprints) for name in (*arch.text_encoders, *arch.tokenizers)) + f"/{arch.name}"
    text_fp = cache._digest(text_fp)
    prompts = list(config.generate.prompts or [])
    if config.generate.prompts is None:
        prompts = shape_prompts(4, seed=config.run.seed + 1) if config.data.synthetic is not None else sorted({item.caption for item in items})[:4]

    flips = [False, True] if images.flip > 0 else [False]
    latent_keys = [[cache.latent_key(item.path, bucket, f"center{'-flip' if flip else ''}", vae_fp) for flip in flips] for item, bucket in zip(items, item_buckets)]
    texts = sorted({item.caption for item in items} | {""} | set(prompts))
    text_keys = {text: cache.text_key(text, text_fp) for text in texts}
    missing_latents = [i for i, keys in enumerate(latent_keys) if not all(cache.has_entry(cache_dir, "latents", k) for k in keys)] if config.data.cache.latents else []
    # Sample prompts and the empty caption are always cached: sampling then needs no text encoder.
    cached_texts = texts if config.data.cache.text else sorted({""} | set(prompts))
    missing_texts = [t for t in cached_texts if not cache.has_entry(cache_dir, "text", text_keys[t])]
    if config.data.cache.latents:
        reused = len(items) - len(missing_latents)
        notes.append(f"latent cache {cache_dir}: {reused} of {len(items)} image(s) cached already, {len(missing_latents)} to encode")
    if config.data.cache.text:
        notes.append(f"text cache: {len(texts) - len(missing_texts)} of {len(texts)} caption(s) cached already, {len(missing_texts)} to encode")
    if config.data.cache.latents and config.data.cache.text and not missing_latents and not missing_texts:
        notes.append("caches complete: the training ranks will not load the VAE or the text encoders")

    DiffusionPlan(
        pipeline_dir=str(pipeline_dir.resolve()),
        architecture=arch.name,
        image_dir=str(image_dir),
        cache_dir=str(cache_dir),
        items=[{**asdict(item), "path": str(item.path)} for item in items],
        buckets=[list(bucket) for bucket in item_buckets],
        repeats=repeats,
        flips=flips,
        latent_keys=latent_keys,
        text_keys=text_keys,
        missing_latents=missing_latents,
        missing_texts=missing_texts,
        prompts=prompts,
        bad_images=problems,
    ).write(run)
    return PreparedData(
        examples=sum(repeats),
        hidden_size=None,
        micro_batches_per_epoch=lambda micro, world_size: micro_batches_per_rank(item_buckets, repeats, micro, world_size),
        prompts=prompts,
        notes=notes,
        batching_note="a micro-batch takes images of one bucket only",
    )


def prepare_image_folder(config: RunConfig, run: RunDir) -> Path:
    synthetic = config.data.synthetic
    if synthetic is None:
        return Path(config.data.path).expanduser().resolve()
    if synthetic.task != "shapes":
        raise ConfigError([("data.synthetic.task", f"{synthetic.task} is a text task; a diffusion model trains on images: use task: shapes")])
    # In the shared cache folder, not the run: a second run with the same settings then finds
    # the same files (same modification times) and reuses their cached latents.
    folder = cache_dir_for(config) / "synthetic" / f"shapes-n{synthetic.examples}-seed{synthetic.seed}-res{config.data.images.resolution}"
    if not folder.is_dir():
        partial = folder.with_name(folder.name + ".partial")
        generate_shapes_dataset(partial, synthetic.examples, synthetic.seed, resolution=config.data.images.resolution)
        partial.rename(folder)
    return folder.resolve()
