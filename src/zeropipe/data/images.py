"""Reading images, shared by the diffusion and vision-language families and the web UI: finding
captioned images, decoding them and fitting them to a size (a bucket), and the generated shapes
dataset the demos and tests use.

Aspect-ratio buckets and the micro-batches dealt to ranks are the diffusion family's
(``families/diffusion/buckets.py``); clips have their own module, ``data/videos.py``.

Three folder layouts are accepted (:func:`scan_image_folder` picks one):

- **metadata** (Hugging Face image folder): ``root/metadata.jsonl`` with one
  ``{"file_name": "...", "text": "..."}`` per line (``caption`` or ``prompt`` instead of
  ``text`` also work), or ``root/metadata.csv`` with the same columns. ``file_name`` is
  relative to ``root`` and may go into subfolders. Images in the folder that the metadata
  does not list are not used. Only the metadata file at the top of ``root`` is read.
- **kohya**: subfolders named ``<repeats>_<concept>`` (``10_sks dog``). Each image is used
  ``repeats`` times per epoch; its caption is the ``.txt`` file beside it with the same stem,
  or the concept name when there is none (kohya's class-token behaviour).
- **flat**: images anywhere under ``root`` with caption files beside them; an image without
  one gets the empty caption and is listed in :attr:`ImageScan.missing_captions`.

Hidden files and folders (names starting with ``.``, such as macOS ``._photo.jpg`` copies or
``.ipynb_checkpoints``) are skipped in every layout. Symlinked folders are followed.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageOps, UnidentifiedImageError

from zeropipe.confine import OUTSIDE_REASON, require_usable, usable
from zeropipe.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
CAPTION_KEYS = ("text", "caption", "prompt")
METADATA_FILES = ("metadata.jsonl", "metadata.csv")
LAYOUTS = ("kohya", "metadata", "flat")
# Bounds checked before reading (issue 46): a caption file's size (by stat: a sparse 128 MiB caption
# took 3.3 GB), a metadata file's, and an image's pixels (by its header, well below Pillow's 89 M).
MAX_CAPTION_BYTES = 64 * 1024
MAX_METADATA_BYTES = 64 * 1024 * 1024
MAX_IMAGE_PIXELS = 50_000_000
CROPS = ("center", "random")

# "10_sks dog" -> repeats 10, concept "sks dog". Same pattern kohya's sd-scripts uses.
KOHYA_FOLDER = re.compile(r"^(\d+)_(.+)$")

# For the "no usable image" error, so the user sees every way to lay out the folder.
LAYOUT_HELP = (
    "kohya (subfolders named <repeats>_<concept>, e.g. '10_sks dog', with a caption file beside each image), "
    "metadata (a metadata.jsonl with lines like {\"file_name\": \"a.png\", \"text\": \"a caption\"}, or a metadata.csv "
    "with file_name and text columns) or flat (images with caption files beside them)"
)

# EXIF orientations that rotate by 90 or 270 degrees, so width and height swap once applied.
EXIF_ORIENTATION_TAG = 0x0112
SWAPPING_ORIENTATIONS = (5, 6, 7, 8)

# Few colours on purpose: a tiny model trained for minutes on CPU must see each
# (shape, colour, background) combination many times to learn it.
SHAPES = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 220, 40),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
}
SHAPES_FOLDER = "1_shapes"


@dataclass
class ImageItem:
    """One usable training image."""

    path: Path  # absolute path of the image file
    caption: str
    repeats: int  # kohya repeat count (1 when not given)
    width: int  # size in pixels, after the EXIF orientation is applied (as load_image_for_bucket sees it)
    height: int
    frames: int = 1  # a video's decodable frames (an image is one frame)
    fps: float = 0.0  # a video's frame rate (0 for images)


@dataclass
class BadImage:
    """An image that cannot be used, and why."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass
class ImageScan:
    """What :func:`scan_image_folder` found."""

    items: list[ImageItem]
    bad: list[BadImage]
    layout: str  # "kohya" | "metadata" | "flat"
    # Metadata lines that could not be used, each "<metadata file> line <n>: <reason>".
    bad_lines: list[str] = field(default_factory=list)
    # Flat layout only: images with no caption file, trained with the empty caption.
    missing_captions: list[Path] = field(default_factory=list)
    # Files found but not decoded because the scan was asked to stop at ``max_files`` (the UI's Dataset page).
    unscanned: int = 0


@dataclass
class PreparedImage:
    """An image resized and cropped to a bucket, with the sizes SDXL conditions on."""

    pixels: torch.Tensor  # float32, (3, H, W), values in [-1, 1], H, W = bucket height, width
    original_size: tuple[int, int]  # (height, width) of the source image: SDXL add_time_ids order
    crop_top_left: tuple[int, int]  # (top, left) of the crop in the resized (and, when flipped, mirrored) image
    target_size: tuple[int, int]  # (height, width) = bucket


# ---------------------------------------------------------------------------------------------
# Scanning a folder


def scan_image_folder(
    root: Path,
    caption_ext: str = ".txt",
    video_probe: Callable[[Path], tuple[int, int, int, float] | str] | None = None,
    video_suffixes: tuple[str, ...] = (),
    max_files: int | None = None,
    refuse: Callable[[Path], str | None] | None = None,
    require_items: bool = True,
) -> ImageScan:
    """Find the captioned images under ``root`` and check that each one decodes.

    Every image is decoded in full once (``Image.open`` then ``load``): ``verify()`` alone
    misses truncated files, which would otherwise crash a training step hours into the run.
    The price is reading every pixel at scan time, which takes minutes for a folder of
    100k photos.

    Args:
        root: the image folder, in one of the layouts described in this module's docstring.
        caption_ext: suffix of the caption file beside each image (kohya and flat layouts).
        video_probe: for video models, reads a video file (``video_suffixes``) in full and returns
            (width, height, frames, frames per second) or the reason it cannot be used; videos
            and images are then scanned together (an image is a one-frame video).
        max_files: decode at most this many files (a bounded look for the UI); the rest are
            counted in ``unscanned``.
        refuse: given each file before it is opened, returns the reason not to read it (the UI
            refuses a link leading out of its folders), or None.
        require_items: False to return a scan without a usable image instead of raising (the
            UI lists what was rejected and why).

    Returns:
        The usable images sorted by path, and the files and metadata lines that were skipped.

    Raises:
        DataError: ``root`` is not a folder, has both metadata files, or holds no usable image.
    """
    root = Path(root).expanduser().resolve()
    if not root.exists():
        raise DataError(f"image folder {root} does not exist: check the data path.")
    if not root.is_dir():
        raise DataError(f"{root} is a file, not a folder: point the data path at the folder that holds the images.")
    if not caption_ext.startswith("."):
        caption_ext = "." + caption_ext

    metadata_files = [root / name for name in METADATA_FILES if (root / name).is_file()]
    if len(metadata_files) > 1:
        raise DataError(
            f"{root} has both metadata.jsonl and metadata.csv and it is not clear which one holds the captions: "
            "remove or rename one of them."
        )
    suffixes = IMAGE_SUFFIXES + (tuple(video_suffixes) if video_probe is not None else ())
    kohya_folders = [child for child in sorted(root.iterdir()) if child.is_dir() and KOHYA_FOLDER.match(child.name)]

    bad: list[BadImage] = []
    bad_lines: list[str] = []
    missing_captions: list[Path] = []
    if metadata_files:
        layout = "metadata"
        require_usable(metadata_files[0], "the captions file")  # a UI run's (zeropipe.confine): never through a symlink out of its folders
        candidates = _metadata_candidates(root, metadata_files[0], bad, bad_lines)
    elif kohya_folders:
        layout = "kohya"
        candidates = _kohya_candidates(root, kohya_folders, caption_ext, bad, suffixes)
    else:
        layout = "flat"
        candidates = _flat_candidates(root, caption_ext, bad, missing_captions, suffixes)

    items = []
    unscanned = 0
    for path, caption, repeats in candidates:
        if max_files is not None and len(items) + len(bad) >= max_files:
            unscanned += 1
            continue
        if not usable(path):  # a UI run's image that is a symlink out of its folders: counted, never decoded
            bad.append(BadImage(path, OUTSIDE_REASON))
            continue
        if refuse is not None and (reason := refuse(path)) is not None:
            bad.append(BadImage(path, reason))
            continue
        is_video = video_probe is not None and path.suffix.lower() in video_suffixes
        found = video_probe(path) if is_video else _decoded_size(path)
        if isinstance(found, str):
            bad.append(BadImage(path, found))
            continue
        width, height, *timing = found
        frames, fps = timing if timing else (1, 0.0)
        items.append(ImageItem(path=path, caption=caption, repeats=repeats, width=width, height=height, frames=frames, fps=fps))

    if not items and require_items:
        problems = ""
        if bad:
            problems += f" {len(bad)} file(s) could not be used, the first: {bad[0]}."
        if bad_lines:
            problems += f" {len(bad_lines)} metadata line(s) could not be used, the first: {bad_lines[0]}."
        raise DataError(
            f"found no usable image in {root} (layout read as {layout}).{problems} Accepted layouts: {LAYOUT_HELP}. "
            f"File types: {' '.join(suffixes)}."
        )
    items.sort(key=lambda item: item.path)
    bad.sort(key=lambda problem: problem.path)
    missing_captions.sort()
    return ImageScan(items=items, bad=bad, layout=layout, bad_lines=bad_lines, missing_captions=missing_captions, unscanned=unscanned)


def _is_image_name(path: Path, suffixes: tuple[str, ...] = IMAGE_SUFFIXES) -> bool:
    return path.suffix.lower() in suffixes


def _walk_images(top: Path, suffixes: tuple[str, ...] = IMAGE_SUFFIXES) -> list[Path]:
    """Image files under ``top`` (recursively, following symlinks once), skipping hidden names."""
    found = []
    seen_folders = set()
    for folder, subfolders, files in os.walk(top, followlinks=True):
        real_folder = os.path.realpath(folder)
        if real_folder in seen_folders:  # a symlink loop: do not walk forever
            subfolders[:] = []
            continue
        seen_folders.add(real_folder)
        # A UI run's folder linked to elsewhere (zeropipe.confine) is not walked: its files would be skipped one by one anyway.
        subfolders[:] = sorted(name for name in subfolders if not name.startswith(".") and usable(Path(folder) / name))
        found += [Path(folder) / name for name in files if not name.startswith(".") and _is_image_name(Path(name), suffixes)]
    return sorted(found)


def _read_caption(path: Path, bad: list[BadImage], image: Path) -> str | None:
    """The stripped caption in ``path``; None (and a BadImage for ``image``) when it is not UTF-8 text or leads out of a UI run's folders."""
    if not usable(path):
        bad.append(BadImage(image, f"its caption file {path.name} {OUTSIDE_REASON}"))
        return None
    try:
        size = path.stat().st_size
        if size > MAX_CAPTION_BYTES:
            bad.append(BadImage(image, f"its caption file {path.name} holds {size:,} bytes, more than a caption may ({MAX_CAPTION_BYTES:,}): not read"))
            return None
        with path.open("rb") as handle:
            return handle.read(MAX_CAPTION_BYTES).decode("utf-8").strip()
    except UnicodeDecodeError as error:
        bad.append(BadImage(image, f"its caption file {path.name} is not UTF-8 text ({error}): re-save it as UTF-8"))
        return None


def _kohya_candidates(root: Path, kohya_folders: list[Path], caption_ext: str, bad: list[BadImage], suffixes: tuple[str, ...]) -> list[tuple[Path, str, int]]:
    candidates = []
    for folder in kohya_folders:
        match = KOHYA_FOLDER.match(folder.name)
        repeats, concept = int(match[1]), match[2]
        for image in _walk_images(folder, suffixes):
            if repeats == 0:
                bad.append(BadImage(image, f"folder '{folder.name}' has 0 repeats, so it is never used: rename it to 1_{concept} or more"))
                continue
            caption_file = image.with_suffix(caption_ext)
            caption = _read_caption(caption_file, bad, image) if caption_file.is_file() else concept
            if caption is not None:
                candidates.append((image, caption, repeats))
    # kohya ignores images outside <repeats>_<concept> folders; say so rather than drop them silently.
    kohya_set = set(kohya_folders)
    for child in sorted(root.iterdir()):
        if child.name.startswith(".") or child in kohya_set:
            continue
        strays = _walk_images(child, suffixes) if child.is_dir() else ([child] if _is_image_name(child, suffixes) else [])
        for image in strays:
            bad.append(BadImage(image, "not inside a <repeats>_<concept> folder, so the kohya layout skips it: move it into one such as '1_concept'"))
    return candidates


def _flat_candidates(root: Path, caption_ext: str, bad: list[BadImage], missing_captions: list[Path], suffixes: tuple[str, ...]) -> list[tuple[Path, str, int]]:
    candidates = []
    for image in _walk_images(root, suffixes):
        caption_file = image.with_suffix(caption_ext)
        if caption_file.is_file():
            caption = _read_caption(caption_file, bad, image)
            if caption is None:
                continue
        else:
            caption = ""
            missing_captions.append(image)
        candidates.append((image, caption, 1))
    return candidates


def _metadata_records(metadata_file: Path, bad_lines: list[str]):
    """Yield ``(line_number, record)`` for each parseable line; unparseable ones go to ``bad_lines``."""
    if not usable(metadata_file):
        bad_lines.append(f"{metadata_file} {OUTSIDE_REASON}")
        return
    if metadata_file.stat().st_size > MAX_METADATA_BYTES:
        bad_lines.append(f"{metadata_file} holds {metadata_file.stat().st_size:,} bytes, more than a metadata file may ({MAX_METADATA_BYTES:,}): not read")
        return
    if metadata_file.suffix == ".csv":
        with metadata_file.open(newline="", encoding="utf-8-sig", errors="replace") as handle:
            reader = csv.DictReader(handle)
            for record in reader:
                yield reader.line_num, record
        return
    with metadata_file.open("rb") as handle:
        for line_number, raw_line in enumerate(handle, start=1):
            if not raw_line.strip():
                continue
            try:
                record = json.loads(raw_line.decode("utf-8"))
            except UnicodeDecodeError as error:
                bad_lines.append(f"{metadata_file} line {line_number}: not UTF-8 text ({error})")
                continue
            except json.JSONDecodeError as error:
                bad_lines.append(f"{metadata_file} line {line_number}: not valid JSON ({error})")
                continue
            yield line_number, record


def _metadata_candidates(root: Path, metadata_file: Path, bad: list[BadImage], bad_lines: list[str]) -> list[tuple[Path, str, int]]:
    candidates = []
    first_line_of: dict[Path, int] = {}
    for line_number, record in _metadata_records(metadata_file, bad_lines):
        where = f"{metadata_file} line {line_number}"
        if not isinstance(record, dict):
            bad_lines.append(f'{where}: expected an object like {{"file_name": "a.png", "text": "a caption"}}, got {type(record).__name__}')
            continue
        file_name = record.get("file_name")
        if not isinstance(file_name, str) or not file_name:
            bad_lines.append(f"{where}: no file_name: add the image's path relative to {root}")
            continue
        caption_key = next((key for key in CAPTION_KEYS if key in record), None)
        if caption_key is None:
            bad_lines.append(f"{where}: no caption: add a \"text\" key (\"caption\" or \"prompt\" also work)")
            continue
        caption = record[caption_key]
        if not isinstance(caption, str):
            bad_lines.append(f"{where}: \"{caption_key}\" must be a string, got {type(caption).__name__}")
            continue
        path = root / file_name
        if path in first_line_of:
            bad_lines.append(f"{where}: {file_name} is already listed on line {first_line_of[path]}: keep one of the two lines")
            continue
        first_line_of[path] = line_number
        if not path.is_file():
            bad.append(BadImage(path, f"listed in {metadata_file.name} but missing"))
            continue
        candidates.append((path, caption.strip(), 1))
    return candidates


def _decoded_size(path: Path) -> tuple[int, int] | str:
    """(width, height) after the EXIF orientation, or the reason the file cannot be used."""
    try:
        if path.stat().st_size == 0:
            return "empty file (0 bytes)"
        with Image.open(path) as image:
            if image.size[0] * image.size[1] > MAX_IMAGE_PIXELS:
                return f"{image.size[0]}x{image.size[1]} pixels, more than the {MAX_IMAGE_PIXELS:,} an image may hold: not decoded; resize it"
            image.load()
            width, height = image.size
            orientation = image.getexif().get(EXIF_ORIENTATION_TAG, 1)
    except UnidentifiedImageError:
        return "not an image: Pillow does not recognise the file format"
    # Corrupt files make Pillow raise all sorts of things (OSError, SyntaxError, struct.error,
    # DecompressionBombError...); any of them means the same for us: skip the file.
    except Exception as error:
        return f"cannot be decoded: {error}"
    if width == 0 or height == 0:
        return f"zero-size image ({width}x{height} pixels)"
    if orientation in SWAPPING_ORIENTATIONS:
        width, height = height, width
    return width, height


# ---------------------------------------------------------------------------------------------
# Control images (edit training)


def match_control_images(targets: list[Path], data_root: Path, control_root: Path) -> tuple[list[Path | None], list[str]]:
    """Each target image's control image in ``control_root``, found by file name as diffusion-pipe and musubi-tuner do.

    A target ``data_root/10_cups/a.jpg`` takes ``control_root/10_cups/a.<any image type>`` or,
    failing that, ``control_root/a.<any image type>``. Every control image found is decoded
    in full once, as the targets are.

    Returns:
        Per target, its control image (None where it has none or it cannot be used), and one
        line per such problem, naming the target and the file it looked for or why that file
        cannot be used.

    Raises:
        DataError: ``control_root`` is not a folder.
    """
    require_usable(control_root, "data.control_path")
    control_root = Path(control_root).expanduser().resolve()
    if not control_root.is_dir():
        raise DataError(f"data.control_path {control_root} is not a folder: point it at the folder of control images (one per target image, same file name)")
    by_stem: dict[Path, list[Path]] = {}
    for path in _walk_images(control_root):
        by_stem.setdefault(path.relative_to(control_root).with_suffix(""), []).append(path)
    found: list[Path | None] = []
    problems: list[str] = []
    for target in targets:
        relative = Path(target).resolve().relative_to(Path(data_root).resolve()).with_suffix("")
        candidates = by_stem.get(relative) or by_stem.get(Path(relative.name)) or []
        if not candidates:
            found.append(None)
            problems.append(f"{target}: no control image {control_root / relative}.* (or {control_root / relative.name}.*)")
            continue
        if len(candidates) > 1:
            found.append(None)
            problems.append(f"{target}: several control images have its name ({', '.join(p.name for p in candidates)}): keep one")
            continue
        if not usable(candidates[0]):
            found.append(None)
            problems.append(f"{target}: its control image {candidates[0]} {OUTSIDE_REASON}")
            continue
        size = _decoded_size(candidates[0])
        if isinstance(size, str):
            found.append(None)
            problems.append(f"{target}: its control image {candidates[0]} cannot be used ({size})")
            continue
        found.append(candidates[0])
    return found, problems


# ---------------------------------------------------------------------------------------------
# Loading one image at a bucket's size


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited on white (a black background would teach the model dark borders)."""
    if image.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        # 16-bit greyscale PNGs: Pillow's own convert clips everything above 255 to white.
        values = np.asarray(image).astype(np.float32)
        if values.max() > 255:
            values = values / 257
        image = Image.fromarray(np.clip(values, 0, 255).astype(np.uint8))
    if image.mode == "P" or "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        foreground = image.convert("RGBA")
        white = Image.new("RGBA", foreground.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, foreground).convert("RGB")
    return image.convert("RGB")


def load_image_for_bucket(
    path: Path,
    bucket: tuple[int, int],
    crop: str = "center",
    flip: bool = False,
    rng: random.Random | None = None,
) -> PreparedImage:
    """Decode ``path``, resize it to cover ``bucket`` (width, height) keeping its aspect, and crop to the bucket.

    Args:
        path: the image file.
        bucket: ``(width, height)`` from :func:`make_buckets`.
        crop: ``"center"`` or ``"random"``.
        flip: mirror the result left to right (augmentation).
        rng: the generator for ``crop="random"``; required then, so runs are reproducible.

    Raises:
        DataError: the file cannot be decoded (the trainer skips it).
        ValueError: an unknown ``crop``, or ``crop="random"`` without ``rng``.
    """
    if crop not in CROPS:
        raise ValueError(f"crop '{crop}' is not one of {', '.join(CROPS)}")
    if crop == "random" and rng is None:
        raise ValueError("crop='random' needs rng (a random.Random) so the crops can be reproduced")
    image = decode_image(path, _to_rgb, "remove or replace the file, then scan the folder again")
    return fit_to_bucket(image, bucket, crop=crop, flip=flip, rng=rng, path=path)


def decode_image(path: Path, convert: Callable[[Image.Image], Image.Image], fix: str) -> Image.Image:
    """``path`` decoded, turned upright by its EXIF orientation and converted by ``convert`` (to RGB, RGBA...).

    Raises:
        DataError: the file lies outside what the run may read (``usable`` is asked again when it is
            read: it may have been swapped for a link since the folder was scanned), has more than
            MAX_IMAGE_PIXELS pixels, or cannot be decoded; the message ends with ``fix``.
    """
    if not usable(path):
        raise DataError(f"{path} {OUTSIDE_REASON}")
    try:
        with Image.open(path) as opened:
            if opened.size[0] * opened.size[1] > MAX_IMAGE_PIXELS:
                raise DataError(f"{opened.size[0]}x{opened.size[1]} pixels, more than {MAX_IMAGE_PIXELS:,}")
            opened.load()
            return convert(ImageOps.exif_transpose(opened))
    except Exception as error:  # same reasoning as in _decoded_size: every failure means "skip this file"
        raise DataError(f"{path} cannot be decoded ({error}): {fix}") from error


def fit_to_bucket(
    image: Image.Image,
    bucket: tuple[int, int],
    crop: str = "center",
    flip: bool = False,
    rng: random.Random | None = None,
    path: Path | str = "the image",
) -> PreparedImage:
    """Resize a decoded RGB image (or video frame) to cover ``bucket`` (width, height) keeping its aspect, and crop to it.

    Raises:
        DataError: a zero-size image.
        ValueError: an unknown ``crop``, ``crop="random"`` without ``rng``, or a bucket without area.
    """
    if crop not in CROPS:
        raise ValueError(f"crop '{crop}' is not one of {', '.join(CROPS)}")
    if crop == "random" and rng is None:
        raise ValueError("crop='random' needs rng (a random.Random) so the crops can be reproduced")
    bucket_width, bucket_height = bucket[:2]
    if bucket_width < 1 or bucket_height < 1:
        raise ValueError(f"bucket {bucket} must have a positive width and height")
    width, height = image.size
    if width == 0 or height == 0:
        raise DataError(f"{path} is a zero-size image ({width}x{height} pixels): remove it from the data folder")

    # Cover the bucket: the smaller scale would leave a border, the larger one crops only one side.
    scale = max(bucket_width / width, bucket_height / height)
    resized_width = max(bucket_width, round(width * scale))
    resized_height = max(bucket_height, round(height * scale))
    if (resized_width, resized_height) != (width, height):
        image = image.resize((resized_width, resized_height), Image.Resampling.LANCZOS)

    if crop == "center":
        top, left = (resized_height - bucket_height) // 2, (resized_width - bucket_width) // 2
    else:
        top, left = rng.randint(0, resized_height - bucket_height), rng.randint(0, resized_width - bucket_width)
    image = image.crop((left, top, left + bucket_width, top + bucket_height))
    if flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        # SDXL's crop conditioning should describe the picture the model sees: in the mirrored
        # image this crop starts where it ended before (kohya's sd-scripts does the same).
        left = resized_width - left - bucket_width

    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1).contiguous()
    return PreparedImage(
        pixels=pixels,
        original_size=(height, width),
        crop_top_left=(top, left),
        target_size=(bucket_height, bucket_width),
    )


# ---------------------------------------------------------------------------------------------
# A synthetic dataset a tiny model can learn


def _shape_example(rng: random.Random) -> tuple[str, str, str]:
    """A random (shape, colour, background colour), the shape never the colour of its background."""
    shape = rng.choice(SHAPES)
    colour = rng.choice(list(COLOURS))
    background = rng.choice([name for name in COLOURS if name != colour])
    return shape, colour, background


def _shape_caption(shape: str, colour: str, background: str) -> str:
    return f"a {colour} {shape} on a {background} background"


def _example_size(index: int, resolution: int) -> tuple[int, int]:
    """(width, height) of about ``resolution**2`` pixels: square, 3:2 landscape and 2:3 portrait in turn."""
    if index % 3 == 0:
        return resolution, resolution
    short = round(resolution / math.sqrt(1.5) / 2) * 2  # even, so 3:2 is exact
    long = short * 3 // 2
    return (long, short) if index % 3 == 1 else (short, long)


def _draw_shape(image: Image.Image, shape: str, colour: str, rng: random.Random) -> None:
    width, height = image.size
    smaller_side = min(width, height)
    size = rng.randint(int(smaller_side * 0.4), int(smaller_side * 0.7))
    left, top = rng.randint(0, width - size), rng.randint(0, height - size)
    right, bottom = left + size - 1, top + size - 1
    draw = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse((left, top, right, bottom), fill=fill)
    elif shape == "square":
        draw.rectangle((left, top, right, bottom), fill=fill)
    else:
        draw.polygon([((left + right) / 2, top), (left, bottom), (right, bottom)], fill=fill)


def generate_shapes_dataset(out_dir: Path, examples: int, seed: int, resolution: int = 64) -> Path:
    """Write ``examples`` captioned PNGs of coloured shapes in the kohya layout; same seed, same files.

    The images go to ``out_dir/1_shapes/00000.png`` with the caption in ``00000.txt``, e.g.
    "a red circle on a blue background". A third are square, a third 3:2 landscape and a
    third 2:3 portrait, all of about ``resolution**2`` pixels, so bucketing is exercised.

    Raises:
        DataError: fewer than one example, or a resolution below 16.
    """
    if examples < 1:
        raise DataError(f"synthetic images need at least 1 example (you asked for {examples}).")
    if resolution < 16:
        raise DataError(f"synthetic images need a resolution of at least 16 pixels (you asked for {resolution}).")
    folder = Path(out_dir) / SHAPES_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    # Files from an earlier, larger run would otherwise stay in the dataset.
    for stale in folder.iterdir():
        if re.fullmatch(r"\d{5,}\.(png|txt)", stale.name):
            stale.unlink()
    rng = random.Random(seed)
    for index in range(examples):
        shape, colour, background = _shape_example(rng)
        image = Image.new("RGB", _example_size(index, resolution), COLOURS[background])
        _draw_shape(image, shape, colour, rng)
        image.save(folder / f"{index:05d}.png")
        (folder / f"{index:05d}.txt").write_text(_shape_caption(shape, colour, background) + "\n", encoding="utf-8")
    return Path(out_dir)


def shape_prompts(count: int, seed: int) -> list[str]:
    """``count`` captions of the synthetic form, to sample from, drawn apart from the training data's random stream."""
    rng = random.Random(f"zeropipe-shape-prompts-{seed}")
    return [_shape_caption(*_shape_example(rng)) for _ in range(count)]


def first_frame_image(pixels: torch.Tensor) -> Image.Image:
    """The first frame of a clip (3, T, H, W) or an image (3, H, W) in [-1, 1], as the PIL image a pipeline takes."""
    frame = pixels[:, 0] if pixels.dim() == 4 else pixels
    return Image.fromarray(((frame.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy())
