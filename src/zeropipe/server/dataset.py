"""The Dataset page: an image or video folder as diffusion training will read it.

The folder is scanned by the training code itself (``data.images.scan_image_folder``:
layouts, captions, decoding every file, ``probe_video`` for clips) and every usable file is
given the aspect-ratio bucket training's preparation assigns (``make_buckets`` /
``assign_bucket``). Rejected files are listed with the reason training would skip them.

The look is bounded and read-only: the folder must lie in the folders the UI may read, at
most ``MAX_FILES`` files are decoded (the rest are counted, not read), a file whose real path
leads out of those folders (a symlink) is rejected unread, and thumbnails are made for one
page of files at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeropipe.errors import ZeroPipeError
from zeropipe.rundir import is_inside

MAX_FILES = 2000  # files decoded in one look: about the time one preview may take
MAX_PAGE = 60
MAX_REJECTED = 500


def dataset_view(
    folder: Path,
    allowed_roots: list[Path],
    caption_ext: str = ".txt",
    resolution: int = 1024,
    bucket_step: int = 64,
    max_aspect: float = 2.0,
    bucketing: bool = True,
    videos: bool = False,
    offset: int = 0,
    limit: int = 24,
) -> dict[str, Any]:
    """The folder's layout, buckets, a page of its files with captions and buckets, and its rejected files with why.

    Args:
        folder: the folder, already resolved and confined by the caller.
        allowed_roots: the folders the UI may read: a file whose real path is elsewhere is rejected unread.

    Raises:
        ZeroPipeError: the folder cannot be read as an image folder (the message says why).
    """
    from zeropipe.data.images import scan_image_folder
    from zeropipe.families.diffusion.buckets import assign_bucket, make_buckets
    from zeropipe.errors import DataError

    def refuse(path: Path) -> str | None:
        if not any(is_inside(path, root) for root in allowed_roots):  # resolved: a symlink is judged by where it leads
            return "a link to a file outside the folders this UI may read: not read (training on this machine would read it; move the file in)"
        return None

    probe, suffixes = (None, ())
    if videos:
        from zeropipe.data.videos import VIDEO_SUFFIXES, probe_video

        probe, suffixes = probe_video, VIDEO_SUFFIXES
    try:
        scan = scan_image_folder(folder, caption_ext=caption_ext, video_probe=probe, video_suffixes=suffixes, max_files=MAX_FILES, refuse=refuse, require_items=False)
    except DataError as err:
        raise ZeroPipeError(str(err)) from None
    buckets = make_buckets(resolution, bucket_step, max_aspect) if bucketing else [(resolution, resolution)]
    counts: dict[str, dict[str, int]] = {}
    rows = []
    for item in scan.items:
        width, height = assign_bucket(item.width, item.height, buckets)
        key = f"{width}x{height}"
        entry = counts.setdefault(key, {"files": 0, "samples": 0})
        entry["files"] += 1
        entry["samples"] += item.repeats  # an epoch's samples: kohya repeats count each time
        rows.append((item, (width, height)))
    caption_suffix = caption_ext if caption_ext.startswith(".") else "." + caption_ext
    shown = []
    for item, bucket in rows[offset : offset + limit]:
        caption = item.caption
        caption_file = item.path.with_suffix(caption_suffix)
        if caption_file.exists() and refuse(caption_file) is not None:
            caption = "(its caption file is a link out of the folders this UI may read: not shown)"
        shown.append({
            "file": relative(item.path, folder), "caption": shown_caption(caption), "repeats": item.repeats, "size": [item.width, item.height],
            "bucket": list(bucket), "frames": item.frames, "fps": round(item.fps, 3), "thumbnail": thumbnail_of(item.path, item.frames > 1 or item.fps > 0),
        })  # fmt: skip
    rejected = [{"file": relative(bad.path, folder), "reason": bad.reason} for bad in scan.bad] + [{"file": "", "reason": line} for line in scan.bad_lines]
    return {
        "folder": str(folder),
        "layout": scan.layout,
        "usable": len(scan.items),
        "rejected_count": len(rejected),
        "unscanned": scan.unscanned,
        "max_files": MAX_FILES,
        "missing_captions": [relative(path, folder) for path in scan.missing_captions[:MAX_REJECTED]],
        "missing_captions_count": len(scan.missing_captions),
        "buckets": dict(sorted(counts.items(), key=lambda kv: -kv[1]["files"])),
        "resolution": resolution,
        "bucketing": bucketing,
        "offset": offset,
        "files": shown,
        "rejected": rejected[:MAX_REJECTED],
    }


SHOWN_CAPTION = 2000  # characters of a caption a response carries (captions are read up to 64 KiB)


def shown_caption(caption: str | None) -> str | None:
    if caption is None or len(caption) <= SHOWN_CAPTION:
        return caption
    return caption[:SHOWN_CAPTION] + f"… ({len(caption):,} characters)"


def relative(path: Path, folder: Path) -> str:
    try:
        return str(Path(path).relative_to(folder))
    except ValueError:
        return str(path)


def thumbnail_of(path: Path, video: bool, side: int = 160) -> str | None:
    """A small PNG data: URL of the image (a video's first frame), or None when it cannot be made."""
    import base64
    import io

    from PIL import Image, ImageOps

    try:
        if video:
            import av

            with av.open(str(path)) as container:
                frame = next(container.decode(video=0))
                image = frame.to_image()
        else:
            from zeropipe.data.images import MAX_IMAGE_PIXELS

            with Image.open(path) as opened:
                if opened.size[0] * opened.size[1] > MAX_IMAGE_PIXELS:
                    return None
                opened.draft("RGB", (side * 2, side * 2))  # a JPEG decodes reduced (1/2 to 1/8)
                image = ImageOps.exif_transpose(opened).convert("RGB")
        image.thumbnail((side, side))
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="PNG")
    except Exception:  # noqa: BLE001 - the file decoded during the scan; a thumbnail is not worth an error
        return None
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
