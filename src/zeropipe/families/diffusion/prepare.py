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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeropipe.checkpoint.manager import write_atomic
from zeropipe.config.pipeline_index import is_pipeline_folder, read_pipeline_index
from zeropipe.config.schema import RunConfig
from zeropipe.families.diffusion import cache
from zeropipe.families.diffusion.entries import architecture_named, architecture_of
from zeropipe.data.images import PreparedImage
from zeropipe.families.diffusion.buckets import assign_bucket, make_buckets, micro_batches_per_rank
from zeropipe.families.diffusion.parts import Encoding, Planning, active_conditions, part_problems
from zeropipe.families.diffusion.pipelines import PipelineFolder, build_tiny_pipeline, load_component, text_pipeline, vae_scale_factor
from zeropipe.data.split import RecordSplit
from zeropipe.errors import ConfigError, DataError
from zeropipe.rundir import PreparedData, RunDir

PLAN_FILE = "diffusion.json"
BAD_SHOWN = 3
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
    missing_latents: list[int]  # items whose latents the node's setup process encodes before the ranks start (fill_caches)
    prompts: list[str]
    bad_images: list[str]
    # The prompt part's (``arch.record.text``): caption -> cache key, and the captions the node's setup encodes.
    text_keys: dict[str, str] = field(default_factory=dict)
    missing_texts: list[str] = field(default_factory=list)
    video: bool = False  # latents have a time axis; items are clips
    fps: float | None = None  # frame rate clips are taken at
    sample_frames: int = 1  # length of the sample videos
    denoiser: str = ""  # the pipeline folder trained: the architecture's denoiser, or Wan 2.2's transformer_2 (model.diffusion.expert)
    # Edit training (the control image part and the prompt part that sees it): items carry "control", the control image's path.
    item_text_keys: list[list[str]] = field(default_factory=list)  # PromptWithControlImage: per item, keys of (caption, its control) and ("", its control)
    sample_controls: list[int] = field(default_factory=list)  # per sample prompt, the item whose control image it edits
    sample_text_keys: list[list[str]] = field(default_factory=list)  # PromptWithControlImage: per sample prompt, keys of (prompt, control) and ("", control)
    missing_control_texts: list[list] = field(default_factory=list)  # [key, text, item index, bucket] to encode with the item's control image
    # The entry's conditions this run has (their entry names), decided here once: those the folder has and the settings ask for. None: a plan from before.
    conditions: list[str] | None = None
    # The held-out items (data.eval_path's, or data.eval_fraction of data.path's), in a fixed order: the validation loss's (families/diffusion/validation.py).
    eval_items: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.denoiser:  # a plan written before experts: the architecture's own
            self.denoiser = architecture_named(self.architecture).record.denoiser

    def write(self, run: RunDir) -> None:
        run.data.mkdir(exist_ok=True)
        write_atomic(run.data / PLAN_FILE, json.dumps(asdict(self)))


def read_plan(run: RunDir) -> DiffusionPlan:
    return DiffusionPlan(**json.loads((run.data / PLAN_FILE).read_text()))


def planned_conditions(arch: Any, folder: PipelineFolder, plan: DiffusionPlan) -> list[Any]:
    """The conditions the launcher's data step chose for the run (``DiffusionPlan.conditions``; for a plan from before it, those the folder has)."""
    return [condition for condition in arch.record.conditions if condition.active(folder) and (plan.conditions is None or condition.entry in plan.conditions)]


def prepare_diffusion_data(config: RunConfig, run: RunDir, reuse: bool) -> PreparedData:
    notes: list[str] = []
    pipeline_dir = pipeline_dir_for(config, run)
    if config.model.path is None and not is_pipeline_folder(pipeline_dir):
        run.write_progress(f"building the {config.model.config.get('pipeline', 'inline')} pipeline")
        build_tiny_pipeline(config.model.config or {}, pipeline_dir, seed=config.run.seed, progress=run.write_progress)
        notes.append(f"built the {config.model.config['pipeline']} pipeline with random weights in {pipeline_dir}")
    arch = architecture_of(pipeline_dir, config.model.diffusion.task)
    codec = arch.record.codec
    problems = part_problems(config, arch)
    if problems:
        raise ConfigError(problems)
    denoiser = resolve_expert(config, arch, pipeline_dir, notes)
    images = config.data.images
    if images.crop == "random" and config.data.cache.latents:
        raise ConfigError([("data.images.crop", "random crops cannot come from cached latents: set crop: center, or data.cache.latents: false")])

    run.write_progress(f"reading the {codec.file_noun}s")
    image_dir = prepare_image_folder(config, run, codec)
    scan = codec.scan(image_dir, images.caption_ext)
    problems = [f"{bad.path}: {bad.reason}" for bad in scan.bad] + list(scan.bad_lines)
    total = len(scan.items) + len(problems)
    if problems:
        allowed = config.data.max_bad_records if config.data.max_bad_records is not None else config.data.max_bad_fraction * total
        shown = "; ".join(problems[:BAD_SHOWN])
        if len(problems) > allowed:
            raise DataError(
                f"{len(problems)} of {total} {codec.file_noun}s in {image_dir} cannot be used ({shown}{' ...' if len(problems) > BAD_SHOWN else ''}): "
                "fix or remove them, or raise data.max_bad_fraction"
            )
        notes.append(f"skipped {len(problems)} unusable {codec.file_noun}(s) in {image_dir} ({shown})")
    if scan.missing_captions:
        notes.append(f"{len(scan.missing_captions)} image(s) have no caption file and train on the empty caption (e.g. {scan.missing_captions[0]})")

    # Bucket sides must give whole latents, and whole patches for the transformers.
    factor = vae_scale_factor(pipeline_dir) * arch.record.patch_factor
    if images.bucket_step % factor or images.resolution % factor:
        raise ConfigError(
            [("data.images.bucket_step", f"{images.bucket_step} (and the resolution {images.resolution}) must be multiples of {factor} for this {arch.record.name} pipeline")]
        )
    buckets = make_buckets(images.resolution, images.bucket_step, images.max_aspect) if images.bucketing else [(images.resolution, images.resolution)]
    items = [{**asdict(item), "path": str(item.path)} for item in scan.items]
    items, held_out = held_out_items(config, codec, items, notes)
    item_buckets = [assign_bucket(item["width"], item["height"], buckets) for item in items]
    items, item_buckets, fps, sample_frames, clip_notes = codec.take_clips(config, arch.record.name, items, item_buckets)
    notes += clip_notes
    # Held-out items are planned and cached as the others, and never trained on (no repeats).
    eval_items = [index for index, item in enumerate(items) if item["path"] in held_out]

    cache_dir = cache_dir_for(config).resolve()
    folder = PipelineFolder(pipeline_dir, arch, cache_dir / "fingerprints.json")
    conditions = active_conditions(arch, folder, config)
    prompts = list(config.generate.prompts or [])
    if config.generate.prompts is None:
        prompts = codec.synthetic_prompts(4, seed=config.run.seed + 1) if config.data.synthetic is not None else sorted({item["caption"] for item in items})[:4]
    planning = Planning(config, arch, folder, image_dir, cache_dir, items, item_buckets, prompts, folder.fingerprints, notes)
    for condition in conditions:
        condition.attach(planning)
    repeats = [0 if item["path"] in held_out else item["repeats"] for item in items]

    # A condition whose encoder's output is cached with the latents makes that encoder part of every key.
    vae_fp = folder.fingerprint("vae")
    encoder_fps = [fp for condition in conditions for fp in condition.fingerprints(planning)]
    if encoder_fps:
        vae_fp = cache._digest(vae_fp, *encoder_fps)
    flips = [False, True] if images.flip > 0 else [False]
    latent_keys = [
        [
            cache.latent_key(
                Path(item["path"]), bucket, crop_name(conditions, flip), vae_fp, clip=codec.clip(item, fps),
                files=[pair for condition in conditions for pair in condition.key_files(item)],
            )
            for flip in flips
        ]
        for item, bucket in zip(items, item_buckets)
    ]
    fields: dict[str, Any] = {}
    for condition in conditions:
        fields.update(condition.plan_fields(planning))
    missing_latents = [i for i, keys in enumerate(latent_keys) if not all(cache.has_entry(cache_dir, "latents", k) for k in keys)] if config.data.cache.latents else []
    if config.data.cache.latents:
        reused = len(items) - len(missing_latents)
        notes.append(f"latent cache {cache_dir}: {reused} of {len(items)} {codec.noun} cached already, {len(missing_latents)} to encode")
    fields.update(arch.record.text.plan_fields(planning))

    plan = DiffusionPlan(
        pipeline_dir=str(pipeline_dir.resolve()),
        architecture=arch.record.name,
        image_dir=str(image_dir),
        cache_dir=str(cache_dir),
        items=items,
        buckets=[list(bucket) for bucket in item_buckets],
        repeats=repeats,
        flips=flips,
        latent_keys=latent_keys,
        missing_latents=missing_latents,
        prompts=prompts,
        bad_images=problems,
        video=codec.video,
        fps=fps,
        sample_frames=sample_frames,
        denoiser=denoiser,
        conditions=[condition.entry for condition in conditions],
        eval_items=eval_items,
        **fields,
    )
    texts_missing = arch.record.text.missing(plan)
    if config.data.cache.latents and config.data.cache.text and not missing_latents and not texts_missing:
        notes.append("caches complete: the training ranks will not load the VAE or the text encoders")
    plan.write(run)
    return PreparedData(
        examples=sum(repeats),
        hidden_size=None,
        micro_batches_per_epoch=lambda micro, world_size: micro_batches_per_rank(item_buckets, repeats, micro, world_size),
        prompts=prompts,
        notes=notes,
        batching_note=codec.batching_note(),
        node_setup="zeropipe.families.diffusion.prepare:fill_caches" if missing_latents or texts_missing else None,
    )


def held_out_items(config: RunConfig, codec, items: list[dict[str, Any]], notes: list[str]) -> tuple[list[dict[str, Any]], set[str]]:
    """The items with data.eval_path's appended, and the paths of the held-out ones (data.eval_path's, or data.eval_fraction of data.path's).

    The fraction is drawn by file with run.seed (``data.split.RecordSplit``, as the language models' records are),
    so the clips of one video never fall on both sides.

    Raises:
        DataError: data.eval_path has no usable file.
    """
    data = config.data
    if data.eval_fraction:
        paths = sorted({item["path"] for item in items})
        held = RecordSplit(data.eval_fraction, config.run.seed, held_out=True).held_out_positions(len(paths))
        chosen = {paths[position] for position in held}
        notes.append(f"held out {len(chosen)} of {len(paths)} {codec.file_noun}s (data.eval_fraction {data.eval_fraction:g}, drawn with run.seed) for the validation loss")
        return items, chosen
    if not data.eval_path:
        return items, set()
    folder = Path(data.eval_path).expanduser().resolve()
    scan = codec.scan(folder, data.images.caption_ext)
    extra = [{**asdict(item), "path": str(item.path)} for item in scan.items]
    if not extra:
        raise DataError(f"data.eval_path {folder} has no usable {codec.file_noun}: point it at a folder laid out as data.path (captions beside the files)")
    if scan.bad:
        notes.append(f"skipped {len(scan.bad)} unusable {codec.file_noun}(s) in data.eval_path {folder} ({scan.bad[0].path}: {scan.bad[0].reason})")
    notes.append(f"validation loss on the {len(extra)} {codec.file_noun}s of {folder} (data.eval_path)")
    known = {item["path"] for item in items}
    return items + [item for item in extra if item["path"] not in known], {item["path"] for item in extra}


def resolve_expert(config: RunConfig, arch, pipeline_dir: Path, notes: list[str]) -> str:
    """The pipeline folder the run trains; for a Wan 2.2 A14B expert, min_t/max_t set to its side of the boundary.

    The pipeline's ``transformer`` handles t >= ``boundary_ratio`` (the high-noise expert),
    ``transformer_2`` the rest (WanPipeline's rule). The resolved range is written into the
    run's config.yaml, so the ranks and the export read the same.
    """
    section = config.model.diffusion
    if section.expert is None:
        return arch.record.denoiser
    folder = read_pipeline_index(pipeline_dir)
    second = f"{arch.record.denoiser}_2"
    boundary = folder.setting("boundary_ratio")
    if boundary is None or not folder.component(second)[0] or not (pipeline_dir / second).is_dir():
        raise ConfigError([(
            "model.diffusion.expert",
            (
                f"{pipeline_dir} has one {arch.record.denoiser} (no {second}/ folder and boundary_ratio in model_index.json, as Wan 2.2 A14B has): "
                "remove expert to train it on every timestep, or point model.path at a Wan 2.2 A14B directory"
            ),
        )])
    boundary = float(boundary)
    if section.expert == "high_noise":
        if section.min_t == 0:
            section.min_t = boundary
        elif section.min_t < boundary:
            raise ConfigError([("model.diffusion.min_t", f"{section.min_t} reaches below the boundary {boundary}, where the low-noise expert ({second}) denoises: raise it to {boundary} or leave it out")])
        folder = arch.record.denoiser
    else:
        if section.max_t == 1:
            section.max_t = boundary
        elif section.max_t > boundary:
            raise ConfigError([("model.diffusion.max_t", f"{section.max_t} reaches above the boundary {boundary}, where the high-noise expert ({arch.record.denoiser}) denoises: lower it to {boundary} or leave it out")])
        folder = second
    notes.append(f"training the {section.expert.replace('_', '-')} expert ({folder}/) on noise levels {section.min_t:g} to {section.max_t:g} (the pipeline's boundary: {boundary:g})")
    return folder


def load_item_pixels(plan: DiffusionPlan, index: int, bucket: tuple[int, ...], crop: str, flip: bool, rng=None) -> PreparedImage:
    """An item's pixels at its bucket: an image (3, H, W), or for video models a clip (3, T, H, W) (an image is one frame)."""
    return architecture_named(plan.architecture).record.codec.load_pixels(plan, index, bucket, crop, flip, rng)


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
    folder = PipelineFolder(pipeline_dir, arch)
    conditions = planned_conditions(arch, folder, plan)
    skipped: set[int] = set()  # items unreadable now (they were readable when the launcher scanned them)
    if plan.missing_latents:
        run.write_progress("loading the VAE to fill the latent cache")
        vae = load_component(pipeline_dir, "vae", torch.float32, device)
        # What each condition encodes with besides the VAE (Wan 2.1 I2V: the pipeline's image encoder).
        encoders = [condition.encoder(folder, encoder_dtype, device) for condition in conditions]
        # One VAE call per chunk of items of the same bucket and flip, as training batches them.
        jobs: dict[tuple, list[tuple[int, bool, str]]] = {}
        for index in plan.missing_latents:
            for flip, key in zip(plan.flips, plan.latent_keys[index]):
                jobs.setdefault((tuple(plan.buckets[index]), flip), []).append((index, flip, key))
        total, done = sum(len(entries) for entries in jobs.values()), 0
        for (bucket, _), entries in jobs.items():
            for start in range(0, len(entries), LATENT_BATCH):
                run.write_progress("caching latents", done, total)
                done += len(entries[start : start + LATENT_BATCH])
                prepared, keys, loaded = [], [], []
                for index, flip, key in entries[start : start + LATENT_BATCH]:
                    try:
                        image = load_item_pixels(plan, index, bucket, crop="center", flip=flip)
                        loaded.append([condition.load(plan, index, bucket, flip) for condition in conditions])
                        prepared.append(image)
                        keys.append(key)
                    except DataError as err:
                        skipped.add(index)
                        log.warning("skipping %s: %s", plan.items[index]["path"], err)
                if not prepared:
                    continue
                pixels = arch.record.codec.vae_pixels(torch.stack([image.pixels for image in prepared]))
                means, stds = arch.record.codec.encode(vae, pixels)
                values = [
                    condition.encode(Encoding(vae, pixels, [row[number] for row in loaded], encoder, arch.record.codec, device))
                    for number, (condition, encoder) in enumerate(zip(conditions, encoders))
                ]
                for position, (key, image, mean, std) in enumerate(zip(keys, prepared, means, stds)):
                    cache.save_entry(cache_dir, "latents", key, {
                        "mean": mean, "std": std, **{condition.entry: value[position] for condition, value in zip(conditions, values)},
                        "original_size": torch.tensor(image.original_size), "crop_top_left": torch.tensor(image.crop_top_left),
                        "target_size": torch.tensor(image.target_size),
                    })
        del vae, encoders
    run.write_progress("encoding the captions with the text encoders")
    # The ranks are not started yet: a text encoder larger than the first GPU may spread over all of them.
    texts = arch.record.text.fill_cache(plan, arch, lambda: text_pipeline(pipeline_dir, arch, encoder_dtype, device, spread=True), device, cache_dir)
    log.info(
        "caches filled: %d %s and %d caption(s) encoded on %s (text encoders in %s)%s",
        len(plan.missing_latents) - len(skipped), arch.record.codec.noun, texts, device, str(encoder_dtype).removeprefix("torch."),
        f"; {len(skipped)} unreadable now and skipped" if skipped else "",
    )


def prepare_image_folder(config: RunConfig, run: RunDir, codec) -> Path:
    synthetic = config.data.synthetic
    if synthetic is None:
        return Path(config.data.path).expanduser().resolve()
    if synthetic.task != "shapes":
        raise ConfigError([("data.synthetic.task", f"{synthetic.task} is a text task; a diffusion model trains on images: use task: shapes")])
    # In the shared cache folder, not the run: a second run with the same settings then finds
    # the same files (same modification times) and reuses their cached latents.
    folder, generate = codec.synthetic_folder(cache_dir_for(config) / "synthetic", config)
    if not folder.is_dir():
        partial = folder.with_name(folder.name + ".partial")
        generate(partial)
        partial.rename(folder)
    return folder.resolve()


def crop_name(conditions, flip: bool) -> str:
    """How a cache entry's pixels were taken (part of its key), and which conditions the entry holds besides the latents (each its suffix)."""
    return f"center{'-flip' if flip else ''}" + "".join(condition.key_suffix for condition in conditions)


def video_clips(config: RunConfig, arch, items: list[dict[str, Any]], item_buckets: list[tuple[int, int]]):
    """The clips a video model trains on (its codec's ``take_clips``): (clip items, their buckets, the frame rate, the sample length, notes)."""
    return arch.record.codec.take_clips(config, arch.record.name, items, item_buckets)
