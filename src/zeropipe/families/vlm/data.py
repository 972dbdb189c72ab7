"""Image-text data for vision-language models: reading it (launcher) and turning examples into model inputs (ranks).

Accepted data (``data.path``):

- a **Flickr8k captions file**: ``.txt`` or ``.token`` lines ``image.jpg#0<TAB>caption``
  (``Flickr8k.token.txt``), several captions per image;
- a **CSV/TSV** with a header naming an image column (``image``, ``file_name``, ``image_path``,
  ``filename``, ``path``) and a caption column (``caption``, ``text``): the Kaggle Flickr8k
  ``captions.txt`` is one, and a ``.txt`` whose first line is such a header is read as CSV;
- **JSONL/JSON** records ``{"image": path, "caption"|"text": ...}`` (a list of captions gives one
  example each), or chat records ``{"messages": [...], "images": [paths]}`` and LLaVA's
  ``{"conversations": [{"from": "human", "value": "<image>\\n..."}, ...], "image": path}``.
  Message content may be a string or a list of parts (``{"type": "image"}``,
  ``{"type": "text", "text": ...}``). ``<image>`` marks where each image goes; without
  markers the images go before the first user message;
- **Parquet / Arrow** (a file, a folder of shards in the Hub's layout, a ``save_to_disk``
  folder): the same records as columns, streamed; an image column holds paths or the Hub's
  ``{bytes, path}`` structs, whose bytes are written once each (named by content) into the
  run's ``data/images/`` so that the ranks load every image from a file;
- an **image folder** with captions beside the images (the layouts
  :func:`zeropipe.data.images.scan_image_folder` reads: kohya, metadata.jsonl/csv, flat).

Relative image paths are relative to ``data.vision.image_root``, by default the data file's
folder (or its ``Images/`` subfolder when the images are there: the Kaggle layout). A caption
becomes a two-turn conversation: the user turn is ``data.vision.caption_prompt`` after the
image, the assistant turn is the caption; only assistant turns carry loss.

The launcher decodes every image once: an example whose image is missing or cannot be decoded
is skipped and reported by path, and the run refuses to start when the skipped examples and
malformed records pass ``data.max_bad_fraction``. The good examples go into a small manifest in
the run directory. The ranks load and process the images again each time an example is used:
nothing is cached (a 336 px image is 1.3 MB of fp32 pixel values, so Flickr8k's 40k examples
would be 50 GB; decoding a JPEG is cheap next to a training step).

In the ranks, :class:`VlmEncoder` renders the conversation with the same code as text models
(:func:`zeropipe.data.tokenize.render_example`) with the processor's image placeholder in place
of each ``<image>``, and replaces each placeholder by what the processor expands it to for that
image (LLaVA: N ``<image>`` tokens; Gemma 3: ``<start_of_image>`` + N soft tokens +
``<end_of_image>``), with pixel values alongside. Training and generation go through it alike.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeropipe.checkpoint.manager import write_atomic
from zeropipe.confine import OUTSIDE_REASON, require_usable, usable
from zeropipe.data.formats import SHAREGPT_ROLES, BadRecord, RecordError, read_located_records, to_conversation
from zeropipe.data.records import iter_records
from zeropipe.data.tokenize import IGNORE_INDEX, render_example, render_prompt
from zeropipe.data.images import BadImage, scan_image_folder
from zeropipe.errors import DataError

IMAGE_MARKER = "<image>"
IMAGE_COLUMNS = ("image", "file_name", "image_path", "filename", "path", "image_name")
CAPTION_COLUMNS = ("caption", "text", "captions", "description")
CAPTION_SUFFIXES = (".txt", ".token", ".csv", ".tsv", ".jsonl", ".json", ".parquet", ".arrow")
TABLE_DATA_SUFFIXES = (".parquet", ".arrow")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
IMAGE_MAGIC = ((b"\x89PNG", ".png"), (b"\xff\xd8", ".jpg"), (b"GIF8", ".gif"), (b"BM", ".bmp"), (b"RIFF", ".webp"))
FLICKR_LINE = re.compile(r"^(?P<image>[^\t]+?)(#\d+)?\t(?P<caption>.*)$")
BAD_SHOWN = 3  # in the launcher's notes and error messages
HELD_OUT_IMAGES = 3  # synthetic images generated for the end-of-run answers
SYNTHETIC_RESOLUTION = 64  # the shapes are simple: 64 px is plenty, processors resize anyway

MANIFEST = "vlm_examples.jsonl"
GENERATE_FILE = "vlm_generate.json"
PROCESSOR_DIR = "processor"


@dataclass
class VlmExample:
    """One training example: a conversation whose user turns hold one ``<image>`` per image."""

    images: list[str]  # absolute paths
    messages: list[dict[str, str]]
    where: str = ""  # "captions.txt line 12", for reports


@dataclass
class VlmData:
    """What the reader found: good examples, and what was skipped."""

    examples: list[VlmExample]
    bad_records: list[BadRecord] = field(default_factory=list)  # malformed lines
    bad_images: list[BadImage] = field(default_factory=list)  # unreadable image files, each once
    skipped: int = 0  # examples left out because one of their images is unreadable
    records: int = 0  # records read, good and bad (what max_bad_fraction is a fraction of)
    layout: str = ""

    @property
    def bad_count(self) -> int:
        return len(self.bad_records) + self.skipped


# ---------------------------------------------------------------------------------------------
# Reading


def caption_messages(caption_prompt: str, caption: str | None = None) -> list[dict[str, str]]:
    """The conversation of a captioned image; without a caption, the prompt to generate one."""
    messages = [{"role": "user", "content": f"{IMAGE_MARKER}\n{caption_prompt}"}]
    if caption is not None:
        messages.append({"role": "assistant", "content": caption})
    return messages


def read_vlm_data(
    path: str | Path, image_root: str | Path | None = None, caption_prompt: str = "Describe the image.", image_dir: Path | None = None
) -> VlmData:
    """Every example under ``path`` (see the module docstring), without checking the images yet.

    Args:
        image_dir: where images stored as bytes in a Parquet or Arrow dataset are written, once
            each (the run's data folder): the ranks load every image from a file.

    Raises:
        DataError: the path does not exist, is of an unknown type, or a CSV lacks its columns.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"data.path {path}: no such file or directory. Fix data.path to point at your captions file or image folder.")
    require_usable(path, "data.path")  # a UI run's data (zeropipe.confine): never through a symlink out of its folders
    if _is_table_dataset(path):
        return _read_table_records(path, image_root, caption_prompt, image_dir)
    if path.is_dir():
        return _read_image_folder(path, caption_prompt)
    if path.suffix not in CAPTION_SUFFIXES:
        raise DataError(
            f"data.path {path}: unsupported file type '{path.suffix}' for image-text data. "
            f"Use one of {', '.join(CAPTION_SUFFIXES)} or an image folder."
        )
    if path.suffix in (".jsonl", ".json"):
        return _read_json_records(path, image_root, caption_prompt)
    text = path.read_text(encoding="utf-8-sig", errors="replace")
    first = next((line for line in text.splitlines() if line.strip()), "")
    if path.suffix in (".csv", ".tsv") or ("\t" not in first and _header_columns(first, ",")):
        return _read_csv(path, text, "\t" if path.suffix == ".tsv" else ",", image_root, caption_prompt)
    return _read_flickr_tokens(path, text, image_root, caption_prompt)


def _is_table_dataset(path: Path) -> bool:
    """A Parquet or Arrow file, a folder of their shards, or a save_to_disk folder: the Hub's ways of storing image-text data."""
    if path.is_file():
        return path.suffix in TABLE_DATA_SUFFIXES
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return True
    has_images = any(p.suffix.lower() in IMAGE_SUFFIXES for p in path.iterdir() if p.is_file())
    return not has_images and any(p.suffix in TABLE_DATA_SUFFIXES for p in path.rglob("*") if p.is_file())


def _read_table_records(path: Path, image_root, caption_prompt: str, image_dir: Path | None) -> VlmData:
    """Image-text rows of a Parquet/Arrow dataset, streamed; embedded image bytes written out once each."""
    resolve = _ImageResolver(path if path.is_file() else path / "x", image_root)
    data = VlmData(examples=[], layout="Parquet/Arrow records")
    kinds = set()
    written = 0
    for item in iter_records(path):
        data.records += 1
        if isinstance(item, BadRecord):
            data.bad_records.append(item)
            continue
        value = dict(item.value)
        try:
            for key in ("images", "image"):
                if value.get(key) is not None:
                    value[key], count = _image_files(value[key], key, image_dir)
                    written += count
            examples, kind = _record_examples(value, resolve, caption_prompt)
        except RecordError as error:
            data.bad_records.append(item.bad(str(error)))
            continue
        kinds.add(kind)
        where = f"{item.file or path.name} {item.unit} {item.line_number}"
        data.examples += [VlmExample(ex.images, ex.messages, where) for ex in examples]
    data.layout = f"Parquet/Arrow records ({', '.join(sorted(kinds)) or 'none usable'})" + (f", {written} embedded images written to {image_dir}" if written else "")
    return data


def _image_files(value: Any, key: str, image_dir: Path | None) -> tuple[str | list[str], int]:
    """Paths for an image column's value: a path, or the Hub's {bytes, path} struct (bytes written to ``image_dir``), or a list of them."""
    if isinstance(value, list):
        paths, written = [], 0
        for element in value:
            element_path, count = _image_files(element, key, image_dir)
            paths.append(element_path)
            written += count
        return paths, written
    if isinstance(value, str):
        return value, 0
    if isinstance(value, dict) and value.get("bytes"):
        if image_dir is None:
            raise RecordError(f"'{key}' holds image bytes, and no folder was given to write them to")
        content = value["bytes"]
        suffix = Path(value.get("path") or "").suffix.lower()
        if suffix not in IMAGE_SUFFIXES:
            suffix = next((ending for magic, ending in IMAGE_MAGIC if content.startswith(magic)), ".png")
        # Named by content: the same image in several rows is written once, and a rerun writes nothing.
        target = Path(image_dir) / (hashlib.sha256(content).hexdigest()[:32] + suffix)
        if target.is_file():
            return str(target), 0
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        partial.write_bytes(content)
        os.replace(partial, target)
        return str(target), 1
    if isinstance(value, dict) and isinstance(value.get("path"), str) and value["path"]:
        return value["path"], 0
    raise RecordError(f"'{key}' should be an image path or {{bytes, path}}, got {type(value).__name__}")


def _header_columns(line: str, delimiter: str) -> tuple[str, str] | None:
    """(image column, caption column) when ``line`` is a header naming both, else None."""
    names = [name.strip().lower() for name in next(csv.reader([line], delimiter=delimiter), [])]
    image = next((name for name in IMAGE_COLUMNS if name in names), None)
    caption = next((name for name in CAPTION_COLUMNS if name in names), None)
    return (image, caption) if image and caption else None


class _ImageResolver:
    """Absolute image paths from the names in a data file, relative to the image root."""

    def __init__(self, data_file: Path, image_root: str | Path | None):
        self.explicit = image_root is not None
        self.root = Path(image_root).expanduser() if image_root is not None else data_file.parent
        self.decided = self.explicit

    def __call__(self, name: str) -> str:
        candidate = Path(name).expanduser()
        if candidate.is_absolute():
            return str(candidate)
        if not self.decided:
            # The Kaggle Flickr8k layout: captions.txt beside an Images/ folder.
            self.decided = True
            if not (self.root / candidate).exists():
                for sub in ("Images", "images"):
                    if (self.root / sub / candidate).exists():
                        self.root = self.root / sub
                        break
        return str((self.root / candidate).resolve())


def _read_flickr_tokens(path: Path, text: str, image_root, caption_prompt: str) -> VlmData:
    resolve = _ImageResolver(path, image_root)
    data = VlmData(examples=[], layout="Flickr8k captions file (image.jpg#0<TAB>caption)")
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        data.records += 1
        match = FLICKR_LINE.match(line.rstrip("\r"))
        if match is None or not match["caption"].strip():
            data.bad_records.append(BadRecord(number, "expected 'image.jpg#0<TAB>caption'", path.name))
            continue
        data.examples.append(
            VlmExample([resolve(match["image"].strip())], caption_messages(caption_prompt, match["caption"].strip()), f"{path.name} line {number}")
        )
    return data


def _read_csv(path: Path, text: str, delimiter: str, image_root, caption_prompt: str) -> VlmData:
    resolve = _ImageResolver(path, image_root)
    lines = text.splitlines()
    header_index = next((i for i, line in enumerate(lines) if line.strip()), 0)
    header = [name.strip().lower() for name in next(csv.reader([lines[header_index]], delimiter=delimiter), [])] if lines else []
    columns = _header_columns(lines[header_index], delimiter) if lines else None
    if columns is None:
        raise DataError(
            f"data.path {path}: the header ({', '.join(header) or 'empty'}) names no image column ({', '.join(IMAGE_COLUMNS)}) "
            f"and caption column ({', '.join(CAPTION_COLUMNS)}). Rename the columns, e.g. 'image,caption'."
        )
    image_at, caption_at = header.index(columns[0]), header.index(columns[1])
    data = VlmData(examples=[], layout=f"{'TSV' if delimiter == chr(9) else 'CSV'} captions ({columns[0]}, {columns[1]})")
    reader = csv.reader(io.StringIO("\n".join(lines[header_index + 1 :])), delimiter=delimiter)
    for offset, row in enumerate(reader):
        number = header_index + 2 + offset
        if not row or not any(cell.strip() for cell in row):
            continue
        data.records += 1
        # Unquoted commas in the last column (the Kaggle Flickr8k file has some) belong to the caption.
        if len(row) > len(header) and caption_at == len(header) - 1:
            row = row[: len(header) - 1] + [delimiter.join(row[len(header) - 1 :])]
        if len(row) <= max(image_at, caption_at) or not row[image_at].strip() or not row[caption_at].strip():
            data.bad_records.append(BadRecord(number, f"expected {len(header)} columns with an image and a caption", path.name))
            continue
        messages = caption_messages(caption_prompt, row[caption_at].strip())
        data.examples.append(VlmExample([resolve(row[image_at].strip())], messages, f"{path.name} line {number}"))
    return data


def _read_json_records(path: Path, image_root, caption_prompt: str) -> VlmData:
    resolve = _ImageResolver(path, image_root)
    records, bad = read_located_records(path)
    data = VlmData(examples=[], bad_records=list(bad), records=len(records) + len(bad), layout="JSON records")
    kinds = set()
    for record in records:
        try:
            examples, kind = _record_examples(record.value, resolve, caption_prompt)
        except RecordError as error:
            data.bad_records.append(record.bad(str(error)))
            continue
        kinds.add(kind)
        data.examples += [VlmExample(ex.images, ex.messages, f"{path.name} line {record.line_number}") for ex in examples]
    data.layout = f"JSON records ({', '.join(sorted(kinds)) or 'none usable'})"
    data.bad_records.sort(key=lambda item: item.line_number)
    return data


def _string_list(value: Any, key: str) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(item, str) and item.strip() for item in values):
        raise RecordError(f"'{key}' should be a path or a list of paths")
    return values


def _record_examples(value: dict, resolve, caption_prompt: str) -> tuple[list[VlmExample], str]:
    """The examples of one JSON record, and its kind (caption or chat)."""
    images_key = "images" if "images" in value else "image" if "image" in value else None
    images = _string_list(value[images_key], images_key) if images_key and value[images_key] is not None else []
    if "messages" in value or "conversations" in value:
        messages, part_images = _chat_messages(value)
        images = images or part_images
        _place_images(messages, len(images))
        return [VlmExample([resolve(p) for p in images], messages)], "chat"
    caption_key = next((key for key in ("caption", "text", "captions") if key in value), None)
    if caption_key is None:
        raise RecordError('expected {"image": ..., "caption": ...} or {"messages": [...], "images": [...]}')
    if not images:
        raise RecordError("no image: a vision-language record needs 'image' or 'images'")
    captions = _string_list(value[caption_key], caption_key)
    if len(images) != 1:
        raise RecordError(f"a caption record takes one image, this one has {len(images)}: use a chat record with <image> markers")
    return [VlmExample([resolve(images[0])], caption_messages(caption_prompt, caption)) for caption in captions], "caption"


def _chat_messages(value: dict) -> tuple[list[dict[str, str]], list[str]]:
    """Messages with string contents (image parts become <image> markers), and image paths found in the parts."""
    list_key, role_key, content_key = ("messages", "role", "content") if "messages" in value else ("conversations", "from", "value")
    turns = value[list_key]
    if not isinstance(turns, list) or not turns:
        raise RecordError(f"'{list_key}' should be a non-empty list")
    normalised, part_images = [], []
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise RecordError(f"{list_key}[{number}] should be an object")
        role = turn.get(role_key, turn.get("role", turn.get("from")))
        content = turn.get(content_key, turn.get("content", turn.get("value")))
        if isinstance(content, list):
            pieces = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image":
                    pieces.append(IMAGE_MARKER)
                    source = part.get("image") or part.get("path")
                    if isinstance(source, str):
                        part_images.append(source)
                elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                else:
                    raise RecordError(f"{list_key}[{number}] has a content part that is neither {{type: text}} nor {{type: image}}")
            content = "\n".join(pieces)
        normalised.append({"role": SHAREGPT_ROLES.get(role, role) if isinstance(role, str) else role, "content": content})
    # The text formats' checks: known roles, string contents, an assistant turn to learn from.
    return to_conversation({"messages": normalised}, "chat"), part_images


def _place_images(messages: list[dict[str, str]], count: int) -> None:
    """Check the <image> markers against the images; without markers, put the images before the first user message."""
    if count == 0:
        raise RecordError("no image: a vision-language record needs 'images' (text-only records: train them as a causal LM)")
    if any(IMAGE_MARKER in m["content"] for m in messages if m["role"] == "assistant"):
        raise RecordError(f"{IMAGE_MARKER} in an assistant turn: images go in user turns")
    markers = sum(m["content"].count(IMAGE_MARKER) for m in messages)
    if markers == 0:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise RecordError("no user turn to put the image in")
        first_user["content"] = IMAGE_MARKER * count + "\n" + first_user["content"]
    elif markers != count:
        raise RecordError(f"{markers} {IMAGE_MARKER} marker(s) but {count} image(s)")


def _read_image_folder(root: Path, caption_prompt: str) -> VlmData:

    scan = scan_image_folder(root)
    data = VlmData(examples=[], bad_images=list(scan.bad), skipped=len(scan.bad), layout=f"image folder ({scan.layout} layout)")
    data.bad_records = [BadRecord(0, line) for line in scan.bad_lines]
    for item in scan.items:
        if not item.caption.strip():
            data.bad_records.append(BadRecord(0, f"{item.path}: empty caption"))
            continue
        # kohya's repeat count: the image is seen that many times per epoch.
        data.examples += [VlmExample([str(item.path)], caption_messages(caption_prompt, item.caption.strip()), str(item.path))] * item.repeats
    data.records = len(data.examples) + len(data.bad_records) + data.skipped
    return data


# ---------------------------------------------------------------------------------------------
# Checking images


def image_problem(path: str | Path) -> str | None:
    """Why an image cannot be used (missing, undecodable, empty), or None.

    The whole image is decoded: ``verify()`` alone misses truncated files, which would then
    fail a training step.
    """
    from PIL import Image

    path = Path(path)
    if not path.is_file():
        return "file not found"
    if not usable(path):  # a UI run's image outside its folders (an absolute name, a symlink): counted, never decoded
        return OUTSIDE_REASON
    try:
        with Image.open(path) as image:
            image.load()
            width, height = image.size
    # Pillow raises many kinds of errors on damaged files; each means "skip this image".
    except Exception as error:
        return f"cannot be decoded ({type(error).__name__}: {error})"
    if width == 0 or height == 0:
        return f"zero-size image ({width}x{height})"
    return None


def check_images(data: VlmData) -> VlmData:
    """Decode every image once; examples with an unreadable image are dropped and counted."""
    problems: dict[str, str | None] = {}
    kept = []
    for example in data.examples:
        for image in example.images:
            if image not in problems:
                problems[image] = image_problem(image)
                if problems[image] is not None:
                    data.bad_images.append(BadImage(Path(image), problems[image]))
        if all(problems[image] is None for image in example.images):
            kept.append(example)
        else:
            data.skipped += 1
    data.examples = kept
    return data


def check_bad_fraction(data: VlmData, source: Path | str, max_bad_fraction: float, max_bad_records: int | None) -> None:
    """Refuse the data when the malformed records and the examples skipped for their images are too many.

    Raises:
        DataError: naming the first bad records and images, and the setting to change.
    """
    bad, total = data.bad_count, max(data.records, 1)
    if max_bad_records is not None:
        if bad <= max_bad_records:
            return
        limit, key = f"{bad} > data.max_bad_records {max_bad_records}", "data.max_bad_records"
    else:
        if bad <= max_bad_fraction * total:
            return
        limit, key = f"{100 * bad / total:.3g}% > data.max_bad_fraction {100 * max_bad_fraction:.3g}%", "data.max_bad_fraction"
    raise DataError(
        f"data.path {source}: {bad} of {data.records} examples cannot be used ({limit}): {describe_bad(data)}. "
        f"Fix the data (or data.vision.image_root) or raise {key}."
    )


def describe_bad(data: VlmData) -> str:
    parts = []
    if data.bad_images:
        shown = "; ".join(str(b) for b in data.bad_images[:BAD_SHOWN])
        more = " ..." if len(data.bad_images) > BAD_SHOWN else ""
        parts.append(f"{data.skipped} example(s) with unreadable images ({len(data.bad_images)} file(s): {shown}{more})")
    if data.bad_records:
        shown = "; ".join(str(b) for b in data.bad_records[:BAD_SHOWN])
        parts.append(f"{len(data.bad_records)} malformed record(s) ({shown}{' ...' if len(data.bad_records) > BAD_SHOWN else ''})")
    return ", ".join(parts)


def load_vlm_data(
    path: str | Path,
    image_root=None,
    caption_prompt: str = "Describe the image.",
    max_bad_fraction: float = 0.01,
    max_bad_records: int | None = None,
    image_dir: Path | None = None,
) -> VlmData:
    """Read the examples, decode their images and refuse the data when too much of it is bad.

    Raises:
        DataError: unreadable data, too many bad examples, or nothing left to train on.
    """
    data = check_images(read_vlm_data(path, image_root, caption_prompt, image_dir))
    check_bad_fraction(data, path, max_bad_fraction, max_bad_records)
    if not data.examples:
        why = describe_bad(data) or "the file is empty"
        raise DataError(f"data.path {path}: no usable example ({why}). Check the file and data.vision.image_root.")
    return data


# ---------------------------------------------------------------------------------------------
# Manifest: what the launcher hands the ranks


def write_manifest(path: Path, examples: list[VlmExample]) -> None:

    write_atomic(path, "".join(json.dumps({"images": ex.images, "messages": ex.messages, "where": ex.where}) + "\n" for ex in examples))


def read_manifest(path: Path) -> list[VlmExample]:
    if not path.is_file():
        raise DataError(f"{path} is missing: it is written by the launcher before the ranks start; start the run again to rebuild it")
    return [VlmExample(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# Model inputs (in the ranks)


def load_rgb(path: str | Path):
    """The image as RGB, turned upright by its EXIF orientation, transparency on white.

    Raises:
        DataError: the file changed since the launcher checked it and cannot be decoded now.
    """
    from PIL import Image, ImageOps

    if not usable(path):  # swapped for a symlink out of a UI run's folders since the launcher checked it
        raise DataError(f"{path} {OUTSIDE_REASON}")
    try:
        with Image.open(path) as opened:
            opened.load()
            image = ImageOps.exif_transpose(opened)
            if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
                rgba = image.convert("RGBA")
                white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                return Image.alpha_composite(white, rgba).convert("RGB")
            return image.convert("RGB")
    except Exception as error:
        raise DataError(f"{path} cannot be decoded any more ({error}); it was readable when the run started: restore the file and resume") from error


@dataclass
class ImagePiece:
    """What the processor makes of one image: the tokens that replace its placeholder, and its tensors."""

    ids: list[int]
    per_token: dict[str, list[int]]  # token_type_ids (Gemma 3): aligned with ids
    tensors: dict[str, torch.Tensor]  # pixel_values (and image_sizes, image_grid_thw...), batch dim first


class VlmEncoder:
    """Examples (messages with ``<image>`` markers, images) to model inputs, the same way for training and generation."""

    PER_TOKEN_KEYS = ("token_type_ids", "mm_token_type_ids")
    TEXT_KEYS = ("input_ids", "attention_mask", "num_crops")

    def __init__(self, processor, max_seq_len: int | None = None):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        # The string the processor expands per image (LLaVA: <image>; Gemma 3: <start_of_image>).
        self.placeholder = processor.image_token
        self.placeholder_id = self.tokenizer.convert_tokens_to_ids(self.placeholder)
        self.max_seq_len = max_seq_len

    def encode_image(self, image) -> ImagePiece:
        out = self.processor(text=[self.placeholder], images=[image], add_special_tokens=False, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        per_token = {key: out[key][0].tolist() for key in self.PER_TOKEN_KEYS if key in out}
        tensors = {key: value for key, value in out.items() if key not in self.PER_TOKEN_KEYS + self.TEXT_KEYS and isinstance(value, torch.Tensor)}
        return ImagePiece(ids, per_token, tensors)

    def encode(self, messages: list[dict[str, str]], images: list, for_generation: bool = False, pieces: list[ImagePiece] | None = None) -> dict[str, Any]:
        """input_ids, labels (assistant tokens only), per-token ids and the image tensors of one example.

        ``pieces``: the images already processed (``encode_image``), for a caller encoding several texts with the same images.

        Raises:
            DataError: the markers and the images do not match in number.
        """

        marked = [{"role": m["role"], "content": m["content"].replace(IMAGE_MARKER, self.placeholder)} for m in messages]
        if for_generation:
            ids = render_prompt(self.tokenizer, marked)
            labels = [IGNORE_INDEX] * len(ids)
        else:
            ids, labels = render_example(self.tokenizer, marked)
        positions = [index for index, token in enumerate(ids) if token == self.placeholder_id]
        if len(positions) != len(images):
            raise DataError(
                f"{len(positions)} image placeholder(s) in the rendered text but {len(images)} image(s): "
                f"the text itself contains {self.placeholder!r}"
            )
        pieces = pieces if pieces is not None else [self.encode_image(image) for image in images]
        input_ids: list[int] = []
        out_labels: list[int] = []
        per_token: dict[str, list[int]] = {key: [] for piece in pieces for key in piece.per_token}
        start, image_end = 0, 0
        for position, piece in zip(positions, pieces):
            input_ids += ids[start:position] + piece.ids
            out_labels += labels[start:position] + [IGNORE_INDEX] * len(piece.ids)
            for key in per_token:
                per_token[key] += [0] * (position - start) + piece.per_token.get(key, [0] * len(piece.ids))
            start = position + 1
            image_end = len(input_ids)
        input_ids += ids[start:]
        out_labels += labels[start:]
        for key in per_token:
            per_token[key] += [0] * (len(ids) - start)
        if self.max_seq_len is not None and not for_generation and len(input_ids) > self.max_seq_len:
            # Never inside an image: the model needs all of an image's tokens or none.
            limit = max(self.max_seq_len, image_end)
            input_ids, out_labels = input_ids[:limit], out_labels[:limit]
            per_token = {key: values[:limit] for key, values in per_token.items()}
        if out_labels:
            out_labels[0] = IGNORE_INDEX
        example = {"input_ids": torch.tensor(input_ids, dtype=torch.long), "labels": torch.tensor(out_labels, dtype=torch.long)}
        example.update({key: torch.tensor(values, dtype=torch.long) for key, values in per_token.items()})
        example["images"] = {key: torch.cat([piece.tensors[key] for piece in pieces]) for key in (pieces[0].tensors if pieces else {})}
        return example


class VlmDataset(torch.utils.data.Dataset):
    """The manifest's examples, each image loaded and processed when the example is used."""

    def __init__(self, manifest: Path, encoder: VlmEncoder):
        self.examples = read_manifest(manifest)
        self.encoder = encoder

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        example = self.examples[index]
        return self.encoder.encode(example.messages, [load_rgb(path) for path in example.images])


def collate_vlm(batch: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad the text on the right (padding carries no loss) and stack every example's images."""

    if not batch:
        raise ValueError("cannot collate an empty batch")
    longest = max(len(example["input_ids"]) for example in batch)
    out = {
        "input_ids": torch.full((len(batch), longest), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(batch), longest), dtype=torch.long),
        "labels": torch.full((len(batch), longest), IGNORE_INDEX, dtype=torch.long),
    }
    per_token = [key for key in batch[0] if key not in ("input_ids", "labels", "images")]
    out.update({key: torch.zeros((len(batch), longest), dtype=torch.long) for key in per_token})
    for row, example in enumerate(batch):
        length = len(example["input_ids"])
        out["input_ids"][row, :length] = example["input_ids"]
        out["labels"][row, :length] = example["labels"]
        out["attention_mask"][row, :length] = 1
        for key in per_token:
            out[key][row, :length] = example[key]
    for key in batch[0]["images"]:
        out[key] = torch.cat([example["images"][key] for example in batch])
    return out


__all__ = [
    "IMAGE_MARKER",
    "VlmData",
    "VlmDataset",
    "VlmEncoder",
    "VlmExample",
    "caption_messages",
    "check_images",
    "collate_vlm",
    "load_rgb",
    "load_vlm_data",
    "read_vlm_data",
]
