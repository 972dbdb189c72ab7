"""Streaming the records of a data file or folder, one at a time, in every format people store data in.

Nothing here holds a dataset: :func:`iter_records` yields each record (or the reason it is
malformed) as it is read, so preparing a million records costs the memory of one batch.

- ``.jsonl``: one JSON object per line, read line by line (see :func:`_read_jsonl` for why
  this is our own reader and not pyarrow's);
- ``.json``: one JSON array of objects, decoded element by element from a sliding buffer;
- ``.txt``: documents separated by blank lines;
- ``.parquet``: read row group by row group, batch by batch (pyarrow), never whole;
- ``.csv`` / ``.tsv``: pyarrow's streaming CSV reader, every column read as text;
- ``.arrow``: an Arrow IPC file, memory-mapped (the shards of ``datasets.save_to_disk``);
- a **folder** of shards of any of these (its top level, else its subfolders: the Hub's
  ``data/train-00000-of-00004.parquet`` layout), or a folder written by
  ``datasets.save_to_disk`` (``state.json`` and its ``.arrow`` shards; of a ``DatasetDict``
  the ``train`` split).

``columns`` maps the names ZeRO-Pipe reads (``instruction``, ``output``, ``messages``...) to
the dataset's own column names, as LLaMA-Factory's ``dataset_info.json`` ``columns`` and
axolotl's ``field_*`` keys do; the records come out under ZeRO-Pipe's names.

A record that cannot be used is yielded as a :class:`BadRecord` naming its file and
line (or row); a file that cannot be read at all is a :class:`~zeropipe.errors.DataError`
naming the file, where, and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeropipe.confine import OUTSIDE_REASON, require_usable, usable
from zeropipe.errors import DataError

TEXT_SUFFIXES = (".jsonl", ".json", ".txt")
TABLE_SUFFIXES = (".parquet", ".csv", ".tsv", ".arrow")
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + TABLE_SUFFIXES
READ_BATCH = 1000  # rows converted to Python at once from a Parquet/Arrow/CSV batch
CSV_BLOCK_BYTES = 1 << 20  # what pyarrow's streaming CSV reader parses at a time
JSON_CHUNK_CHARS = 1 << 20  # what the .json array reader reads at a time
JSON_LARGEST_RECORD_CHARS = 256 << 20  # a .json element longer than this is a broken file, not a big record


@dataclass(frozen=True)
class BadRecord:
    """A record that was skipped, with where it is and why."""

    line_number: int
    reason: str
    file: str = ""  # set when data.path is a directory, so the line number can be found
    unit: str = "line"  # "row" for Parquet and Arrow records

    def __str__(self) -> str:
        where = f"{self.unit} {self.line_number}"
        return f"{self.file} {where}: {self.reason}" if self.file else f"{where}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        values: dict[str, Any] = {"file": self.file, "line": self.line_number, "reason": self.reason}
        if self.unit != "line":
            values["unit"] = self.unit
        return values


@dataclass(frozen=True)
class Record:
    """A good record and where it came from, so later problems can name its line."""

    value: dict | str
    line_number: int
    file: str = ""
    unit: str = "line"

    def bad(self, reason: str) -> BadRecord:
        return BadRecord(self.line_number, reason, self.file, self.unit)


def data_files(path: Path) -> list[Path]:
    """The files :func:`iter_records` reads for ``path``, in order.

    Raises:
        DataError: the path does not exist, has an unsupported suffix, or is a folder without data files.
    """
    return _data_files(path)[0]


def _data_files(path: Path) -> tuple[list[Path], list[Path]]:
    """The files to read, and those left out for resolving outside a UI run's folders (``zeropipe.confine``)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data.path {path}: no such file or directory. Fix data.path to point at your data.")
    require_usable(path, "data.path")  # a UI run's data: never through a symlink out of its folders
    if path.is_file():
        if path.suffix not in SUPPORTED_SUFFIXES:
            raise DataError(f"data.path {path}: unsupported file type '{path.suffix}'. Use one of {', '.join(SUPPORTED_SUFFIXES)}.")
        return [path], []
    listed = _saved_dataset_files(path)
    if listed is None:
        listed = _shard_files(path)
    files = [file for file in listed if usable(file)]
    if listed and not files:
        raise DataError(f"data.path {path}: every data file in it {OUTSIDE_REASON}. Point data.path at your data.")
    return files, [file for file in listed if file not in files]


def _shard_files(path: Path) -> list[Path]:
    """The data files of a folder: its top level, else its subfolders (the Hub's data/ layout)."""

    def visible(candidates) -> list[Path]:
        # Hidden files are editor and notebook leftovers, not data.
        return sorted(
            p for p in candidates
            if p.is_file() and p.suffix in SUPPORTED_SUFFIXES and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )

    files = visible(path.iterdir()) or visible(path.rglob("*"))
    if not files:
        raise DataError(
            f"data.path {path}: the directory has no {', '.join(SUPPORTED_SUFFIXES)} files. Fix data.path or add data files to it."
        )
    return files


def _saved_dataset_files(folder: Path) -> list[Path] | None:
    """The Arrow shards of a ``datasets.save_to_disk`` folder, or None when ``folder`` is not one."""
    splits_file = folder / "dataset_dict.json"
    if splits_file.is_file():
        try:
            splits = json.loads(splits_file.read_text())["splits"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DataError(f"data.path {folder}: dataset_dict.json is damaged (no 'splits' list). Save the dataset again with save_to_disk.") from None
        split = "train" if "train" in splits else (splits[0] if splits else None)
        if split is None:
            raise DataError(f"data.path {folder}: dataset_dict.json lists no split. Save the dataset again with save_to_disk.")
        return _saved_dataset_files(folder / split) or []
    state_file = folder / "state.json"
    if not state_file.is_file():
        return None
    try:
        names = [item["filename"] for item in json.loads(state_file.read_text())["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DataError(f"data.path {folder}: state.json is damaged (no '_data_files'). Save the dataset again with save_to_disk.") from None
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise DataError(f"data.path {folder}: state.json names {missing[0]}, which is not in the folder. Copy the whole save_to_disk folder.")
    return [folder / name for name in names]


def iter_records(path: Path, columns: Mapping[str, str] | None = None) -> Iterator[Record | BadRecord]:
    """Each record under ``path`` in order, or the reason it is malformed; nothing is held.

    The files are listed (and checked against a UI run's confinement, ``zeropipe.confine``)
    when this is called, not when the records are first asked for: a consumer in another
    thread (the tokenizer trainer's) does not see the caller's confinement.

    Args:
        columns: ZeRO-Pipe's name -> the dataset's column name (``{"output": "answer"}``).

    Raises:
        DataError: a file cannot be read at all (see :func:`data_files`, a damaged Parquet
            row group, a broken ``.json`` array, a binary file where text was expected).
    """
    files, outside = _data_files(path)
    several = len(files) + len(outside) > 1 or Path(path).is_dir()
    renames = {theirs: ours for ours, theirs in (columns or {}).items() if theirs != ours}
    return _iter_files(files, outside, several, renames)


def _iter_files(files: list[Path], outside: list[Path], several: bool, renames: dict[str, str]) -> Iterator[Record | BadRecord]:
    for file in outside:
        yield BadRecord(0, OUTSIDE_REASON, file=file.name)  # each file left out is one skipped record, named
    for file in files:
        label = file.name if several else ""
        items = _read_file(file, label)
        if not renames:
            yield from items
            continue
        for item in items:
            if isinstance(item, Record) and isinstance(item.value, dict):
                item = Record({renames.get(key, key): value for key, value in item.value.items()}, item.line_number, item.file, item.unit)
            yield item


SAMPLE_MOST_BAD = 1000  # malformed records a sample stops at: a file of nothing else is not read whole


def sample_records(path: Path, columns: Mapping[str, str] | None = None, count: int = 100) -> tuple[list[Record], list[BadRecord]]:
    """The first ``count`` good records (and the malformed ones met on the way, at most ``SAMPLE_MOST_BAD``), to detect the format from."""
    good: list[Record] = []
    bad: list[BadRecord] = []
    for item in iter_records(path, columns):
        if isinstance(item, BadRecord):
            bad.append(item)
            if len(bad) >= SAMPLE_MOST_BAD:
                break
        else:
            good.append(item)
            if len(good) >= count:
                break
    return good, bad


def _read_file(path: Path, label: str) -> Iterator[Record | BadRecord]:
    if path.suffix == ".parquet":
        return _read_parquet(path, label)
    if path.suffix == ".arrow":
        return _read_arrow(path, label)
    if path.suffix in (".csv", ".tsv"):
        return _read_csv(path, label, "\t" if path.suffix == ".tsv" else ",")
    with open(path, "rb") as handle:
        head = handle.read(8192)
    if b"\0" in head:
        # Text never holds NUL bytes: every "line" would be a malformed record, which hides the point.
        raise DataError(
            f"data.path {path}: this is a binary file, not {path.suffix} text (it holds NUL bytes). "
            "Point data.path at your JSONL, JSON, text, Parquet or CSV data."
        )
    if path.suffix == ".jsonl":
        return _read_jsonl(path, label)
    if path.suffix == ".json":
        return _read_json_array(path, label)
    return _read_text(path, label)


def _read_jsonl(path: Path, label: str) -> Iterator[Record | BadRecord]:
    # Our own line reader rather than pyarrow.json or datasets' JSON builder: those parse a
    # block of lines into one typed table, so one broken line (or one record whose field has
    # another type) fails the whole block with no line number, and a user cannot skip it.
    # Here each line is its own record: a bad one costs itself and is named by its line.
    # json.loads is C code; a line costs a few microseconds next to tens for tokenizing it
    # (benchmarks/data_scale.py measures the whole preparation against datasets).
    with open(path, "rb") as handle:
        # Bytes, not text: one line with broken UTF-8 should cost one record, not the file.
        for line_number, raw in enumerate(handle, start=1):
            if raw.endswith(b"\n"):
                raw = raw[:-1]  # so that an error's column is on this line, not the start of the next
            if line_number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte order mark written by some editors
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield BadRecord(line_number, f"not valid UTF-8 (byte {error.start + 1})", label)
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                yield BadRecord(line_number, f"not valid JSON ({error.msg} at column {error.colno})", label)
                continue
            if not isinstance(value, dict):
                yield BadRecord(line_number, f"expected a JSON object, got {json_type(value)}", label)
                continue
            yield Record(value, line_number, label)


class _JsonArrayText:
    """A sliding window over a ``.json`` file's text that knows the line number of each position."""

    def __init__(self, handle):
        self.handle = handle
        self.text = ""
        self.position = 0
        self.line = 1  # the line of self.position
        self.eof = False

    def more(self) -> bool:
        """Read the next chunk, dropping what was consumed; False at the end of the file."""
        if self.eof:
            return False
        chunk = self.handle.read(JSON_CHUNK_CHARS)
        if not chunk:
            self.eof = True
            return False
        self.text = self.text[self.position :] + chunk
        self.position = 0
        return True

    def advance(self, position: int) -> None:
        self.line += self.text.count("\n", self.position, position)
        self.position = position

    def skip_space(self) -> str:
        """The next non-space character, reading on as needed ("" at the end of the file)."""
        while True:
            while self.position < len(self.text) and self.text[self.position] in " \t\r\n":
                self.advance(self.position + 1)
            if self.position < len(self.text):
                return self.text[self.position]
            if not self.more():
                return ""


def _read_json_array(path: Path, label: str) -> Iterator[Record | BadRecord]:
    where = f"data.path {path}"
    decoder = json.JSONDecoder()
    try:
        with open(path, encoding="utf-8-sig") as handle:
            window = _JsonArrayText(handle)
            if window.skip_space() != "[":
                raise DataError(
                    f"{where}: a .json file must hold a JSON array of records ([{{...}}, {{...}}]). "
                    "Wrap the records in [ ] or save one object per line as .jsonl."
                )
            window.advance(window.position + 1)
            if window.skip_space() == "]":
                return
            while True:
                # Decode element by element rather than json.load() so every record keeps the
                # line it starts on and the file is never held whole; a broken element breaks
                # the array, so that one raises.
                while True:
                    try:
                        value, end = decoder.raw_decode(window.text, window.position)
                        break
                    except json.JSONDecodeError as error:
                        # An element cut by the end of the window decodes once more is read.
                        if len(window.text) - window.position < JSON_LARGEST_RECORD_CHARS and window.more():
                            continue
                        line = window.line + window.text.count("\n", window.position, error.pos)
                        raise DataError(
                            f"{where}: line {line}: not valid JSON ({error.msg}). A broken .json array cannot be partly "
                            "read: fix the file, or save one record per line as .jsonl so broken lines are skipped."
                        ) from None
                line_number = window.line
                window.advance(end)
                if isinstance(value, dict):
                    yield Record(value, line_number, label)
                else:
                    yield BadRecord(line_number, f"expected a JSON object, got {json_type(value)}", label)
                separator = window.skip_space()
                if separator == ",":
                    window.advance(window.position + 1)
                    window.skip_space()
                    continue
                if separator == "]":
                    break
                raise DataError(f"{where}: line {window.line}: expected ',' or ']' in the JSON array. Fix the file.")
            window.advance(window.position + 1)
            if window.skip_space():
                raise DataError(f"{where}: line {window.line}: extra data after the JSON array. Fix the file.")
    except UnicodeDecodeError as error:
        raise DataError(f"{where}: not valid UTF-8 (byte {error.start + 1} of a chunk). Save the file as UTF-8.") from None


def _read_text(path: Path, label: str) -> Iterator[Record | BadRecord]:
    document: list[str] = []
    start = 0
    with open(path, encoding="utf-8-sig", errors="replace") as handle:
        for line_number, line in enumerate(handle, start=1):
            line = line.rstrip("\r\n")
            if line.strip():
                if not document:
                    start = line_number
                document.append(line)
            elif document:
                yield Record("\n".join(document), start, label)
                document = []
    if document:
        yield Record("\n".join(document), start, label)


def _table_rows(batches, path: Path, label: str, unit: str, first_number: int, what: str) -> Iterator[Record | BadRecord]:
    """The rows of pyarrow record batches as records numbered from ``first_number``."""
    import pyarrow as pa

    number = first_number
    try:
        for batch in batches:
            for value in batch.to_pylist():
                yield Record(value, number, label, unit)
                number += 1
    except (pa.ArrowException, OSError) as error:
        raise DataError(
            f"data.path {path}: {what} cannot be read after {unit} {number - 1} ({_first_line(error)}). "
            "The file is damaged or cut short: download or export it again."
        ) from None


def _read_parquet(path: Path, label: str) -> Iterator[Record | BadRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # Read, not memory-mapped: the column chunks of one row group are decoded and let go, so
        # a 10 GB file does not accumulate as mapped pages in the launcher's resident memory.
        parquet = pq.ParquetFile(path, memory_map=False)
    except (pa.ArrowException, OSError) as error:
        raise DataError(
            f"data.path {path}: not a readable Parquet file ({_first_line(error)}). Download or export it again."
        ) from None
    row = 1
    groups = parquet.metadata.num_row_groups
    # Row group by row group, a batch at a time: never the whole table (nor pandas).
    for group in range(groups):
        rows = parquet.metadata.row_group(group).num_rows
        what = f"row group {group + 1} of {groups} (rows {row}-{row + rows - 1})"
        yield from _table_rows(parquet.iter_batches(batch_size=READ_BATCH, row_groups=[group]), path, label, "row", row, what)
        row += rows


def _read_arrow(path: Path, label: str) -> Iterator[Record | BadRecord]:
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_stream(source)  # what datasets.save_to_disk writes
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)
            reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"data.path {path}: not a readable Arrow file ({_first_line(error)}). Save the dataset again.") from None

    def batches():
        for batch in reader:
            for start in range(0, batch.num_rows, READ_BATCH):
                yield batch.slice(start, READ_BATCH)

    yield from _table_rows(batches(), path, label, "row", 1, "a record batch")


def _read_csv(path: Path, label: str, delimiter: str) -> Iterator[Record | BadRecord]:
    import csv

    import pyarrow as pa
    import pyarrow.csv as pacsv

    kind = "TSV" if delimiter == "\t" else "CSV"
    with open(path, encoding="utf-8-sig", errors="replace", newline="") as handle:
        header = next(csv.reader(handle, delimiter=delimiter), None)
    if not header or not any(name.strip() for name in header):
        return  # an empty file has no records; the caller says so
    bad: list[BadRecord] = []

    def skip_row(row) -> str:
        number = row.number if row.number is not None and row.number >= 0 else 0
        bad.append(BadRecord(number, f"expected {row.expected_columns} {kind} columns, found {row.actual_columns}", label))
        return "skip"

    try:
        reader = pacsv.open_csv(
            path,
            read_options=pacsv.ReadOptions(block_size=CSV_BLOCK_BYTES, use_threads=False),
            parse_options=pacsv.ParseOptions(delimiter=delimiter, newlines_in_values=True, invalid_row_handler=skip_row),
            # Every column as text, as the records of a JSON file would hold it: "42" stays an answer, not a number.
            convert_options=pacsv.ConvertOptions(column_types={name: pa.string() for name in header}, strings_can_be_null=False),
        )
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"data.path {path}: not a readable {kind} file ({_first_line(error)}). Fix the file.") from None
    # Records are numbered by their line, the header being line 1 (exact unless a quoted value
    # spans lines); a malformed row is named by the line pyarrow found it on.
    line = 2
    try:
        for batch in reader:
            yield from bad
            bad.clear()
            for value in batch.to_pylist():
                yield Record(value, line, label)
                line += 1
    except (pa.ArrowException, OSError) as error:
        raise DataError(
            f"data.path {path}: {kind} cannot be read after line {line - 1} ({_first_line(error)}). "
            "Fix the quoting there (a value with a delimiter or a line break needs double quotes)."
        ) from None
    yield from bad


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number", dict: "an object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
