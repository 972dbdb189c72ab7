"""diffusion-pipe's dataset TOML (the file its main TOML names as ``dataset``): its ``[[directory]]`` entries, buckets and
frame buckets as ZeRO-Pipe's ``data`` section. Split from ``convert/diffusion_pipe.py``, which converts the main TOML.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import tomllib

from zeropipe.convert.common import Conversion, ConversionError, PeerDefault, as_number, find_path, to_float, to_int
from zeropipe.data.images import IMAGE_SUFFIXES

# diffusion-pipe's dataset defaults that differ from ZeRO-Pipe's (diffusion_pipe.PEER_DEFAULTS holds them with the main file's).
DATASET_PEER_DEFAULTS = {
    "enable_ar_bucket": PeerDefault("dataset.enable_ar_bucket", False, "data.images.bucketing", "utils/dataset.py:458; one square bucket, line 497"),
    "frame_buckets": PeerDefault("dataset.frame_buckets", [1], "data.video.frame_buckets", "utils/dataset.py:508, images only", "video"),
}

# diffusion-pipe rounds every bucket side to a multiple of this (utils/dataset.py, IMAGE_SIZE_ROUND_TO_MULTIPLE).
SIZE_MULTIPLE = 32


VIDEO_SUFFIXES = (".mp4", ".mov", ".webm", ".mkv", ".avi", ".gif")


DATASET_NOT_MAPPED = {
    "num_ar_buckets": "ZeRO-Pipe makes every bucket of about resolution^2 pixels whose sides are multiples of data.images.bucket_step, up to data.images.max_aspect",
    "ar_buckets": "buckets are derived from data.images.resolution, bucket_step and max_aspect; a fixed list is not supported",
    "cache_shuffle_num": "tag shuffling is not supported; each caption is encoded once as written",
    "cache_shuffle_delimiter": "tag shuffling is not supported",
    "shuffle_tags": "tag shuffling is not supported",
    "caption_prefix": "not supported: put the prefix into the caption files",
    "skip_empty_caption": "images without a caption file train with the empty caption (flat layout) or the folder's concept (kohya layout)",
}


def _resolution(value: Any) -> int:
    if isinstance(value, list) and len(value) == 2:
        return int(round(math.sqrt(to_float(value[0], "resolutions") * to_float(value[1], "resolutions"))))
    return to_int(value, "resolutions")


def convert_dataset(conversion: Conversion, path: Path, links_dir: Path, video: bool = False) -> None:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8", errors="replace"))
    except tomllib.TOMLDecodeError as err:
        raise ConversionError(f"{path} (the dataset TOML) is not valid TOML: {err}; fix the syntax") from None
    rest = dict(raw)
    where = f"{path.name}"
    resolutions = rest.pop("resolutions", None)
    if resolutions is None:
        # diffusion-pipe reads dataset_config['resolutions'] unless size_buckets is given (utils/dataset.py:460-469): no default to carry.
        sized = "size_buckets is given instead" if "size_buckets" in rest else "diffusion-pipe requires it (utils/dataset.py:469)"
        conversion.skip("dataset.resolutions", f"not set ({sized}): ZeRO-Pipe's data.images.resolution default applies; set it to the size you train at")
        resolutions = []
    elif not isinstance(resolutions, list) or not resolutions:
        resolutions = [resolutions]
    if resolutions:
        conversion.set("data.images.resolution", _resolution(resolutions[0]), f"from {where} resolutions = {resolutions}")
    if len(resolutions) > 1:
        conversion.skip("dataset.resolutions", f"{resolutions}: one resolution per run; the first is used (train again with data.images.resolution for the others)")
    conversion.set("data.images.bucket_step", SIZE_MULTIPLE, f"diffusion-pipe rounds bucket sides to multiples of {SIZE_MULTIPLE}")
    if "enable_ar_bucket" in rest:
        conversion.set("data.images.bucketing", bool(rest.pop("enable_ar_bucket")), f"from {where} enable_ar_bucket")
    else:
        # utils/dataset.py:458 at 8f83dbf: enable_ar_bucket defaults to false, one square bucket (self.ars = [1.0], line 497-498).
        conversion.default(DATASET_PEER_DEFAULTS["enable_ar_bucket"])
    min_ar, max_ar = as_number(rest.pop("min_ar", None)), as_number(rest.pop("max_ar", None))
    if min_ar or max_ar:
        aspect = max(float(max_ar or 1.0), 1.0 / float(min_ar or 1.0))
        conversion.set("data.images.max_aspect", round(aspect, 3), f"from {where} min_ar = {min_ar}, max_ar = {max_ar}: the most elongated bucket either way")
    frames = rest.pop("frame_buckets", None)
    buckets = sorted({to_int(f, "frame_buckets") for f in (frames if isinstance(frames, list) else [frames])}) if frames is not None else None
    if video:
        # diffusion-pipe always has the image bucket (1), and its default is images only.
        buckets = sorted(set(buckets or []) | {1})
        conversion.set(
            "data.video.frame_buckets", buckets,
            f"from {where} frame_buckets = {frames}" if frames is not None else DATASET_PEER_DEFAULTS["frame_buckets"].comment("diffusion-pipe"),
        )
        conversion.skip(
            "dataset.frame_buckets (short videos)",
            "a video shorter than the shortest bucket above 1 is dropped by diffusion-pipe, and trains as a one-frame clip (its first frame) in ZeRO-Pipe: "
            "remove such videos to keep them out",
        )
    elif buckets is not None and buckets != [1]:
        conversion.skip("dataset.frame_buckets", f"{frames}: this is an image model; images (frame bucket 1) train")

    # diffusion-pipe reads these at the top of the dataset TOML as every [[directory]]'s default.
    default_repeats = rest.pop("num_repeats", 1)
    directories = rest.pop("directory", [])
    if not directories:
        raise ConversionError(f"{path}: no [[directory]] entries: add one with path = '/folder/of/images'")
    kept: list[tuple[Path, int, str, str]] = []  # folder, repeats, concept name, source key
    controls: list[tuple[str, Path]] = []  # source key, control folder (edit training)
    for number, directory in enumerate(directories):
        key = f"dataset.directory[{number}]"
        directory = dict(directory)
        folder_name = directory.pop("path", None)
        if not isinstance(folder_name, str):
            conversion.skip(key, "no path = '...': left out")
            continue
        folder = find_path(folder_name, Path.cwd(), path.parent)
        if folder is None or not folder.is_dir():
            # People convert before copying their images over: the config is written, `zeropipe check` refuses until the folder is there.
            folder = Path(folder_name).expanduser()
            folder = folder if folder.is_absolute() else (path.parent / folder)
            conversion.skip(f"{key}.path", f"{folder_name!r} is not a folder on this machine (looked relative to {Path.cwd()} and {path.parent}): "
                                           "copy the images there (or fix data.path) before `zeropipe check`")
        repeats = to_int(directory.pop("num_repeats", default_repeats), f"{key}.num_repeats")
        if repeats < 1:
            conversion.skip(key, f"num_repeats = {repeats}: never used, left out")
            continue
        if "mask_path" in directory:
            conversion.skip(f"{key}.mask_path", f"{directory.pop('mask_path')!r}: masked loss is not supported: the whole image trains")
        control = directory.pop("control_path", None)
        # Multi-reference edit datasets (diffusion-pipe's control_paths, its PR #529): a folder per reference image.
        several = directory.pop("control_paths", None)
        if several is not None and control is not None:
            conversion.skip(f"{key}.control_path", f"{control!r}: diffusion-pipe takes control_path or control_paths, not both; control_paths is used")
            control = None
        if control is not None:
            controls.append((key, _control_folder(conversion, f"{key}.control_path", control, path)))
        if several is not None:
            named = several if isinstance(several, list) else [several]
            controls.append((key, [_control_folder(conversion, f"{key}.control_paths[{n}]", folder, path) for n, folder in enumerate(named)]))
        for override, value in directory.items():
            conversion.skip(f"{key}.{override}", f"{value!r}: per-directory settings are not supported; the top-level ones apply to every folder")
        kept.append((folder, repeats, _concept(folder, {concept for _, _, concept, _ in kept}), key))

    linked = not (len(kept) == 1 and kept[0][1] == 1)
    for folder, repeats, concept, key in kept:
        if folder.is_dir():
            _check_folder(conversion, key, folder, concept if linked else None, video)
    if not linked:
        conversion.set("data.path", str(kept[0][0]), f"from {where} [[directory]] path: images with .txt captions beside them")
        if controls and isinstance(controls[0][1], list):
            conversion.set(
                "data.control_paths", [str(folder) for folder in controls[0][1]],
                f"from {where} [[directory]] control_paths: a folder per reference image, each with an image per target by file name "
                "(multi-reference edit training: Qwen-Image-Edit-Plus, FLUX.2)",
            )
        elif controls:
            conversion.set("data.control_path", str(controls[0][1]), f"from {where} [[directory]] control_path: a control image per target image, by file name")
        return _rest_of_dataset(conversion, rest)
    if controls:
        # data.control_path is one folder matched by file name; several linked folders would need their control folders linked alike.
        conversion.blocking.append(
            f"{where} has edit pairs (control_path) in several [[directory]] entries or with num_repeats; ZeRO-Pipe's edit training reads one image "
            "folder and its one control folder (data.path, data.control_path): train one [[directory]] per run, with num_repeats 1"
        )
        for key, folder in controls:
            conversion.skip(f"{key}.control_path{'s' if isinstance(folder, list) else ''}", f"{str(folder)!r}: see CANNOT TRAIN YET above")
    if kept:
        # Several folders or repeats: the kohya layout expresses both as <repeats>_<name> subfolders.
        conversion.links_dir = links_dir
        conversion.links = {f"{repeats}_{concept}": folder for folder, repeats, concept, _ in kept}
        listing = ", ".join(f"{repeats}_{concept} -> {folder}" for folder, repeats, concept, _ in kept)
        conversion.set("data.path", str(links_dir), f"from {where} [[directory]] entries with num_repeats, as kohya-layout links: {listing}")
    _rest_of_dataset(conversion, rest)


def _control_folder(conversion: Conversion, key: str, value: Any, path: Path) -> Path:
    """A control_path(s) folder, relative to the TOML's folder as diffusion-pipe reads it; noted where it is not on this machine yet."""
    folder = find_path(str(value), Path.cwd(), path.parent)
    if folder is None or not folder.is_dir():
        folder = Path(str(value)).expanduser()
        folder = folder if folder.is_absolute() else (path.parent / folder)
        conversion.skip(key, f"{value!r} is not a folder on this machine: copy the control images there before `zeropipe check`")
    return folder


def _rest_of_dataset(conversion: Conversion, rest: dict[str, Any]) -> None:
    for key, value in rest.items():
        conversion.skip(f"dataset.{key}", DATASET_NOT_MAPPED.get(key, f"{value!r}: no ZeRO-Pipe equivalent, left out"))


def _concept(folder: Path, taken: set[str]) -> str:
    """The kohya concept name of a linked folder: its own name, made unique among the others."""
    name = re.sub(r"[^\w .-]", "_", folder.name).strip() or "images"
    candidate, number = name, 2
    while candidate in taken:
        candidate, number = f"{name}-{number}", number + 1
    return candidate


def _check_folder(conversion: Conversion, key: str, folder: Path, concept: str | None, video: bool = False) -> None:
    """Say what the kohya/flat layouts read differently from diffusion-pipe in this folder."""

    files = [p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")]
    images = [p for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    videos = [p for p in files if p.suffix.lower() in VIDEO_SUFFIXES]
    if videos and not video:
        conversion.skip(f"{key} (videos)", f"{len(videos)} video file(s) in {folder}: this is an image model; only its {len(images)} image(s) train")
    uncaptioned = [p for p in images if not p.with_suffix(".txt").is_file()]
    if uncaptioned and concept is not None:
        # Only the kohya layout differs: a flat folder also trains uncaptioned images with the empty caption.
        conversion.skip(
            f"{key} (captions)",
            f"{len(uncaptioned)} image(s) in {folder} have no .txt caption (e.g. {uncaptioned[0].name}): diffusion-pipe trains them with "
            f"the empty caption, ZeRO-Pipe's kohya layout with the folder's concept name '{concept}': add caption files to keep them apart",
        )
