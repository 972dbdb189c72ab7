"""Wan Animate 2's conditions: a reference image of the character and a driving clip of the motion, per target clip.

diffusers' ``WanAnimate2Blocks`` (0.42) animate a reference character image (``image``) with the motion of a driving
video (``driving_video``). What the transformer sees of them, read from the blocks:

- the reference image's VAE latents (``WanAnimate2ImageVaeEncoderStep``: the mode, normalised per channel), one latent
  frame put before the clip's, under a 4-channel mask of ones; after it the previous segment's frames
  (``WanAnimate2SegmentPrevFramesStep``): for a clip's first segment the latents of a black clip of the segment's length
  under a zero mask; for a later segment the latents of the previous segment's last ``prev_segment_conditioning_frames``
  frames (1 by default) followed by black, under a mask of ones over those frames (``get_i2v_mask``);
- the reference image's CLIP features (``WanAnimate2ImageClipEncoderStep``: the penultimate hidden states at 224 px);
- the driving clip's VAE latents (``WanAnimate2SegmentVaeEncoderStep``), the tokens of the reference pass whose keys and
  values every generation frame attends to (the driving frame at its own index), and the CLIP features of its first
  frame (``WanAnimate2VideoClipEncoderStep``).

**Continuation segments.** The pipeline draws a long clip segment by segment, each advancing by the segment's length
less the carried frames, so a later segment's first frames are the previous segment's last (decoded). A training clip
that starts at its video's first frame trains as a first segment; one that starts later (``data.video.clip_mode:
multiple`` takes a longer video as several clips, ``middle`` one from its middle) trains as a later segment: its own
first ``carried_frames`` frames, which in the video are the previous segment's last, are the clean conditioning the
pipeline carries (the ground truth where the pipeline has its own decoded frames), the rest black. DiffSynth-Studio, the
one peer that trains Animate 2, takes the carried frames as a per-sample input (``animate2_refert_images``) built the same
way; its scripts train the first segment. The loss covers every frame of the clip, the carried ones too (as DiffSynth's).

**The dataset** (``data.control_path``, one folder): per target clip ``data.path/NAME.mp4`` (or ``SUB/NAME.mp4``), the
character's reference image ``NAME.<image type>`` and the driving clip ``NAME.<video type>``, at the same relative path
or at the folder's top (as control images are matched). The driving clip is taken at the target's start, frame rate,
size, crop and flip, and must be at least as long as the target's clip; the reference image at the target's size
(centre-cropped: the pipeline letterboxes it into the frame and crops the letterbox off the video; training takes the
target's own crop). A target without a usable pair is named in one error with the fix.

``AnimateReference`` caches the latents (reference frame, driving frames, previous-segment frames, on the frame axis)
with the blocks' 4-channel masks after their 16 channels (the previous-segment frames' mask says how many are carried);
``AnimateClipFeatures`` the two CLIP features (it reads the files ``AnimateReference`` attached). Both run with the
caches on: the CLIP encoder is loaded by the node's cache filling only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.confine import OUTSIDE_REASON, require_usable, usable
from zeropipe.data.images import IMAGE_SUFFIXES, load_image_for_bucket
from zeropipe.errors import ConfigError, DataError
from zeropipe.families.diffusion.parts.base import Condition, Encoding, Inputs, Planning, SampleInputs, Sampling

BAD_SHOWN = 3
MASK_CHANNELS = 4  # the blocks' i2v mask: the VAE's temporal factor
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def find_animate_pairs(items: list[dict[str, Any]], data_root: Path, control_root: Path, fps: float | None) -> list[str]:
    """Give each item its reference image and driving clip (``item["reference"]``, ``item["driving"]``, ``item["driving_fps"]``);
    one line per item that has no usable pair, naming the file looked for and why.

    Raises:
        DataError: ``control_root`` is not a folder.
    """
    from zeropipe.data.videos import VIDEO_SUFFIXES, probe_video, resampled_frames

    require_usable(control_root, "data.control_path")
    control_root = Path(control_root).expanduser().resolve()
    if not control_root.is_dir():
        raise DataError(f"data.control_path {control_root} is not a folder: point it at the folder of reference images and driving clips (NAME.png and NAME.mp4 per target clip NAME.mp4)")
    images: dict[Path, list[Path]] = {}
    videos: dict[Path, list[Path]] = {}
    for path in sorted(control_root.rglob("*")):
        if not path.is_file() or any(part.startswith(".") for part in path.relative_to(control_root).parts):
            continue
        suffix = path.suffix.lower()
        table = videos if suffix in VIDEO_SUFFIXES else images if suffix in IMAGE_SUFFIXES else None
        if table is not None:
            table.setdefault(path.relative_to(control_root).with_suffix(""), []).append(path)
    problems = []
    probed: dict[Path, Any] = {}
    for item in items:
        target = Path(item["path"])
        relative = target.resolve().relative_to(Path(data_root).resolve()).with_suffix("")
        found = {}
        for noun, table in (("reference image", images), ("driving clip", videos)):
            candidates = table.get(relative) or table.get(Path(relative.name)) or []
            if not candidates:
                problems.append(f"{target}: no {noun} {control_root / relative}.* (or {control_root / relative.name}.*)")
            elif len(candidates) > 1:
                problems.append(f"{target}: several {noun}s have its name ({', '.join(p.name for p in candidates)}): keep one")
            elif not usable(candidates[0]):
                problems.append(f"{target}: its {noun} {candidates[0]} {OUTSIDE_REASON}")
            else:
                found[noun] = candidates[0]
        if len(found) < 2:
            continue
        reference, driving = found["reference image"], found["driving clip"]
        from zeropipe.data.images import _decoded_size

        size = _decoded_size(reference)
        if isinstance(size, str):
            problems.append(f"{target}: its reference image {reference} cannot be used ({size})")
            continue
        if driving not in probed:
            probed[driving] = probe_video(driving)
        probe = probed[driving]
        if isinstance(probe, str):
            problems.append(f"{target}: its driving clip {driving} cannot be used ({probe})")
            continue
        _, _, frames, driving_fps = probe
        length = item.get("clip_frames", 1)
        available = resampled_frames(frames, driving_fps, fps)
        if available < item.get("start", 0) + length:
            problems.append(f"{target}: its driving clip {driving} has {available} frame(s) at {fps:g} fps, the target's clip needs {item.get('start', 0) + length}")
            continue
        item.update(reference=str(reference), driving=str(driving), driving_fps=float(driving_fps))
    return problems


def clip_features(image_encoder, pixels: torch.Tensor) -> torch.Tensor:
    """CLIP features of images (N, 3, H, W) in [-1, 1], as the blocks' ``clip_visual_encode``: bicubic to 224 px, CLIP's
    normalisation, the penultimate hidden states (N, tokens, 1280)."""
    images = torch.nn.functional.interpolate(pixels.float(), size=(224, 224), mode="bicubic", align_corners=False).mul(0.5).add(0.5)
    mean = torch.tensor(CLIP_MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=images.device).view(1, 3, 1, 1)
    out = image_encoder(pixel_values=((images - mean) / std).to(image_encoder.dtype), output_hidden_states=True)
    return out.hidden_states[-2]


def carried_pixels(clip: torch.Tensor, carried: int) -> torch.Tensor:
    """The previous-segment pixels of a clip (3, T, H, W) in [-1, 1] (``WanAnimate2SegmentPrevFramesStep``'s ``cond_pixels``): its
    first ``carried`` frames, black after (all black for a first segment)."""
    pixels = torch.zeros_like(clip)
    pixels[:, :carried] = clip[:, :carried]
    return pixels


def segment_masks(latent_frames: int, height: int, width: int, carried: int, device: torch.device) -> torch.Tensor:
    """The blocks' mask (``get_i2v_mask``) of the reference frame, the driving frames and the previous-segment frames, on the
    frame axis (4, 1 + 2 x latent_frames, h, w): ones, ones, ones over the carried pixel frames."""
    from diffusers.modular_pipelines.wan_animate_2.encoders import get_i2v_mask

    pixel_frames = (latent_frames - 1) * 4 + 1
    return torch.cat([
        get_i2v_mask(1, height, width, 1, device=device), get_i2v_mask(latent_frames, height, width, pixel_frames, device=device),
        get_i2v_mask(latent_frames, height, width, carried, device=device),
    ], dim=1)


def vae_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels (B, 3, T, H, W) in [-1, 1] as the blocks' ``encode_vae`` makes them latents: the mode, normalised per channel (float32)."""
    from zeropipe.families.diffusion.parts.codec import per_channel_normalization

    device, dtype = next(vae.parameters()).device, next(vae.parameters()).dtype
    shift, scale = per_channel_normalization(dict(vae.config))
    view = (1, -1, 1, 1, 1)
    latents = vae.encode(pixels.to(device, dtype)).latent_dist.mode().float()
    return (latents - shift.view(view).to(device)) * scale.view(view).to(device)


def vae_pixels(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents decoded to pixels in [-1, 1] (the blocks' ``decode_vae``)."""
    from zeropipe.families.diffusion.parts.codec import per_channel_normalization

    device, dtype = next(vae.parameters()).device, next(vae.parameters()).dtype
    shift, scale = per_channel_normalization(dict(vae.config))
    view = (1, -1, 1, 1, 1)
    return vae.decode((latents.float().to(device) / scale.view(view).to(device) + shift.view(view).to(device)).to(dtype)).sample.float()


def segment_geometry(frames: int, segment: int, carried: int) -> tuple[int, int]:
    """The pipeline's segments of a ``frames``-long clip (``WanAnimate2VideoPreprocessStep``): (padding frames, segments); each
    segment advances by ``segment - carried`` frames, and the driving clip is padded (zigzag) to a whole number of them."""
    if frames <= segment or segment <= carried:  # one segment: the clip's own length
        return 0, 1
    step = segment - carried
    leftover = (frames - carried) % step if frames > carried else 0
    padding = step - leftover if leftover else 0
    return padding, (frames + padding - carried + step - 1) // step


def zigzag_padded(clip: torch.Tensor, padding: int) -> torch.Tensor:
    """A clip (B, 3, T, H, W) with its last ``padding`` frames appended backwards (the pipeline's zigzag padding)."""
    frames = clip.shape[2]
    return torch.cat([clip, clip[:, :, frames - padding : frames].flip(2)], dim=2) if padding else clip


def load_pair(item: dict[str, Any], bucket: tuple[int, ...], fps: float | None, flip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """An item's reference image (3, H, W) and driving clip (3, T, H, W) in [-1, 1] at its bucket, crop and flip.

    Raises:
        DataError: a file cannot be decoded (the item is skipped).
    """
    from zeropipe.data.videos import load_clip_for_bucket

    width, height, frames = bucket
    reference = load_image_for_bucket(Path(item["reference"]), (width, height), crop="center", flip=flip).pixels
    driving = load_clip_for_bucket(Path(item["driving"]), (width, height, frames), item.get("start", 0), item["driving_fps"], fps, crop="center", flip=flip).pixels
    return reference, driving


@dataclass(frozen=True)
class AnimateReference(Condition):
    """The VAE latents of the reference image, the driving clip and the previous segment's frames (black for a first segment),
    with their masks, cached per target clip (see the module)."""

    carried_frames: int = 1  # the blocks' prev_segment_conditioning_frames default: what a clip starting after its video's first frame carries

    entry = "animate"
    key_suffix = "-animate-segment"  # the cache holds the masks since continuation segments (an older entry never matches)

    def config_keys(self):
        return ("data.control_path",)

    def problems(self, config, arch):
        data = config.data
        problems = []
        if not data.control_path or data.synthetic is not None:
            problems.append(("data.control_path", f"a {arch.record.name} model animates a reference image with a driving clip: set data.path (the target clips) and "
                                                  "data.control_path, a folder with NAME.png (the character) and NAME.mp4 (the motion) per target clip NAME.mp4"))
        elif not Path(data.control_path).expanduser().is_dir():
            problems.append(("data.control_path", f"{data.control_path} is not a folder: point it at the folder of reference images and driving clips (NAME.png and NAME.mp4 per target clip)"))
        if not (data.cache.latents and data.cache.text):
            problems.append(("data.cache", f"{arch.record.name} reads the reference image's and driving clip's latents and CLIP features from the caches: set data.cache.latents and data.cache.text to true"))
        return problems

    def attach(self, planning: Planning) -> None:
        config = planning.config
        if not config.data.control_path or config.data.synthetic is not None:
            raise ConfigError([("data.control_path", f"a {planning.arch.record.name} model animates a reference image with a driving clip: set data.control_path (NAME.png and NAME.mp4 per target clip NAME.mp4)")])
        for item, bucket in zip(planning.items, planning.buckets):
            item["clip_frames"] = bucket[2] if len(bucket) > 2 else 1
            # A later segment: a clip after its video's first frame, long enough to carry frames and generate more.
            item["carried_frames"] = self.carried_frames if item.get("start", 0) > 0 and item["clip_frames"] > self.carried_frames else 0
        problems = find_animate_pairs(planning.items, planning.image_dir, Path(config.data.control_path), _plan_fps(config, planning.arch))
        if problems:
            shown = "; ".join(problems[:BAD_SHOWN])
            raise DataError(
                f"{len(problems)} problem(s) with the reference images and driving clips of {len(planning.items)} target clip(s) in {Path(config.data.control_path).expanduser()} "
                f"({shown}{' ...' if len(problems) > BAD_SHOWN else ''}): give each target clip NAME.mp4 a reference image NAME.png and a driving clip NAME.mp4 at least as long, "
                "or remove those targets from data.path"
            )
        _check_sample_length(config, planning.items[0], _plan_fps(config, planning.arch))
        same = [item["path"] for item in planning.items if _same_file(Path(item["path"]), Path(item["driving"]))]
        if same:
            # NeMo AutoModel's Wan Animate 2 guide: a clip that drives itself can be copied to zero loss, ignoring the reference image.
            planning.notes.append(f"{len(same)} target clip(s) are their own driving clip (e.g. {same[0]}): the model can learn to copy the driving clip "
                                  "and ignore the reference image; give each target a driving clip of the same motion in another appearance")
        planning.notes.append(f"Wan Animate 2: {len(planning.items)} target clip(s), each with its reference image and driving clip from {Path(config.data.control_path).expanduser()}")
        later = sum(1 for item in planning.items if item["carried_frames"])
        if later:
            planning.notes.append(f"Wan Animate 2: {later} of {len(planning.items)} clip(s) start after their video's first frame and train as later segments, their first "
                                  f"{self.carried_frames} frame(s) carried clean as the pipeline carries the previous segment's (data.video.clip_mode: start trains first segments only)")

    def key_files(self, item):
        return (("reference", Path(item["reference"])), ("driving", Path(item["driving"])))

    def load(self, plan, index, bucket, flip):
        item = plan.items[index]
        return (*load_pair(item, tuple(bucket), plan.fps, flip), int(item.get("carried_frames", 0)))

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        codec, vae = encoding.codec, encoding.vae
        dtype = encoding.pixels.dtype
        references = torch.stack([loaded[0] for loaded in encoding.loaded]).to(encoding.device, dtype)
        driving = torch.stack([loaded[1] for loaded in encoding.loaded]).to(encoding.device, dtype)
        carried = [loaded[2] if len(loaded) > 2 else 0 for loaded in encoding.loaded]
        # The clip's own first frames, as the target's pixels were encoded (its crop and flip).
        previous = torch.stack([carried_pixels(clip, count) for clip, count in zip(encoding.pixels.to(encoding.device, dtype), carried)])
        reference_latents = codec.encode(vae, references[:, :, None])[0]
        driving_latents = codec.encode(vae, driving)[0]
        previous_latents = codec.encode(vae, previous)[0]
        latents = torch.cat([reference_latents, driving_latents, previous_latents], dim=2).float().cpu()
        frames, height, width = driving_latents.shape[2:]
        return [torch.cat([value, segment_masks(frames, height, width, count, torch.device("cpu"))]) for value, count in zip(latents, carried)]

    def inputs(self, values: list[torch.Tensor], batch: Inputs) -> dict[str, torch.Tensor]:
        stacked = torch.stack(values).to(batch.device)
        channels = stacked.shape[1] - MASK_CHANNELS
        latents, masks = batch.normalize(stacked[:, :channels]), stacked[:, channels:].to(batch.dtype)
        frames = (latents.shape[2] - 1) // 2
        return {"reference_latents": latents[:, :, :1], "driving_latents": latents[:, :, 1 : 1 + frames], "segment_latents": latents[:, :, 1 + frames :],
                "segment_mask": masks[:, :, 1 + frames :]}

    def sample_components(self, sampling: Sampling) -> dict[str, Any]:
        return {"vae": sampling.vae()}

    def sample_inputs(self, sampling: Sampling, kwargs: dict[str, Any]) -> SampleInputs:
        """The first data item's reference image (encoded as training encodes it) and its driving clip's pixels at the sample's size
        and length, which the entry's sampling draws segment by segment: segments as long as the longest training clip
        (``segment_frames``), each carrying ``carried_frames`` of the one before, as the pipeline's segment loop does."""
        item = sampling.plan.items[0]
        frames = int(kwargs.get("num_frames") or sampling.plan.sample_frames)
        reference, driving = load_pair(item, (sampling.size, sampling.size, frames), sampling.plan.fps, False)
        vae = sampling.vae()
        segment = max((bucket[2] for bucket in getattr(sampling.plan, "buckets", None) or () if len(bucket) > 2), default=frames)
        animate = {"reference_latents": vae_latents(vae, reference[None, :, None]), "driving_pixels": driving[None], "segment_frames": min(segment, frames),
                   "carried_frames": self.carried_frames}
        rows = [{"reference": item["reference"], "driving": item["driving"], "segment_frames": min(segment, frames)}] * len(sampling.prompts)
        return SampleInputs(kwargs={"animate": {**kwargs.get("animate", {}), **animate}}, rows=rows)


@dataclass(frozen=True)
class AnimateClipFeatures(Condition):
    """The CLIP features of the reference image and of the driving clip's first frame (``image_encoder``), cached per target clip."""

    component: str = "image_encoder"

    entry = "animate_clip"
    key_suffix = "-animate-clip"

    def fingerprints(self, planning: Planning) -> tuple[str, ...]:
        return (planning.folder.fingerprint(self.component),)

    def encoder(self, folder, dtype, device):
        return folder.component(self.component, dtype, device)

    def load(self, plan, index, bucket, flip):
        # The first driving frame only: CLIP sees nothing else of the clip.
        reference, driving = load_pair(plan.items[index], (*tuple(bucket)[:2], 1), plan.fps, flip)
        return reference, driving[:, 0]

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        if encoding.encoder is None:
            raise DataError("Wan Animate 2's CLIP features are computed while the caches are filled: set data.cache.latents: true")
        images = torch.stack([image for pair in encoding.loaded for image in pair]).to(encoding.device)
        with torch.no_grad():
            features = clip_features(encoding.encoder, images).float().cpu()
        return list(features.view(len(encoding.loaded), 2, *features.shape[1:]))

    def inputs(self, values: list[torch.Tensor], batch: Inputs) -> dict[str, torch.Tensor]:
        features = torch.stack(values).to(batch.device, batch.dtype)
        return {"reference_clip": features[:, 0], "driving_clip": features[:, 1]}

    def sample_inputs(self, sampling: Sampling, kwargs: dict[str, Any]) -> SampleInputs:
        item = sampling.plan.items[0]
        reference, driving = load_pair(item, (sampling.size, sampling.size, 1), sampling.plan.fps, False)
        encoder = sampling.folder.component(self.component, torch.float32, sampling.device)
        with torch.no_grad():
            features = clip_features(encoder, torch.stack([reference, driving[:, 0]]).to(sampling.device)).float()
        return SampleInputs(kwargs={"animate": {**kwargs.get("animate", {}), "reference_clip": features[:1], "driving_clip": features[1:]}})


def _check_sample_length(config: Any, first: dict[str, Any], fps: float | None) -> None:
    """Samples are drawn with the first target's driving clip, as long as ``data.video.sample_frames``: refuse one too short before training.

    Raises:
        DataError: the driving clip has fewer frames from the target's start than the samples need.
    """
    from zeropipe.data.videos import probe_video, resampled_frames

    wanted = getattr(config.data.video, "sample_frames", None)
    if not wanted or wanted <= first.get("clip_frames", 1):
        return
    probe = probe_video(Path(first["driving"]))
    available = (resampled_frames(probe[2], probe[3], fps) - first.get("start", 0)) if not isinstance(probe, str) else 0
    if available < wanted:
        raise DataError(f"data.video.sample_frames is {wanted}: the samples follow the first target's driving clip {first['driving']}, which has {available} frame(s) "
                        f"from the target's start: set data.video.sample_frames to at most {available}, or give that target a longer driving clip")


def _same_file(target: Path, driving: Path) -> bool:
    """Whether the driving clip is the target clip (the same file, or the same bytes)."""
    import filecmp

    try:
        return target.resolve() == driving.resolve() or (target.stat().st_size == driving.stat().st_size and filecmp.cmp(target, driving, shallow=False))
    except OSError:
        return False


def _plan_fps(config: Any, arch: Any) -> float | None:
    """The frame rate clips are taken at (``data.video.fps``, or the codec's own)."""
    fps = config.data.video.fps
    return arch.record.codec.frame_rate if fps == "auto" else float(fps)
