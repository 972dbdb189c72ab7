"""The video side of diffusion training: probing and decoding videos with PyAV, frame buckets, clips, writing mp4.

Video models (an entry whose codec is a ``VideoLatents``) train on folders that mix videos and images, laid out
as for images (:mod:`zeropipe.data.images`: kohya, metadata.jsonl or flat, captions in
``.txt`` files beside each file). Every file is decoded in full once at scan time, so that a
truncated or corrupt video is reported by path before any rank starts, not hours in.

- **Frame rate**: clips are taken at the model's frame rate (Wan: 16 fps); a 30 fps video
  gives every other frame or so. An image is a one-frame clip.
- **Frame buckets**: the clip lengths the VAE accepts (``frame_multiple * k + 1``); a video
  trains as clips of the longest bucket it fills.
- **Clip modes**: ``start`` (one clip from the first frame), ``middle`` (one clip centred)
  or ``multiple`` (as many clips as fit, spread evenly from the first frame to the last).

Decoding goes through PyAV (FFmpeg's libraries), never a subprocess.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from zeropipe.confine import OUTSIDE_REASON, usable
from zeropipe.data.images import COLOURS, SHAPES, PreparedImage, fit_to_bucket, load_image_for_bucket
from zeropipe.errors import DataError

VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".gif", ".mkv", ".avi", ".m4v")
CLIP_MODES = ("start", "middle", "multiple")
DIRECTIONS = ("left", "right", "up", "down")


def probe_video(path: Path) -> tuple[int, int, int, float] | str:
    """(width, height, frames, frames per second) of a video decoded in full, or the reason it cannot be used."""
    import av

    path = Path(path)
    try:
        if path.stat().st_size == 0:
            return "empty file (0 bytes)"
        with av.open(str(path)) as container:
            if not container.streams.video:
                return "has no video stream"
            stream = container.streams.video[0]
            frames, width, height, last_time = 0, 0, 0, 0.0
            for frame in container.decode(stream):
                if frames == 0:
                    width, height = frame.width, frame.height
                frames += 1
                if frame.time is not None:
                    last_time = float(frame.time)
            rate = stream.average_rate or stream.guessed_rate
    # FFmpeg reports corrupt data as InvalidDataError, end-of-file and codec errors as others;
    # any of them means the same for us: skip the file.
    except Exception as error:
        return f"cannot be decoded ({type(error).__name__}: {error})"
    if frames == 0:
        return "no frame decodes"
    if width == 0 or height == 0:
        return f"zero-size video ({width}x{height} pixels)"
    fps = float(rate) if rate else (frames - 1) / last_time if last_time > 0 else 0.0
    if fps <= 0:
        return "has no frame rate"
    return width, height, frames, fps


def resampled_frames(frames: int, fps: float, target_fps: float | None) -> int:
    """How many frames a video of ``frames`` at ``fps`` gives at ``target_fps`` (all of them when no target)."""
    if frames <= 1 or not target_fps or not fps:
        return frames
    return int((frames - 1) * target_fps / fps + 1e-6) + 1


def source_index(frame: int, fps: float, target_fps: float | None) -> int:
    """The source frame shown at resampled frame number ``frame``."""
    if not target_fps or not fps:
        return frame
    return int(frame * fps / target_fps + 1e-6)


def check_frame_buckets(frame_buckets: list[int], accepts, frame_multiple: int, remainder: int = 1) -> list[int]:
    """The frame buckets sorted, or ValueError naming the lengths the VAE does not accept (``frame_multiple * k + remainder``)."""
    wrong = [count for count in frame_buckets if not accepts(count)]
    if wrong or not frame_buckets:
        examples = ", ".join(str(frame_multiple * k + remainder) for k in range(4))
        raise ValueError(f"{wrong or 'an empty list'}: clip lengths must be {frame_multiple}k+{remainder} frames (e.g. {examples})")
    return sorted(set(frame_buckets))


def clip_starts(available: int, length: int, mode: str) -> list[int]:
    """The first (resampled) frame of each clip of ``length`` frames taken from ``available`` frames."""
    if length > available:
        raise ValueError(f"a clip of {length} frames does not fit in {available}")
    if mode == "start" or length == available:
        return [0]
    if mode == "middle":
        return [(available - length) // 2]
    if mode != "multiple":
        raise ValueError(f"clip mode {mode!r} is not one of {', '.join(CLIP_MODES)}")
    count = math.ceil(available / length)
    return sorted({round(i * (available - length) / (count - 1)) for i in range(count)})


def load_clip_for_bucket(
    path: Path,
    bucket: tuple[int, int, int],
    start: int,
    fps: float,
    target_fps: float | None,
    crop: str = "center",
    flip: bool = False,
    rng: random.Random | None = None,
) -> PreparedImage:
    """Decode the frames of a clip, each fitted to the bucket (width, height, frames) like an image; pixels are (3, T, H, W).

    An image (any file that is not a video) is a one-frame clip. Every frame is cropped at the
    same place, so the clip does not jitter.

    Raises:
        DataError: the file cannot be decoded, or has fewer frames than the clip needs.
    """
    import av

    path = Path(path)
    width, height, length = bucket
    crop_seed = rng.random() if rng is not None else 0.0
    if path.suffix.lower() not in VIDEO_SUFFIXES:
        image = load_image_for_bucket(path, (width, height), crop=crop, flip=flip, rng=random.Random(crop_seed) if crop == "random" else rng)
        return PreparedImage(image.pixels.unsqueeze(1).expand(-1, length, -1, -1).contiguous(), image.original_size, image.crop_top_left, image.target_size)
    if not usable(path):  # swapped for a symlink out of a UI run's folders since the folder was scanned
        raise DataError(f"{path} {OUTSIDE_REASON}")
    wanted = [source_index(start + i, fps, target_fps) for i in range(length)]
    decoded: dict[int, PreparedImage] = {}
    try:
        with av.open(str(path)) as container:
            for number, frame in enumerate(container.decode(container.streams.video[0])):
                if number > wanted[-1]:
                    break
                if number in wanted:
                    frame_rng = random.Random(crop_seed) if crop == "random" else None
                    decoded[number] = fit_to_bucket(frame.to_image().convert("RGB"), (width, height), crop=crop, flip=flip, rng=frame_rng, path=path)
    except Exception as error:
        raise DataError(f"{path} cannot be decoded ({type(error).__name__}: {error}): remove or replace the file, then scan the folder again") from error
    missing = [number for number in wanted if number not in decoded]
    if missing:
        raise DataError(f"{path} ended after {len(decoded)} of the {length} frames its clip needs (frame {missing[0]} is missing): replace the file")
    first = decoded[wanted[0]]
    pixels = torch.stack([decoded[number].pixels for number in wanted], dim=1)
    return PreparedImage(pixels, first.original_size, first.crop_top_left, first.target_size)


# ---------------------------------------------------------------------------------------------
# Writing videos


def write_video(path: Path, frames: np.ndarray, fps: float) -> Path:
    """Write uint8 frames (T, H, W, 3) as a video a browser plays: H.264 in mp4 (VP9 for .webm), with PyAV.

    H.264 in yuv420p needs even sides; an odd side is padded by one pixel (edge copied).
    """
    import av

    path = Path(path)
    frames = np.asarray(frames, dtype=np.uint8)
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    codec = "libvpx-vp9" if path.suffix.lower() == ".webm" else "libx264"
    tmp = path.with_name(f".{path.stem}.partial{path.suffix}")
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(tmp), mode="w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            # Baseline-compatible settings every browser decodes; tiny clips need no rate control.
            stream.options = {"crf": "18", "preset": "veryfast"}
        for pixels in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    tmp.replace(path)
    return path


def write_preview(path: Path, frames: np.ndarray, fps: float) -> Path:
    """An animated WebP of the frames: it plays in an <img> tag, as the run page's gallery shows samples."""
    images = [Image.fromarray(np.asarray(pixels, dtype=np.uint8)) for pixels in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)), loop=0, lossless=True)
    return Path(path)


# ---------------------------------------------------------------------------------------------
# A synthetic video dataset a tiny model can learn


def moving_shapes_caption(shape: str, colour: str, background: str, direction: str | None) -> str:
    motion = f" moving {direction}" if direction else ""
    return f"a {colour} {shape}{motion} on a {background} background"


def moving_example(rng: random.Random) -> tuple[str, str, str, str]:
    shape = rng.choice(SHAPES)
    colour = rng.choice(list(COLOURS))
    background = rng.choice([name for name in COLOURS if name != colour])
    return shape, colour, background, rng.choice(DIRECTIONS)


def moving_shape_frames(shape: str, colour: str, background: str, direction: str | None, size: tuple[int, int], frames: int, rng: random.Random) -> np.ndarray:
    """Frames (T, H, W, 3) of a shape crossing the picture in ``direction`` (standing still when None)."""
    width, height = size
    side = max(4, int(min(width, height) * rng.uniform(0.35, 0.5)))
    travel_x, travel_y = width - side, height - side
    fixed_x, fixed_y = rng.randint(0, travel_x), rng.randint(0, travel_y)
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for number in range(frames):
        progress = number / max(frames - 1, 1)
        x = {"right": progress * travel_x, "left": (1 - progress) * travel_x}.get(direction, fixed_x)
        y = {"down": progress * travel_y, "up": (1 - progress) * travel_y}.get(direction, fixed_y)
        image = Image.new("RGB", (width, height), COLOURS[background])
        left, top = round(x), round(y)
        box = (left, top, left + side - 1, top + side - 1)
        draw = ImageDraw.Draw(image)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([((box[0] + box[2]) / 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=COLOURS[colour])
        out[number] = np.asarray(image)
    return out


def generate_moving_shapes_dataset(out_dir: Path, examples: int, seed: int, resolution: int = 32, frames: int = 17, fps: float = 16.0, still_every: int = 4) -> Path:
    """Write ``examples`` captioned clips of a coloured shape crossing the frame, as real mp4 files (flat layout).

    ``clip_00000.mp4`` with its caption in ``clip_00000.txt``, e.g. "a red circle moving left
    on a blue background". Every ``still_every``-th example is a PNG still instead ("a red
    circle on a blue background"), so that images train as one-frame clips beside the videos.
    Clips alternate square, landscape and portrait, so resolution buckets and crops are used.
    """
    if examples < 1:
        raise DataError(f"synthetic videos need at least 1 example (you asked for {examples}).")
    if resolution < 16:
        raise DataError(f"synthetic videos need a resolution of at least 16 pixels (you asked for {resolution}).")
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    long_side = resolution + resolution // 2 + (resolution // 2) % 2
    sizes = [(resolution, resolution), (long_side, resolution), (resolution, long_side)]
    for index in range(examples):
        shape, colour, background, direction = moving_example(rng)
        size = sizes[index % 3]
        if still_every and index % still_every == still_every - 1:
            pixels = moving_shape_frames(shape, colour, background, None, size, 1, rng)
            Image.fromarray(pixels[0]).save(folder / f"still_{index:05d}.png")
            (folder / f"still_{index:05d}.txt").write_text(moving_shapes_caption(shape, colour, background, None) + "\n", encoding="utf-8")
            continue
        pixels = moving_shape_frames(shape, colour, background, direction, size, frames, rng)
        write_video(folder / f"clip_{index:05d}.mp4", pixels, fps)
        (folder / f"clip_{index:05d}.txt").write_text(moving_shapes_caption(shape, colour, background, direction) + "\n", encoding="utf-8")
    return folder


def moving_shapes_prompts(count: int, seed: int) -> list[str]:
    """``count`` captions of the synthetic form, to sample from, drawn apart from the training data's random stream."""
    rng = random.Random(f"zeropipe-moving-shapes-prompts-{seed}")
    return [moving_shapes_caption(*moving_example(rng)) for _ in range(count)]
