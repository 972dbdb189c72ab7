"""VACE's conditions from the user's files: per target clip a control clip, a mask and a reference image (``wan-vace``).

What ``WanVACEPipeline`` takes (``video``, ``mask``, ``reference_images``) and builds into the control branch's input
(``preprocess_conditions``, ``prepare_video_latents``, ``prepare_masks``; ``parts/vace_context.py`` is that function),
read per target clip from ``data.control_path`` (one folder, laid out as Wan Animate 2's: ``parts/animate_reference.py``):

- ``NAME.<video type>``: the control clip (pose, depth, edges, scribbles... any clip), read at the target's start, frame
  rate, size, crop and flip; it must be at least as long as the target's clip;
- ``NAME_mask.<video or image type>``: the mask (white: generate, black: keep), a clip read as the control clip, or one
  image for every frame;
- ``NAME.<image type>``: a reference image (the character, the object), letterboxed on white into the clip's size as
  the pipeline does (``reference_letterboxed``); it adds one latent frame before the clip's. Several reference images
  (the pipeline's ``reference_images`` list): ``NAME.ref0.<image type>``, ``NAME.ref1.<image type>``... in the order of
  their numbers, each one more latent frame (the pipeline prepends each in turn, so the last is first); a clip has
  ``NAME.png`` or numbered ones, not both.

Each at the target's relative path or at the folder's top (``SUB/NAME.mp4`` or ``NAME.mp4``), as Wan Animate 2's files.
The task of each clip follows from the files it has, as the pipeline's call does with its arguments:

==========================  ======================================================================================
files                       control video and mask (pipeline call)
==========================  ======================================================================================
none                        VACE's first-frame task (``VaceFirstFrame``): the first frame kept, the rest generated
control clip [+ mask]       the control clip; the mask (all white without one: ``prepare_masks``' default)
mask alone                  the target clip itself under the mask (inpainting / outpainting: black is kept)
reference image(s) alone    a grey clip, all white mask (the pipeline's ``video=None``): reference-to-video
==========================  ======================================================================================

reference images join any of these. A target whose files cannot be used is named, with every other one, in one error.

Training with reference images: the denoiser sees one latent frame more than the clip per reference image, first (the
pipeline draws the noise for ``num_frames + references x 4`` frames and drops the first latent frames after denoising):
the call gives those slots the reference images' latents noised at the clip's noise level and leaves them out of the loss
(``WanVaceCall.predict``), as Wan Animate 2's reference slot. The clips of a micro-batch must have the same number of
reference images (the latent frames differ otherwise): a run that mixes counts with ``train.micro_batch_size`` above 1 is
refused, naming the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.confine import OUTSIDE_REASON, require_usable, usable
from zeropipe.data.images import IMAGE_SUFFIXES
from zeropipe.errors import DataError
from zeropipe.families.diffusion.parts.base import Encoding, Planning, SampleInputs, Sampling
from zeropipe.families.diffusion.parts.vace_context import VaceFirstFrame, control_hidden_states, first_frame_task

BAD_SHOWN = 3
MASK_SUFFIX = "_mask"
LAYOUT = ("NAME.mp4 (control clip), NAME_mask.mp4 or NAME_mask.png (mask: white generates), NAME.png (reference image; several: NAME.ref0.png, NAME.ref1.png ...) "
          "per target clip NAME.mp4")
NUMBERED_REFERENCE = re.compile(r"^(?P<name>.+)\.ref(?P<number>\d+)$")  # NAME.ref0.png: the stem NAME.ref0


def reference_paths(item: dict[str, Any]) -> list[str]:
    """A clip's reference images in the pipeline's order (``item["vace_reference"]``: one path, or a list of several)."""
    value = item.get("vace_reference")
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def find_vace_controls(items: list[dict[str, Any]], data_root: Path, control_root: Path, fps: float | None) -> list[str]:
    """Give each item the control files it has (``item["vace_control"]``, ``item["vace_mask"]``, ``item["vace_reference"]``: one
    path, or a list for numbered ones; with the clips' frame rates); one line per item whose files cannot be used, naming the file and why.

    Raises:
        DataError: ``control_root`` is not a folder.
    """
    from zeropipe.data.images import _decoded_size
    from zeropipe.data.videos import VIDEO_SUFFIXES, probe_video, resampled_frames

    require_usable(control_root, "data.control_path")
    control_root = Path(control_root).expanduser().resolve()
    if not control_root.is_dir():
        raise DataError(f"data.control_path {control_root} is not a folder: point it at the folder of VACE's control files ({LAYOUT})")
    images: dict[Path, list[Path]] = {}
    videos: dict[Path, list[Path]] = {}
    masks: dict[Path, list[Path]] = {}
    numbered: dict[Path, dict[int, list[Path]]] = {}  # NAME -> number -> NAME.refN.* files
    for path in sorted(control_root.rglob("*")):
        if not path.is_file() or any(part.startswith(".") for part in path.relative_to(control_root).parts):
            continue
        suffix, stem = path.suffix.lower(), path.relative_to(control_root).with_suffix("")
        if suffix not in VIDEO_SUFFIXES and suffix not in IMAGE_SUFFIXES:
            continue
        match = NUMBERED_REFERENCE.match(stem.name) if suffix in IMAGE_SUFFIXES else None
        if stem.name.endswith(MASK_SUFFIX):
            masks.setdefault(stem.with_name(stem.name[: -len(MASK_SUFFIX)]), []).append(path)
        elif match:
            numbered.setdefault(stem.with_name(match["name"]), {}).setdefault(int(match["number"]), []).append(path)
        else:
            (videos if suffix in VIDEO_SUFFIXES else images).setdefault(stem, []).append(path)
    problems = []
    probed: dict[Path, Any] = {}
    for item in items:
        target = Path(item["path"])
        relative = target.resolve().relative_to(Path(data_root).resolve()).with_suffix("")
        length = item.get("clip_frames", 1)
        needed = item.get("start", 0) + length
        found: dict[str, Path] = {}
        for noun, table in (("control clip", videos), ("mask", masks), ("reference image", images)):
            candidates = table.get(relative) or table.get(Path(relative.name)) or []
            if len(candidates) > 1:
                problems.append(f"{target}: several {noun}s have its name ({', '.join(p.name for p in candidates)}): keep one")
            elif candidates and not usable(candidates[0]):
                problems.append(f"{target}: its {noun} {candidates[0]} {OUTSIDE_REASON}")
            elif candidates:
                found[noun] = candidates[0]
        several = numbered.get(relative) or numbered.get(Path(relative.name)) or {}
        bad = False
        if several and "reference image" in found:
            problems.append(f"{target}: both {found.pop('reference image').name} and numbered reference images ({', '.join(p.name for n in sorted(several) for p in several[n])}) have its name: "
                            "keep NAME.png for one reference image or NAME.ref0.png, NAME.ref1.png ... for several")
            bad = True
        references: list[Path] = []
        for number in sorted(several):
            candidates = several[number]
            if len(candidates) > 1:
                problems.append(f"{target}: several reference images have its number {number} ({', '.join(p.name for p in candidates)}): keep one")
                bad = True
            elif not usable(candidates[0]):
                problems.append(f"{target}: its reference image {candidates[0]} {OUTSIDE_REASON}")
                bad = True
            else:
                references.append(candidates[0])
        if "reference image" in found:
            references = [found["reference image"]]
        for noun in ("control clip", "mask"):
            path = found.get(noun)
            if path is None:
                continue
            if path.suffix.lower() not in VIDEO_SUFFIXES:  # a mask image: the same mask on every frame
                size = _decoded_size(path)
                if isinstance(size, str):
                    problems.append(f"{target}: its {noun} {path} cannot be used ({size})")
                    bad = True
                else:
                    item["vace_mask"], item["vace_mask_fps"] = str(path), 0.0
                continue
            if path not in probed:
                probed[path] = probe_video(path)
            probe = probed[path]
            if isinstance(probe, str):
                problems.append(f"{target}: its {noun} {path} cannot be used ({probe})")
                bad = True
                continue
            available = resampled_frames(probe[2], probe[3], fps)
            if available < needed:
                problems.append(f"{target}: its {noun} {path} has {available} frame(s) at {fps:g} fps, the target's clip needs {needed}")
                bad = True
                continue
            field = "vace_control" if noun == "control clip" else "vace_mask"
            item[field], item[f"{field}_fps"] = str(path), float(probe[3])
        usable_references = []
        for reference in references:
            size = _decoded_size(reference)
            if isinstance(size, str):
                problems.append(f"{target}: its reference image {reference} cannot be used ({size})")
                bad = True
            else:
                usable_references.append(str(reference))
        if usable_references:  # one path as before (the plan and cache keys of one reference image are unchanged), a list for several
            item["vace_reference"] = usable_references[0] if len(usable_references) == 1 and not several else usable_references
        if bad:
            for field in ("vace_control", "vace_mask", "vace_reference"):
                item.pop(field, None)
    return problems


def has_controls(item: dict[str, Any]) -> bool:
    """Whether a clip has any control file (else it trains VACE's first-frame task)."""
    return any(field in item for field in ("vace_control", "vace_mask", "vace_reference"))


def reference_letterboxed(image, height: int, width: int, flip: bool = False) -> torch.Tensor:
    """A reference image (PIL) as ``WanVACEPipeline.preprocess_conditions`` fits it into a (height, width) clip: its video
    processor's pixels in [-1, 1], resized bilinearly to fit, centred on a white canvas (3, height, width)."""
    from diffusers.video_processor import VideoProcessor
    from PIL import ImageOps

    if flip:
        image = ImageOps.mirror(image)
    image = VideoProcessor(vae_scale_factor=8).preprocess(image, None, None)
    image_height, image_width = image.shape[-2:]
    scale = min(height / image_height, width / image_width)
    new_height, new_width = int(image_height * scale), int(image_width * scale)
    resized = torch.nn.functional.interpolate(image, size=(new_height, new_width), mode="bilinear", align_corners=False).squeeze(0)
    top, left = (height - new_height) // 2, (width - new_width) // 2
    canvas = torch.ones(3, height, width, dtype=resized.dtype)
    canvas[:, top : top + new_height, left : left + new_width] = resized
    return canvas


def open_image(path: Path):
    """An image file as RGB, turned by its EXIF orientation (as diffusers' ``load_image``)."""
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as image:
            return ImageOps.exif_transpose(image).convert("RGB")
    except Exception as error:
        raise DataError(f"{path} cannot be decoded ({type(error).__name__}: {error}): remove or replace the file") from error


def load_controls(item: dict[str, Any], bucket: tuple[int, ...], fps: float | None, flip: bool) -> dict[str, torch.Tensor] | None:
    """A clip's control files at its bucket, start, crop and flip: ``control`` (3, T, H, W) in [-1, 1], ``mask`` (3, T, H, W)
    in [0, 1] (as the pipeline reads a mask: ``(pixels + 1) / 2``), ``references`` [(3, H, W)] letterboxed; None without any.

    Raises:
        DataError: a file cannot be decoded (the item is skipped).
    """
    from zeropipe.data.videos import load_clip_for_bucket

    if not has_controls(item):
        return None
    width, height = bucket[0], bucket[1]
    frames = bucket[2] if len(bucket) > 2 else 1
    loaded: dict[str, torch.Tensor] = {}
    if "vace_control" in item:
        loaded["control"] = load_clip_for_bucket(Path(item["vace_control"]), (width, height, frames), item.get("start", 0), item["vace_control_fps"], fps, crop="center", flip=flip).pixels
    if "vace_mask" in item:
        pixels = load_clip_for_bucket(Path(item["vace_mask"]), (width, height, frames), item.get("start", 0) if item["vace_mask_fps"] else 0, item["vace_mask_fps"], fps, crop="center", flip=flip).pixels
        loaded["mask"] = torch.clamp((pixels + 1) / 2, min=0, max=1)
    if "vace_reference" in item:
        loaded["references"] = [reference_letterboxed(open_image(Path(path)), height, width, flip) for path in reference_paths(item)]
    return loaded


def vace_task(clip: torch.Tensor, controls: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The pipeline's (video, mask, reference images) for a clip (1, 3, T, H, W) in [-1, 1] and its control files (the module's table)."""
    if not controls:
        video, mask = first_frame_task(clip)
        return video, mask, []
    if "control" in controls:
        video = controls["control"][None].to(clip)
    elif "mask" in controls:
        video = clip  # inpainting: what the mask keeps is the clip's own
    else:
        video = torch.zeros_like(clip)  # the pipeline's video=None
    mask = controls["mask"][None].to(clip) if "mask" in controls else torch.ones_like(video)
    references = [reference.to(clip) for reference in controls.get("references", [])]
    return video, mask, references


@dataclass(frozen=True)
class VaceControl(VaceFirstFrame):
    """The control branch's input of each clip from its control files in ``data.control_path`` (see the module), or VACE's
    first-frame task for a clip without any (the cache entry is the same then: the key suffix is ``VaceFirstFrame``'s,
    and a clip's control files are part of its key)."""

    def config_keys(self):
        return ("data.control_path",)

    def problems(self, config, arch):
        problems = super().problems(config, arch)
        control_path = config.data.control_path
        if control_path and config.data.synthetic is None and not Path(control_path).expanduser().is_dir():
            problems.append(("data.control_path", f"{control_path} is not a folder: point it at the folder of VACE's control files ({LAYOUT}), or remove it to train the first-frame task"))
        return problems

    def attach(self, planning: Planning) -> None:
        config = planning.config
        if not config.data.control_path or config.data.synthetic is not None:
            planning.notes.append(f"Wan VACE: no data.control_path, every clip trains VACE's first-frame task (set data.control_path for control clips, masks and reference images: {LAYOUT})")
            return
        for item, bucket in zip(planning.items, planning.buckets):
            item["clip_frames"] = bucket[2] if len(bucket) > 2 else 1
        root = Path(config.data.control_path).expanduser()
        problems = find_vace_controls(planning.items, planning.image_dir, root, _plan_fps(config, planning.arch))
        if problems:
            shown = "; ".join(problems[:BAD_SHOWN])
            raise DataError(
                f"{len(problems)} problem(s) with the VACE control files of {len(planning.items)} target clip(s) in {root} ({shown}{' ...' if len(problems) > BAD_SHOWN else ''}): "
                f"give each target clip usable files ({LAYOUT}; a control clip or mask clip at least as long as the target's), or remove them from data.control_path"
            )
        with_reference = [item for item in planning.items if "vace_reference" in item]
        micro = config.train.micro_batch_size
        by_count: dict[int, list[str]] = {}
        for item in planning.items:
            by_count.setdefault(len(reference_paths(item)), []).append(item["path"])
        if len(by_count) > 1 and micro > 1:
            if set(by_count) == {0, 1}:
                raise DataError(
                    f"{len(with_reference)} of {len(planning.items)} target clip(s) have a reference image in {root} and the others not (e.g. {by_count[0][0]}): a reference image adds a "
                    f"latent frame, and the clips of a batch must have the same number (train.micro_batch_size is {micro}): give every clip a reference image or none, or set train.micro_batch_size: 1"
                )
            shown = ", ".join(f"{len(paths)} with {count} (e.g. {paths[0]})" for count, paths in sorted(by_count.items()))
            raise DataError(
                f"the target clips in {root} have different numbers of reference images ({shown}): each reference image adds a latent frame, and the clips of a batch "
                f"must have the same number (train.micro_batch_size is {micro}): give every clip the same number of reference images, or set train.micro_batch_size: 1"
            )
        counts = {
            "a control clip": sum("vace_control" in item for item in planning.items), "a mask": sum("vace_mask" in item for item in planning.items),
            "a reference image": sum(len(reference_paths(item)) == 1 for item in planning.items),
            "several reference images": sum(len(reference_paths(item)) > 1 for item in planning.items), "no control file (the first-frame task)": sum(not has_controls(item) for item in planning.items),
        }
        planning.notes.append(f"Wan VACE: of {len(planning.items)} target clip(s) from {root}, " + ", ".join(f"{count} with {noun}" for noun, count in counts.items() if count))
        copies = [item["path"] for item in planning.items if "vace_control" in item and "vace_mask" not in item and _same_file(Path(item["path"]), Path(item["vace_control"]))]
        if copies:
            planning.notes.append(f"{len(copies)} target clip(s) are their own control clip under an all-white mask (e.g. {copies[0]}): the model can learn to copy the control clip; "
                                  "give a control clip of another kind (pose, depth, edges) or a mask")

    def key_files(self, item):
        files = tuple((label, Path(item[field])) for label, field in (("control", "vace_control"), ("mask", "vace_mask")) if field in item)
        # The first reference image keeps the label of one (a clip with one keeps its cache entry), the others are numbered.
        return files + tuple(("reference" if number == 0 else f"reference{number}", Path(path)) for number, path in enumerate(reference_paths(item)))

    def load(self, plan, index, bucket, flip):
        return load_controls(plan.items[index], tuple(bucket), plan.fps, flip)

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        pixels = encoding.pixels.to(encoding.vae.dtype)
        values = []
        for index, controls in enumerate(encoding.loaded):
            video, mask, references = vace_task(pixels[index : index + 1], controls)
            values.append(control_hidden_states(encoding.vae, video, mask, references)[0])
        return values

    def sample_inputs(self, sampling: Sampling, kwargs: dict[str, Any]) -> SampleInputs:
        """The first data clip with control files: its control clip, mask and reference image at the sample's size and length,
        as the pipeline's ``video``, ``mask`` and ``reference_images`` (the target clip's own frames as the video under a mask
        alone); VACE's first-frame task from a data clip without any."""
        from zeropipe.data.images import first_frame_image

        items = sampling.plan.items
        index = next((index for index, item in enumerate(items) if has_controls(item)), None)
        if index is None:
            return super().sample_inputs(sampling, kwargs)
        item = items[index]
        frames = int(kwargs.get("num_frames") or sampling.plan.sample_frames)
        bucket = (sampling.size, sampling.size, frames)
        call: dict[str, Any] = {}
        if "vace_control" in item or "vace_mask" in item:
            controls = load_controls({key: value for key, value in item.items() if key != "vace_reference"}, bucket, sampling.plan.fps, False)
            if "control" in controls:
                video = controls["control"]
            else:
                video = sampling.load_pixels(index, bucket, crop="center", flip=False).pixels
            call["video"] = [first_frame_image(video[:, frame]) for frame in range(video.shape[1])]
            if "mask" in controls:
                call["mask"] = [first_frame_image(controls["mask"][:, frame] * 2 - 1) for frame in range(frames)]
        if "vace_reference" in item:
            call["reference_images"] = [open_image(Path(path)) for path in reference_paths(item)]
        row = {key: item[field] for key, field in (("control", "vace_control"), ("mask", "vace_mask"), ("reference", "vace_reference")) if field in item}
        return SampleInputs(kwargs=call, rows=[{"target": item["path"], **row}] * len(sampling.prompts))


def _same_file(target: Path, control: Path) -> bool:
    """Whether the control clip is the target clip (the same file, or the same bytes)."""
    import filecmp

    try:
        return target.resolve() == control.resolve() or (target.stat().st_size == control.stat().st_size and filecmp.cmp(target, control, shallow=False))
    except OSError:
        return False


def _plan_fps(config: Any, arch: Any) -> float | None:
    """The frame rate clips are taken at (``data.video.fps``, or the codec's own)."""
    fps = config.data.video.fps
    return arch.record.codec.frame_rate if fps == "auto" else float(fps)
