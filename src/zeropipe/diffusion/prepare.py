"""The launcher's part of a diffusion run: the pipeline, the images, the buckets and the caches.

Everything here happens once, before any rank starts: an unreadable image or an impossible
bucket is reported now, not hours in. The result is ``RUN/data/diffusion.json``, which every
rank reads: the items with their buckets and cache keys, and which cache entries are
missing. Those are encoded by :func:`fill_caches`, which one process per node runs before
the node's ranks start (``PreparedData.node_setup``; ``zeropipe.launch.node_setup``): the node
holds one copy of the VAE and of the text encoders whatever its number of GPUs, and the
ranks, started after, only read the caches and never load an encoder.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeropipe.checkpoint.manager import write_atomic
from zeropipe.config.schema import RunConfig
from zeropipe.diffusion import cache
from zeropipe.diffusion.architectures import architecture_named, architecture_of
from zeropipe.diffusion.images import (
    PreparedImage,
    assign_bucket,
    generate_shapes_dataset,
    load_image_for_bucket,
    make_buckets,
    match_control_images,
    micro_batches_per_rank,
    scan_image_folder,
    shape_prompts,
)
from zeropipe.diffusion.pipelines import (
    build_tiny_pipeline,
    encode_prompts,
    fingerprint_files,
    image_encoder_pipeline,
    image_encoding,
    load_component,
    text_pipeline,
    vae_scale_factor,
)
from zeropipe.diffusion.videos import (
    VIDEO_SUFFIXES,
    check_frame_buckets,
    clip_starts,
    generate_moving_shapes_dataset,
    load_clip_for_bucket,
    moving_shapes_prompts,
    probe_video,
    resampled_frames,
)
from zeropipe.errors import ConfigError, DataError
from zeropipe.rundir import PreparedData, RunDir

PLAN_FILE = "diffusion.json"
BAD_SHOWN = 3
TEXT_BATCH = 16  # captions per text-encoder call while caching
LATENT_BATCH = 8  # images or clips per VAE call while caching

log = logging.getLogger("zeropipe")


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
    items: list[dict[str, Any]]  # ImageItem fields: path, caption, width, height, repeats, frames, fps; video clips add start
    buckets: list[list[int]]  # per item: (width, height) of its bucket, and (width, height, frames) for video models
    repeats: list[int]
    flips: list[bool]
    latent_keys: list[list[str]]  # per item, per flip
    text_keys: dict[str, str]  # caption -> cache key
    missing_latents: list[int]  # items whose latents the node's setup process encodes before the ranks start (fill_caches)
    missing_texts: list[str]
    prompts: list[str]
    bad_images: list[str]
    video: bool = False  # latents have a time axis; items are clips
    fps: float | None = None  # frame rate clips are taken at
    sample_frames: int = 1  # length of the sample videos
    denoiser: str = ""  # the pipeline folder trained: the architecture's denoiser, or Wan 2.2's transformer_2 (model.diffusion.expert)
    # Edit training (data.control_path): items carry "control", the control image's path.
    item_text_keys: list[list[str]] = field(default_factory=list)  # control_in_prompt: per item, keys of (caption, its control) and ("", its control)
    sample_controls: list[int] = field(default_factory=list)  # per sample prompt, the item whose control image it edits
    sample_text_keys: list[list[str]] = field(default_factory=list)  # control_in_prompt: per sample prompt, keys of (prompt, control) and ("", control)
    missing_control_texts: list[list] = field(default_factory=list)  # [key, text, item index, bucket] to encode with the item's control image

    def __post_init__(self):
        if not self.denoiser:  # a plan written before experts: the architecture's own
            self.denoiser = architecture_named(self.architecture).denoiser

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
    denoiser = resolve_expert(config, arch, pipeline_dir, notes)
    images = config.data.images
    if images.crop == "random" and config.data.cache.latents:
        raise ConfigError([("data.images.crop", "random crops cannot come from cached latents: set crop: center, or data.cache.latents: false")])

    image_dir = prepare_image_folder(config, run, video=arch.video)
    if arch.video:
        scan = scan_image_folder(image_dir, caption_ext=images.caption_ext, video_probe=probe_video, video_suffixes=VIDEO_SUFFIXES)
    else:
        scan = scan_image_folder(image_dir, caption_ext=images.caption_ext)
    problems = [f"{bad.path}: {bad.reason}" for bad in scan.bad] + list(scan.bad_lines)
    total = len(scan.items) + len(problems)
    if problems:
        allowed = config.data.max_bad_records if config.data.max_bad_records is not None else config.data.max_bad_fraction * total
        shown = "; ".join(problems[:BAD_SHOWN])
        if len(problems) > allowed:
            raise DataError(
                f"{len(problems)} of {total} {'files' if arch.video else 'images'} in {image_dir} cannot be used ({shown}{' ...' if len(problems) > BAD_SHOWN else ''}): "
                "fix or remove them, or raise data.max_bad_fraction"
            )
        notes.append(f"skipped {len(problems)} unusable {'file' if arch.video else 'image'}(s) in {image_dir} ({shown})")
    if scan.missing_captions:
        notes.append(f"{len(scan.missing_captions)} image(s) have no caption file and train on the empty caption (e.g. {scan.missing_captions[0]})")

    # Bucket sides must give whole latents, and whole patches for the transformers.
    factor = vae_scale_factor(pipeline_dir) * arch.patch_factor
    if images.bucket_step % factor or images.resolution % factor:
        raise ConfigError(
            [("data.images.bucket_step", f"{images.bucket_step} (and the resolution {images.resolution}) must be multiples of {factor} for this {arch.name} pipeline")]
        )
    buckets = make_buckets(images.resolution, images.bucket_step, images.max_aspect) if images.bucketing else [(images.resolution, images.resolution)]
    items = [{**asdict(item), "path": str(item.path)} for item in scan.items]
    item_buckets = [assign_bucket(item["width"], item["height"], buckets) for item in items]
    fps, sample_frames = None, 1
    if arch.video:
        items, item_buckets, fps, sample_frames, clip_notes = video_clips(config, arch, items, item_buckets)
        notes += clip_notes
    if arch.control_images or config.data.control_path:
        attach_control_images(config, arch, image_dir, items, notes)
    repeats = [item["repeats"] for item in items]

    cache_dir = cache_dir_for(config).resolve()
    fingerprints = cache_dir / "fingerprints.json"
    vae_fp = fingerprint_files(pipeline_dir / "vae", fingerprints)
    first_frame_embeddings = image_encoding(pipeline_dir, arch)
    if first_frame_embeddings:
        # Wan 2.1 I2V: the first frame's image embeddings are cached with the latents, so they depend on its encoder too.
        if not config.data.cache.latents:
            raise ConfigError([("data.cache.latents", f"this {arch.name} pipeline's first-frame image embeddings ({arch.image_encoders[0]}) come from the latent cache: set data.cache.latents: true")])
        vae_fp = cache._digest(vae_fp, *(fingerprint_files(pipeline_dir / name, fingerprints) for name in arch.image_encoders))
    text_fp = "+".join(fingerprint_files(pipeline_dir / name, fingerprints) for name in (*arch.text_encoders, *arch.tokenizers, *arch.prompt_processors)) + f"/{arch.name}"
    text_fp = cache._digest(text_fp)
    prompts = list(config.generate.prompts or [])
    if config.generate.prompts is None:
        synthetic_prompts = moving_shapes_prompts if arch.video else shape_prompts
        prompts = synthetic_prompts(4, seed=config.run.seed + 1) if config.data.synthetic is not None else sorted({item["caption"] for item in items})[:4]

    flips = [False, True] if images.flip > 0 else [False]
    latent_keys = [
        [
            cache.latent_key(
                Path(item["path"]), bucket, crop_name(arch, flip, first_frame_embeddings), vae_fp, clip=(item["start"], fps) if arch.video else None,
                control=Path(item["control"]) if arch.control_images else None,
            )
            for flip in flips
        ]
        for item, bucket in zip(items, item_buckets)
    ]
    sample_controls = [sample_control_item(items, prompt, number) for number, prompt in enumerate(prompts)] if arch.control_images else []
    item_text_keys, sample_text_keys, control_texts = [], [], []
    if arch.control_in_prompt:
        # The text encoder sees the control image: one entry per (caption, control image, bucket), the empty caption's too (caption dropout, guidance).
        sample_bucket = (images.resolution, images.resolution)
        for index, (item, bucket) in enumerate(zip(items, item_buckets)):
            item_text_keys.append([cache.control_text_key(text, text_fp, Path(item["control"]), bucket) for text in (item["caption"], "")])
            control_texts += [[key, text, index, list(bucket)] for key, text in zip(item_text_keys[-1], (item["caption"], ""))]
        for prompt, index in zip(prompts, sample_controls):
            sample_text_keys.append([cache.control_text_key(text, text_fp, Path(items[index]["control"]), sample_bucket) for text in (prompt, "")])
            control_texts += [[key, text, index, list(sample_bucket)] for key, text in zip(sample_text_keys[-1], (prompt, ""))]
        control_texts = list({entry[0]: entry for entry in control_texts}.values())
    # Captions encoded alone; with control_in_prompt every caption is encoded with its control image instead.
    texts = [] if arch.control_in_prompt else sorted({item["caption"] for item in items} | {""} | set(prompts))
    text_keys = {text: cache.text_key(text, text_fp) for text in texts}
    missing_latents = [i for i, keys in enumerate(latent_keys) if not all(cache.has_entry(cache_dir, "latents", k) for k in keys)] if config.data.cache.latents else []
    # Sample prompts and the empty caption are always cached: sampling then needs no text encoder.
    cached_texts = texts if config.data.cache.text else sorted({""} | set(prompts))
    missing_texts = [t for t in cached_texts if not cache.has_entry(cache_dir, "text", text_keys[t])]
    missing_control_texts = [entry for entry in control_texts if not cache.has_entry(cache_dir, "text", entry[0])]
    if config.data.cache.latents:
        reused = len(items) - len(missing_latents)
        what = "clip(s)" if arch.video else "image(s)"
        notes.append(f"latent cache {cache_dir}: {reused} of {len(items)} {what} cached already, {len(missing_latents)} to encode")
    if config.data.cache.text:
        if arch.control_in_prompt:
            notes.append(
                f"text cache: {len(control_texts) - len(missing_control_texts)} of {len(control_texts)} (caption, control image) pair(s) cached already, "
                f"{len(missing_control_texts)} to encode"
            )
        else:
            notes.append(f"text cache: {len(texts) - len(missing_texts)} of {len(texts)} caption(s) cached already, {len(missing_texts)} to encode")
    if config.data.cache.latents and config.data.cache.text and not missing_latents and not missing_texts and not missing_control_texts:
        notes.append("caches complete: the training ranks will not load the VAE or the text encoders")

    DiffusionPlan(
        pipeline_dir=str(pipeline_dir.resolve()),
        architecture=arch.name,
        image_dir=str(image_dir),
        cache_dir=str(cache_dir),
        items=items,
        buckets=[list(bucket) for bucket in item_buckets],
        repeats=repeats,
        flips=flips,
        latent_keys=latent_keys,
        text_keys=text_keys,
        missing_latents=missing_latents,
        missing_texts=missing_texts,
        prompts=prompts,
        bad_images=problems,
        video=arch.video,
        fps=fps,
        sample_frames=sample_frames,
        denoiser=denoiser,
        item_text_keys=item_text_keys,
        sample_controls=sample_controls,
        sample_text_keys=sample_text_keys,
        missing_control_texts=missing_control_texts,
    ).write(run)
    return PreparedData(
        examples=sum(repeats),
        hidden_size=None,
        micro_batches_per_epoch=lambda micro, world_size: micro_batches_per_rank(item_buckets, repeats, micro, world_size),
        prompts=prompts,
        notes=notes,
        batching_note="a micro-batch takes clips of one bucket (size and length) only" if arch.video else "a micro-batch takes images of one bucket only",
        node_setup="zeropipe.diffusion.prepare:fill_caches" if missing_latents or missing_texts or missing_control_texts else None,
    )


def attach_control_images(config: RunConfig, arch, image_dir: Path, items: list[dict[str, Any]], notes: list[str]) -> None:
    """Give each item its control image (``item["control"]``), or refuse the run with every target that has none.

    Raises:
        ConfigError: control images given to an architecture that takes none, or missing for one that needs them.
        DataError: targets without a usable control image.
    """
    control_path = config.data.control_path
    if not arch.control_images:
        raise ConfigError([("data.control_path", f"this {arch.name} pipeline takes no control image: remove data.control_path, or train an edit model (qwen-image-edit)")])
    if control_path is None or config.data.synthetic is not None:
        raise ConfigError([("data.control_path", f"a {arch.name} model learns to edit a control image into its target: set data.control_path to a folder with a control image per image of data.path (same file names)")])
    controls, problems = match_control_images([Path(item["path"]) for item in items], image_dir, Path(control_path))
    if problems:
        shown = "; ".join(problems[:BAD_SHOWN])
        raise DataError(
            f"{len(problems)} of {len(items)} target image(s) have no usable control image in {Path(control_path).expanduser()} ({shown}{' ...' if len(problems) > BAD_SHOWN else ''}): "
            "add a control image with the target's file name for each, or remove those targets from data.path"
        )
    for item, control in zip(items, controls):
        item["control"] = str(control)
    notes.append(f"edit training: {len(items)} target image(s), each with its control image from {Path(control_path).expanduser()}")


def sample_control_item(items: list[dict[str, Any]], prompt: str, number: int) -> int:
    """The item whose control image a sample prompt edits: the first with that caption, else the items in turn."""
    return next((index for index, item in enumerate(items) if item["caption"] == prompt), number % len(items))


def first_frame_image(pixels: torch.Tensor):
    """The first frame of a clip (3, T, H, W) or an image (3, H, W) in [-1, 1], as the PIL image a pipeline takes."""
    from PIL import Image

    frame = pixels[:, 0] if pixels.dim() == 4 else pixels
    return Image.fromarray(((frame.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy())


def resolve_expert(config: RunConfig, arch, pipeline_dir: Path, notes: list[str]) -> str:
    """The pipeline folder the run trains; for a Wan 2.2 A14B expert, min_t/max_t set to its side of the boundary.

    The pipeline's ``transformer`` handles t >= ``boundary_ratio`` (the high-noise expert),
    ``transformer_2`` the rest (WanPipeline's rule). The resolved range is written into the
    run's config.yaml, so the ranks and the export read the same.
    """
    section = config.model.diffusion
    if section.expert is None:
        return arch.denoiser
    index = json.loads((pipeline_dir / "model_index.json").read_text())
    second = f"{arch.denoiser}_2"
    boundary = index.get("boundary_ratio")
    if boundary is None or not (index.get(second) or [None])[0] or not (pipeline_dir / second).is_dir():
        raise ConfigError([(
            "model.diffusion.expert",
            (
                f"{pipeline_dir} has one {arch.denoiser} (no {second}/ folder and boundary_ratio in model_index.json, as Wan 2.2 A14B has): "
                "remove expert to train it on every timestep, or point model.path at a Wan 2.2 A14B directory"
            ),
        )])
    boundary = float(boundary)
    if section.expert == "high_noise":
        if section.min_t == 0:
            section.min_t = boundary
        elif section.min_t < boundary:
            raise ConfigError([("model.diffusion.min_t", f"{section.min_t} reaches below the boundary {boundary}, where the low-noise expert ({second}) denoises: raise it to {boundary} or leave it out")])
        folder = arch.denoiser
    else:
        if section.max_t == 1:
            section.max_t = boundary
        elif section.max_t > boundary:
            raise ConfigError([("model.diffusion.max_t", f"{section.max_t} reaches above the boundary {boundary}, where the high-noise expert ({arch.denoiser}) denoises: lower it to {boundary} or leave it out")])
        folder = second
    notes.append(f"training the {section.expert.replace('_', '-')} expert ({folder}/) on noise levels {section.min_t:g} to {section.max_t:g} (the pipeline's boundary: {boundary:g})")
    return folder


def load_item_pixels(plan: DiffusionPlan, index: int, bucket: tuple[int, ...], crop: str, flip: bool, rng=None) -> PreparedImage:
    """An item's pixels at its bucket: an image (3, H, W), or for video models a clip (3, T, H, W) (an image is one frame)."""
    item = plan.items[index]
    if plan.video:
        return load_clip_for_bucket(Path(item["path"]), tuple(bucket), item["start"], item["fps"], plan.fps, crop=crop, flip=flip, rng=rng)
    return load_image_for_bucket(Path(item["path"]), tuple(bucket), crop=crop, flip=flip, rng=rng)


def fill_caches(run: RunDir, device: torch.device, encoder_dtype: torch.dtype) -> None:
    """Encode the cache entries the plan found missing, in one process for the node, before its ranks start.

    Args:
        device: the node's first GPU, or the CPU.
        encoder_dtype: what the text encoders are loaded in: bf16 where the device runs it
            natively, else fp32 (``zeropipe.launch.node_setup.encoder_precision_for``). The VAE stays in
            fp32, as diffusers' Wan and SDXL pipelines recommend (image VAEs overflow in half
            precision; it is small: 127M parameters for Wan).
    """
    import diffusers
    import transformers

    # Per-component progress bars in the log tell nothing the log lines do not.
    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()
    plan = read_plan(run)
    arch = architecture_named(plan.architecture)
    pipeline_dir, cache_dir = Path(plan.pipeline_dir), Path(plan.cache_dir)
    skipped: set[int] = set()  # items unreadable now (they were readable when the launcher scanned them)
    if plan.missing_latents:
        vae = load_component(pipeline_dir, "vae", torch.float32, device)
        # Wan 2.1 I2V: the first frame's image embeddings too, by the pipeline's own encode_image.
        image_encoder = image_encoder_pipeline(pipeline_dir, arch, encoder_dtype, device) if image_encoding(pipeline_dir, arch) else None
        # One VAE call per chunk of items of the same bucket and flip, as training batches them.
        jobs: dict[tuple, list[tuple[int, bool, str]]] = {}
        for index in plan.missing_latents:
            for flip, key in zip(plan.flips, plan.latent_keys[index]):
                jobs.setdefault((tuple(plan.buckets[index]), flip), []).append((index, flip, key))
        for (bucket, _), entries in jobs.items():
            for start in range(0, len(entries), LATENT_BATCH):
                prepared, keys, controls = [], [], []
                for index, flip, key in entries[start : start + LATENT_BATCH]:
                    try:
                        image = load_item_pixels(plan, index, bucket, crop="center", flip=flip)
                        if arch.control_images:  # at the target's bucket, crop and flip: the two token grids match
                            controls.append(load_image_for_bucket(Path(plan.items[index]["control"]), bucket, crop="center", flip=flip).pixels)
                        prepared.append(image)
                        keys.append(key)
                    except DataError as err:
                        skipped.add(index)
                        log.warning("skipping %s: %s", plan.items[index]["path"], err)
                if not prepared:
                    continue
                pixels = arch.vae_pixels(torch.stack([image.pixels for image in prepared]))
                means, stds = cache.encode_latent_distribution(vae, pixels)
                # Image-to-video: the first-frame condition, encoded as the pipeline encodes it (its mode, the mean).
                conditions = cache.encode_latent_distribution(vae, arch.conditioning_pixels(pixels))[0] if arch.frame_conditioned else [None] * len(keys)
                embeddings = [None] * len(keys)
                # Edit training: the control image's latents, as the pipeline encodes its image (the mode, the mean).
                control_latents = cache.encode_latent_distribution(vae, arch.vae_pixels(torch.stack(controls)))[0] if controls else [None] * len(keys)
                if image_encoder is not None:
                    with torch.no_grad():
                        embeddings = arch.encode_first_frames(image_encoder, [first_frame_image(p) for p in pixels], device).float().cpu()
                for key, image, mean, std, first_frame, embedding, control in zip(keys, prepared, means, stds, conditions, embeddings, control_latents):
                    cache.save_entry(cache_dir, "latents", key, {
                        "mean": mean, "std": std, **({"condition": first_frame} if first_frame is not None else {}),
                        **({"control": control} if control is not None else {}),
                        **({"image_embeds": embedding} if embedding is not None else {}),
                        "original_size": torch.tensor(image.original_size), "crop_top_left": torch.tensor(image.crop_top_left),
                        "target_size": torch.tensor(image.target_size),
                    })
        del vae, image_encoder
    if plan.missing_texts:
        encoders = text_pipeline(pipeline_dir, arch, encoder_dtype, device)
        for start in range(0, len(plan.missing_texts), TEXT_BATCH):
            texts = plan.missing_texts[start : start + TEXT_BATCH]
            for text, tensors in zip(texts, encode_prompts(encoders, arch, texts, device)):
                cache.save_entry(cache_dir, "text", plan.text_keys[text], tensors)
        del encoders
    if plan.missing_control_texts:
        # Qwen-Image-Edit: each caption encoded with its control image, at the bucket it trains (or samples) at.
        encoders = text_pipeline(pipeline_dir, arch, encoder_dtype, device)
        for start in range(0, len(plan.missing_control_texts), TEXT_BATCH):
            entries = plan.missing_control_texts[start : start + TEXT_BATCH]
            controls = [first_frame_image(load_image_for_bucket(Path(plan.items[index]["control"]), tuple(bucket), crop="center", flip=False).pixels) for _, _, index, bucket in entries]
            for (key, _, _, _), tensors in zip(entries, encode_prompts(encoders, arch, [text for _, text, _, _ in entries], device, images=controls)):
                cache.save_entry(cache_dir, "text", key, tensors)
        del encoders
    what = "clip(s)" if plan.video else "image(s)"
    log.info(
        "caches filled: %d %s and %d caption(s) encoded on %s (text encoders in %s)%s",
        len(plan.missing_latents) - len(skipped), what, len(plan.missing_texts) + len(plan.missing_control_texts), device, str(encoder_dtype).removeprefix("torch."),
        f"; {len(skipped)} unreadable now and skipped" if skipped else "",
    )


def prepare_image_folder(config: RunConfig, run: RunDir, video: bool = False) -> Path:
    synthetic = config.data.synthetic
    if synthetic is None:
        return Path(config.data.path).expanduser().resolve()
    if synthetic.task != "shapes":
        raise ConfigError([("data.synthetic.task", f"{synthetic.task} is a text task; a diffusion model trains on images: use task: shapes")])
    # In the shared cache folder, not the run: a second run with the same settings then finds
    # the same files (same modification times) and reuses their cached latents.
    resolution = config.data.images.resolution
    if video:
        frames = max(config.data.video.frame_buckets)
        folder = cache_dir_for(config) / "synthetic" / f"moving-shapes-n{synthetic.examples}-seed{synthetic.seed}-res{resolution}-f{frames}"
    else:
        folder = cache_dir_for(config) / "synthetic" / f"shapes-n{synthetic.examples}-seed{synthetic.seed}-res{resolution}"
    if not folder.is_dir():
        partial = folder.with_name(folder.name + ".partial")
        if video:
            generate_moving_shapes_dataset(partial, synthetic.examples, synthetic.seed, resolution=resolution, frames=frames)
        else:
            generate_shapes_dataset(partial, synthetic.examples, synthetic.seed, resolution=resolution)
        partial.rename(folder)
    return folder.resolve()


def crop_name(arch, flip: bool, first_frame_embeddings: bool = False) -> str:
    """How a cache entry's pixels were taken (part of its key); image-to-video entries also hold the first-frame condition (and its image embeddings), edit entries their control image's latents."""
    return f"center{'-flip' if flip else ''}{'-first-frame' if arch.frame_conditioned else ''}{'-image-embeds' if first_frame_embeddings else ''}{'-control' if arch.control_images else ''}"


def video_clips(config: RunConfig, arch, items: list[dict[str, Any]], item_buckets: list[tuple[int, int]]):
    """The clips a video model trains on: per video, clips of the longest frame bucket it fills, taken as data.video.clip_mode says.

    Returns:
        (clip items, their (width, height, frames) buckets, the frame rate, the sample length, notes)
    """
    video = config.data.video
    try:
        frame_buckets = check_frame_buckets(video.frame_buckets, arch.accepts_frames, arch.frame_multiple)
    except ValueError as err:
        raise ConfigError([("data.video.frame_buckets", f"{err} for this {arch.name} pipeline")]) from None
    if arch.frame_conditioned and frame_buckets[0] == 1:
        raise ConfigError([("data.video.frame_buckets", f"a {arch.name} model is conditioned on the first frame, which is all a one-frame clip holds: remove 1 from {frame_buckets}")])
    fps = arch.frame_rate if video.fps == "auto" else float(video.fps)
    sample_frames = video.sample_frames or frame_buckets[-1]
    if not arch.accepts_frames(sample_frames):
        raise ConfigError([("data.video.sample_frames", f"{sample_frames} frames cannot be decoded by this {arch.name} pipeline's VAE: use {arch.frame_multiple}k+1 (e.g. {frame_buckets[-1]})")])
    clips, clip_buckets, too_short = [], [], []
    for item, (width, height) in zip(items, item_buckets):
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
