"""The launcher's data preparation for causal language models: records read, validated and tokenized once.

The records (data.path, a mixture or a generated task) are read and checked, the tokenizer
loaded or trained on them, and everything tokenized into the run's memory-mapped cache
(``RUN/cache``; held-out data into ``RUN/cache/eval``; packed sequences indexed there too),
so that bad data stops the run before the ranks start and every rank reads the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from zeropipe.config.schema import RunConfig
from zeropipe.data.formats import DETECTION_SAMPLE, detect_format
from zeropipe.data.mixture import build_mixture
from zeropipe.data.packing import build_pack_index, read_pack_info
from zeropipe.data.records import Record, data_files, iter_records, sample_records
from zeropipe.data.split import RecordSplit
from zeropipe.data.synthetic import generate_dataset
from zeropipe.data.token_cache import TOKEN_CACHE_ARRAYS, build_token_cache, default_workers
from zeropipe.data.tokenizer import texts_for_tokenizer, train_tokenizer
from zeropipe.rundir import RunDir


def prepare_data_file(config: RunConfig, run: RunDir) -> Path:
    if config.data.mixture:

        return build_mixture(config.data, run.data, config.run.seed)
    if config.data.synthetic is None:
        return Path(config.data.path).expanduser()

    path = run.data / "train.jsonl"
    if not path.is_file():
        run.data.mkdir(exist_ok=True)
        synthetic = config.data.synthetic
        generate_dataset(synthetic.task, synthetic.examples, synthetic.seed, path)
    return path


def prepare_tokenizer(config: RunConfig, run: RunDir, records_path: Path, reuse: bool, texts: Callable[[], Iterable[str]] | None = None):
    """The run's tokenizer: the run's saved one on reuse, model.tokenizer / model.path's, or one trained on the data.

    ``texts``: what a trained tokenizer learns from (default: the records as supervised texts;
    preference data gives its prompts and answers).
    """
    from transformers import AutoTokenizer

    if reuse and run.tokenizer.is_dir():
        return AutoTokenizer.from_pretrained(str(run.tokenizer))
    source = config.model.tokenizer or config.model.path
    if source:
        tokenizer = AutoTokenizer.from_pretrained(source)
        if tokenizer.pad_token is None:
            # Padding is masked out of attention and loss, so the EOS token can stand in.
            tokenizer.pad_token = tokenizer.eos_token
    else:

        tokenizer = train_tokenizer(texts() if texts else training_texts(config, records_path), config.model.tokenizer_vocab_size, run.tokenizer)
    tokenizer.save_pretrained(str(run.tokenizer))
    return tokenizer


def training_texts(config: RunConfig, records_path: Path) -> Iterator[str]:
    """The texts a tokenizer is trained on, streamed: the records are never all held.

    Raises:
        DataError: the data cannot be read or its format cannot be told (raised at once, not when first iterated).
    """

    columns = data_columns(config, records_path)
    sample, bad = sample_records(records_path, columns, DETECTION_SAMPLE)
    fmt = detect_format([record.value for record in sample], config.data.format, source=records_path, bad=bad)
    records = (item.value for item in iter_records(records_path, columns) if isinstance(item, Record))
    return texts_for_tokenizer(records, fmt)


def data_columns(config: RunConfig, records_path: Path) -> dict[str, str] | None:
    """data.columns, for data.path (a mixture or a generated file is written with ZeRO-Pipe's own keys)."""

    if config.data.mixture or config.data.synthetic is not None:
        return None
    return config.data.columns


def prepare_cache(config: RunConfig, run: RunDir, records_path: Path, tokenizer, reuse: bool) -> dict:

    info_file = run.cache / "cache.json"
    if reuse and info_file.is_file():
        return json.loads(info_file.read_text())
    split = record_split(config, held_out=False)
    shared = shared_token_cache(config, records_path, tokenizer, split)
    if shared is not None and (shared / "cache.json").is_file():
        link_cache(shared, run.cache)
        return {**json.loads(info_file.read_text()), "reused_from": str(shared)}
    progress = progress_bar("tokenizing", records_path, run)
    build_token_cache(
        records_path,
        tokenizer,
        run.cache,
        fmt=config.data.format,
        max_seq_len=config.data.max_seq_len,
        max_bad_fraction=config.data.max_bad_fraction,
        max_bad_records=config.data.max_bad_records,
        split=split,
        columns=data_columns(config, records_path),
        progress=progress,
        num_workers=preparation_workers(config),
    )
    progress.done()
    if shared is not None:
        publish_cache(run.cache, shared)
    return json.loads(info_file.read_text())


TOKEN_CACHE_VERSION = 2  # uint16/uint32 tokens and a byte loss mask


def shared_token_cache(config: RunConfig, records_path: Path, tokenizer, split) -> Path | None:
    """Where a token cache of these exact inputs is kept for other runs (and a curriculum's stages), by fingerprint.

    The fingerprint is the data files' identity (resolved path, size, modification time), the
    tokenizer (its full definition), its chat template and special tokens, the format, column
    mapping, max_seq_len and held-out split: a change to any of them is another cache. None for
    generated data (a mixture or a synthetic task is written into each run's own folder).
    """

    if config.data.mixture or config.data.synthetic is not None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow tokenizer has no definition to fingerprint cheaply: the run keeps its own cache
    files = [
        [str(file.resolve()), file.stat().st_size, file.stat().st_mtime_ns] for file in data_files(records_path)
    ]
    identity = {
        "version": TOKEN_CACHE_VERSION,
        "files": files,
        "tokenizer": hashlib.sha256(backend.to_str().encode()).hexdigest(),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, len(tokenizer)],
        "format": config.data.format,
        "columns": data_columns(config, records_path),
        "max_seq_len": config.data.max_seq_len,
        "split": [split.fraction, split.seed, split.held_out] if split is not None else None,
    }
    fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]
    root = Path(config.data.cache.dir).expanduser() if config.data.cache.dir else Path(config.run.output_dir).expanduser() / ".zeropipe-cache"
    return root / "tokens" / fingerprint


def link_cache(source: Path, target: Path) -> None:
    """The cache files of ``source`` in ``target``: hard links where the filesystem allows (no copy), else copies; cache.json last."""

    target.mkdir(parents=True, exist_ok=True)
    (target / "cache.json").unlink(missing_ok=True)
    for name in (*TOKEN_CACHE_ARRAYS, "cache.json"):
        partial = target / f"{name}.partial"
        partial.unlink(missing_ok=True)
        try:
            os.link(source / name, partial)
        except OSError:
            shutil.copyfile(source / name, partial)
        # Replaced, never written into: a cache file shared by links is never changed in place.
        os.replace(partial, target / name)


def publish_cache(built: Path, shared: Path) -> None:
    """Offer a run's new cache to later runs; a failure (a read-only folder, another run publishing) costs only the reuse."""

    staging = shared.with_name(f"{shared.name}.partial-{os.getpid()}")
    try:
        link_cache(built, staging)
        if shared.exists():
            shutil.rmtree(staging)  # another run published the same inputs first
        else:
            os.replace(staging, shared)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def preparation_workers(config: RunConfig) -> int:
    """data.num_workers, with 'auto' resolved to the launcher's cores."""

    workers = config.data.num_workers
    return default_workers() if workers == "auto" else workers


def progress_bar(what: str, source: Path, run: RunDir):
    """A callback showing records read and records/s: on the launcher's terminal (stderr) and, once a second, in the UI (progress.json)."""

    import sys
    import time

    started = last_written = time.monotonic()
    terminal = sys.stderr.isatty()

    def show(records: int) -> None:
        nonlocal last_written
        now = time.monotonic()
        elapsed = max(now - started, 1e-9)
        line = f"{what} {source.name}: {records:,} records, {records / elapsed:,.0f}/s, {elapsed:.0f} s"
        if terminal:
            sys.stderr.write(f"\r{line} ")
            sys.stderr.flush()
        if now - last_written >= 1.0:
            last_written = now
            run.write_progress(line, records)

    def done() -> None:
        if terminal:
            sys.stderr.write("\n")
            sys.stderr.flush()

    show.done = done
    return show


def record_split(config: RunConfig, held_out: bool):
    """The data.eval_fraction split of data.path (None without one); drawn with run.seed."""

    if not config.data.eval_fraction:
        return None
    return RecordSplit(config.data.eval_fraction, config.run.seed, held_out=held_out)


def prepare_eval_cache(config: RunConfig, run: RunDir, records_path: Path, tokenizer, reuse: bool) -> list[str]:
    """Tokenize the held-out data (data.eval_path, or data.eval_fraction of data.path) into RUN/cache/eval."""

    data = config.data
    if not (data.eval_path or data.eval_fraction):
        return []
    info_file = run.eval_cache / "cache.json"
    if not (reuse and info_file.is_file()):
        build_token_cache(
            Path(data.eval_path).expanduser() if data.eval_path else records_path,
            tokenizer,
            run.eval_cache,
            fmt=data.format,
            max_seq_len=data.max_seq_len,
            max_bad_fraction=data.max_bad_fraction,
            max_bad_records=data.max_bad_records,
            split=record_split(config, held_out=True),
            columns=data.columns if data.eval_path else data_columns(config, records_path),
            num_workers=preparation_workers(config),
        )
    info = json.loads(info_file.read_text())
    source = data.eval_path or f"{100 * data.eval_fraction:.3g}% of the records of {records_path}, drawn with run.seed"
    when = f"every {config.train.eval_every} steps and " if config.train.eval_every else ""
    return [f"evaluation: {info['examples']} held-out examples ({source}), {when}at the end"]


def prepare_packs(config: RunConfig, run: RunDir, reuse: bool) -> dict:
    """Decide once which examples share a packed sequence, so every rank and every resume agrees."""

    info = read_pack_info(run.cache)
    if reuse and info is not None and info.get("max_seq_len") == config.data.max_seq_len:
        return info
    return build_pack_index(run.cache, config.data.max_seq_len)
