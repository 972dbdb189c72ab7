"""Dataset preview: the first records of a config's data as the trainer will see them.

For language models the records go through the trainer's own steps (``launch/prepare.py``
and ``data/tokenize.py``): reading with malformed lines set aside, format detection, the
conversation, the tokenizer's chat template (or the built-in one), truncation at
``data.max_seq_len``, and the mask that keeps the prompt out of the loss. The page shows each
example as pieces of text marked "prompt" (no loss) or "learned". Records the trainer would
skip are listed with their file, line and reason, and whether their share stops the run.

For diffusion image folders it shows thumbnails with their caption and aspect-ratio bucket.

The API runs it confined to the UI's folders (``zeropipe.confine.confining``): a file of a data
folder that is a symlink to elsewhere is listed as skipped, with why, and never opened.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from zeropipe.confine import also_allowing, confining
from zeropipe.errors import ZeroPipeError
from zeropipe.server.dataset import shown_caption

SHOWN_EXAMPLES = 20
SHOWN_SKIPPED = 50
TOKENIZER_SAMPLE = 5000  # records a preview tokenizer is trained on (the run trains on all)
MAX_DATA_BYTES = 512 * 1024 * 1024
PREVIEW_SYNTHETIC = TOKENIZER_SAMPLE  # generated records a preview makes, whatever data.synthetic.examples asks


def preview(config, limit: int = SHOWN_EXAMPLES, cancel=None) -> dict[str, Any]:
    """The preview of ``config``'s training data (a validated RunConfig whose paths were confined).

    ``cancel`` (a threading.Event, set when the client leaves) is asked between records and between images.

    Raises:
        ZeroPipeError: the data cannot be read (the message says why and what to fix).
    """
    from zeropipe.families import family_of

    family = family_of(config.model).name
    previews = {"causal_lm": text_preview, "diffusion": image_preview}  # the UI's views of each family's data
    if family not in previews:
        return {
            "family": family,
            "available": False,
            "reason": f"the preview of {family} data is not built yet: `zeropipe train` reports its skipped records when it starts",
        }
    return previews[family](config, limit, cancel)


def stop_if(cancel) -> None:
    if cancel is not None and cancel.is_set():
        from zeropipe.server.generation import Cancelled

        raise Cancelled("the preview was cancelled: its client left")


def text_preview(config, limit: int, cancel=None) -> dict[str, Any]:
    from zeropipe.data.formats import RecordError, detect_format, read_located_records, to_conversation
    from zeropipe.data.tokenize import conversation_segments, tokenize_batch
    from zeropipe.data.tokenize import IGNORE_INDEX

    data = config.data
    with tempfile.TemporaryDirectory(prefix="zeropipe-preview-") as scratch, confining(also_allowing(Path(scratch))):  # generated data is read from scratch
        path, source = data_file(config, Path(scratch))
        size = sum(expanded_size(p) for p in ([path] if path.is_file() else path.iterdir()) if p.is_file())
        if size > MAX_DATA_BYTES:
            raise ZeroPipeError(f"{path} holds {size / 2**20:,.0f} MiB once decompressed: the preview reads at most {MAX_DATA_BYTES // 2**20} MiB; preview a sample of it")
        stop_if(cancel)
        records, bad = read_located_records(path)
        total = len(records) + len(bad)
        if data.synthetic is not None:
            total = data.synthetic.examples  # the run's count, of which the first were generated here
        if not records:
            return {"family": "causal_lm", "available": True, "source": source, "records": total, "format": None, "examples": [],
                    "skipped": [b.to_json() for b in bad[:SHOWN_SKIPPED]], "skipped_count": len(bad), "verdict": verdict(len(bad), total, data)}  # fmt: skip
        fmt = detect_format([record.value for record in records], data.format)
        tokenizer, tokenizer_note = preview_tokenizer(config, [r.value for r in records[:TOKENIZER_SAMPLE]], fmt, Path(scratch))
        examples = []
        for number, record in enumerate(records):
            if number % 256 == 0:
                stop_if(cancel)
            try:
                content = to_conversation(record.value, fmt)
                plan = content if isinstance(content, str) else conversation_segments(tokenizer, content, False)
            except RecordError as error:
                bad.append(record.bad(str(error)))
                continue
            if len(examples) >= limit:
                continue  # keep checking the rest: their reasons belong in the skipped list
            # The trainer's own tokenizing, truncation and masking (build_token_cache).
            chunks = tokenize_batch(tokenizer, [plan], data.max_seq_len)
            input_ids, labels, truncated = chunks[0]
            examples.append({
                "file": record.file, "line": record.line_number, "tokens": len(input_ids), "loss_tokens": sum(1 for x in labels if x != IGNORE_INDEX),
                "truncated": bool(truncated), "chunks": len(chunks), "pieces": pieces(tokenizer, input_ids, labels, IGNORE_INDEX),
            })  # fmt: skip
        bad.sort(key=lambda item: (item.file, item.line_number))
        return {
            "family": "causal_lm",
            "available": True,
            "source": source,
            "format": fmt,
            "format_detected": data.format == "auto",
            "records": total,
            "tokenizer": tokenizer_note,
            "max_seq_len": data.max_seq_len,
            "examples": examples,
            "skipped": [b.to_json() for b in bad[:SHOWN_SKIPPED]],
            "skipped_count": len(bad),
            "verdict": verdict(len(bad), total, data),
        }


def expanded_size(path: Path) -> int:
    """The bytes a file becomes when read: a Parquet file's uncompressed size from its footer (a 3 KB zstd file held 381 MiB).

    Raises:
        ZeroPipeError: a Parquet file whose footer cannot be read.
    """
    size = path.stat().st_size
    if path.suffix.lower() == ".arrow":
        return arrow_expanded_size(path, size)
    if path.suffix.lower() != ".parquet":
        return size
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
    except Exception as err:  # noqa: BLE001 - any unreadable footer is one answer
        raise ZeroPipeError(f"{path} is not a readable Parquet file ({type(err).__name__}): {err}") from None
    expanded = 0
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        expanded += sum(row_group.column(c).total_uncompressed_size for c in range(row_group.num_columns))
    return max(size, expanded)


def arrow_expanded_size(path: Path, size: int) -> int:
    """An Arrow IPC file's size once its (LZ4 or zstd) buffers are decompressed, counted one record batch at a time and stopped
    at the first batch past MAX_DATA_BYTES: its footer holds no uncompressed sizes, so one batch is the most ever held.

    Raises:
        ZeroPipeError: not a readable Arrow IPC file.
    """
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            try:
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
            except pa.ArrowInvalid:
                source.seek(0)
                opened = pa.ipc.open_file(source)
                batches = (opened.get_batch(i) for i in range(opened.num_record_batches))
            expanded = 0
            for batch in batches:
                expanded += batch.get_total_buffer_size()
                del batch
                if expanded > MAX_DATA_BYTES:
                    break
    except (pa.ArrowException, OSError) as err:
        raise ZeroPipeError(f"{path} is not a readable Arrow file ({type(err).__name__}): {err}") from None
    return max(size, expanded)


def data_file(config, scratch: Path) -> tuple[Path, str]:
    data = config.data
    if data.mixture:
        raise ZeroPipeError("the preview shows one source: set data.path (or data.synthetic) to the source to look at")
    if data.synthetic is not None:
        from zeropipe.data.synthetic import generate_dataset

        synthetic = data.synthetic
        # Generated records are all well-formed: the preview generates what it shows (and what
        # its tokenizer trains on), not the run's whole set (2,000,000 took 29 s and 1.3 GB here).
        count = min(synthetic.examples, PREVIEW_SYNTHETIC)
        path = generate_dataset(synthetic.task, count, synthetic.seed, scratch / "synthetic.jsonl")
        shown = f"; the first {count:,} generated here" if count < synthetic.examples else ""
        return Path(path), f"generated {synthetic.task} ({synthetic.examples:,} examples, seed {synthetic.seed}{shown})"
    if not data.path:
        raise ZeroPipeError("no data: set data.path to your data file or folder (or data.synthetic)")
    return Path(data.path), data.path


def preview_tokenizer(config, records: list, fmt: str, scratch: Path):
    """The tokenizer the run will use: model.tokenizer / model.path's, or one trained on the data as prepare does."""
    source = config.model.tokenizer or config.model.path
    if source:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ZeroPipeError(f"cannot load the tokenizer of {source}: {err}") from None
        return (
            tokenizer,
            f"{source} ({'its chat template' if getattr(tokenizer, 'chat_template', None) else 'the built-in template: it has no chat template'})",
        )
    from zeropipe.data.tokenizer import texts_for_tokenizer, train_tokenizer

    tokenizer = train_tokenizer(texts_for_tokenizer(records, fmt), config.model.tokenizer_vocab_size, scratch / "tokenizer")
    return tokenizer, f"trained on the data as the run will train it (here on the first {len(records)} records; the built-in template)"


def pieces(tokenizer, input_ids: list[int], labels: list[int], ignore: int) -> list[dict[str, Any]]:
    """The example as consecutive pieces of text, each either prompt (masked: no loss) or learned."""
    out: list[dict[str, Any]] = []
    start = 0
    for index in range(1, len(input_ids) + 1):
        if index == len(input_ids) or (labels[index] == ignore) != (labels[start] == ignore):
            ids = input_ids[start:index]
            out.append({"text": tokenizer.decode(ids, skip_special_tokens=False), "loss": labels[start] != ignore, "tokens": len(ids)})
            start = index
    return out


def verdict(bad: int, total: int, data) -> dict[str, Any]:
    """Whether the run would start with this many malformed records (the trainer's rule)."""
    if data.max_bad_records is not None:
        refused = bad > data.max_bad_records
        rule = f"data.max_bad_records {data.max_bad_records}"
    else:
        refused = total > 0 and bad > data.max_bad_fraction * total
        rule = f"data.max_bad_fraction {100 * data.max_bad_fraction:.3g}%"
    share = f"{bad} of {total} records ({100 * bad / total:.3g}%)" if total else "no records"
    if refused:
        return {"starts": False, "text": f"the run would refuse to start: {share} are malformed, over {rule}. Fix them, or raise {rule.split()[0]}"}
    return {"starts": True, "text": f"{share} skipped, within {rule}: the run starts and skips them"}


def image_preview(config, limit: int, cancel=None) -> dict[str, Any]:
    """Thumbnails of a diffusion image folder with caption, repeats and aspect-ratio bucket (as prepare assigns them)."""
    from zeropipe.data.images import generate_shapes_dataset, scan_image_folder
    from zeropipe.families.diffusion.buckets import assign_bucket, make_buckets

    data, images = config.data, config.data.images
    with tempfile.TemporaryDirectory(prefix="zeropipe-preview-") as scratch, confining(also_allowing(Path(scratch))):  # generated data is read from scratch
        if data.synthetic is not None:
            folder = generate_shapes_dataset(
                Path(scratch) / "shapes", min(data.synthetic.examples, 200), data.synthetic.seed, resolution=min(images.resolution, 256)
            )
            source = f"generated shapes (seed {data.synthetic.seed}; the first {min(data.synthetic.examples, 200)} shown here)"
        elif data.path:
            folder, source = Path(data.path), data.path
        else:
            raise ZeroPipeError("no data: set data.path to your image folder (or data.synthetic: {task: shapes})")
        scan = scan_image_folder(folder, caption_ext=images.caption_ext)  # decodes every image, as training's preparation does
        buckets = (
            make_buckets(images.resolution, images.bucket_step, images.max_aspect) if images.bucketing else [(images.resolution, images.resolution)]
        )
        shown = []
        for item in scan.items[:limit]:
            stop_if(cancel)
            width, height = assign_bucket(item.width, item.height, buckets)
            shown.append({
                "file": str(item.path.relative_to(Path(folder).resolve())), "caption": shown_caption(item.caption), "repeats": item.repeats,
                "size": [item.width, item.height], "bucket": [width, height], "thumbnail": thumbnail(item.path),
            })  # fmt: skip
        problems = [{"file": str(bad.path), "line": None, "reason": bad.reason} for bad in scan.bad] + [
            {"file": "", "line": None, "reason": line} for line in scan.bad_lines
        ]
        total = len(scan.items) + len(problems)
        counts: dict[str, int] = {}
        for item in scan.items:
            width, height = assign_bucket(item.width, item.height, buckets)
            counts[f"{width}x{height}"] = counts.get(f"{width}x{height}", 0) + item.repeats
        return {
            "family": "diffusion",
            "available": True,
            "source": source,
            "layout": scan.layout,
            "records": total,
            "images": shown,
            "buckets": counts,
            "missing_captions": len(scan.missing_captions),
            "skipped": problems[:SHOWN_SKIPPED],
            "skipped_count": len(problems),
            "verdict": verdict(len(problems), total, data),
        }


def thumbnail(path: Path, side: int = 160) -> str:
    """A small PNG of the image as a data: URL (the page needs no route to files in the data folders)."""
    import base64
    import io

    from PIL import Image, ImageOps

    from zeropipe.data.images import MAX_IMAGE_PIXELS

    with Image.open(path) as image:
        if image.size[0] * image.size[1] > MAX_IMAGE_PIXELS:
            raise ValueError(f"{image.size[0]}x{image.size[1]} pixels: no thumbnail")
        image.draft("RGB", (side * 2, side * 2))  # a JPEG decodes reduced (1/2 to 1/8)
        image = ImageOps.exif_transpose(image).convert("RGB")
        image.thumbnail((side, side))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
