"""Step 1 of loading pretrained weights (``models.loading``): the checkpoint's index, read from its headers only.

``CheckpointIndex`` holds the name, dtype, shape, file and offset of every tensor of a local
checkpoint, checks that no file is truncated, matches the tensors against a model's state dict
(every problem in one ``CheckpointError``) and copies a tensor's rows in pieces of at most
``READ_CHUNK_BYTES``. ``partition_range`` and ``covering_rows`` are the element and row
arithmetic of a ZeRO-3 partition that the copies use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.errors import CheckpointError

log = logging.getLogger("zeropipe")


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# safetensors itself refuses larger headers; a bigger length means the file is not safetensors.
MAX_HEADER_BYTES = 100_000_000
# Tensors are copied in pieces of about this many bytes, each under its own mapping of the
# file, so the file pages a rank has mapped at any moment stay below it.
READ_CHUNK_BYTES = 16 * 2**20
# How many problems a CheckpointError lists before it summarises the rest.
LISTED_PROBLEMS = 12


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: where it is and what it holds (no data)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0  # byte offset of the data in the file (safetensors), for reading in file order

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class CheckpointIndex:
    """Where each tensor of a local Hugging Face checkpoint lives: name -> (file, dtype, shape).

    Only headers are read. ``path`` is a directory holding ``{stem}.safetensors`` or a sharded
    ``{stem}.safetensors.index.json`` (or, as a fallback, ``pytorch_model.bin`` /
    ``pytorch_model.bin.index.json``; ``{stem}.bin`` for other stems, as diffusers names them),
    or one ``.safetensors`` / ``.bin`` file.

    Raises:
        CheckpointError: no weights found, an index naming a missing shard or a tensor its shard
            lacks, an unreadable header, or a truncated file (naming the tensors past its end).
    """

    def __init__(self, path: str | Path, stem: str = "model"):
        self.path = Path(path)
        self.format, self.index_file, files, weight_map = self._locate(stem)
        self.entries: dict[str, TensorEntry] = {}
        self._bin_cache: tuple[Path, dict[str, torch.Tensor]] | None = None
        self._mapped_files: dict[Path, Any] = {}
        problems: list[str] = []
        for file in files:
            try:
                entries = self._read_safetensors_header(file) if self.format == "safetensors" else self._read_bin_entries(file)
            except CheckpointError as err:
                problems.append(str(err))
                continue
            for entry in entries:
                if entry.name in self.entries:
                    problems.append(f"tensor {entry.name} is in both {self.entries[entry.name].file.name} and {file.name}")
                self.entries[entry.name] = entry
        if weight_map is not None and not problems:
            for name, shard in weight_map.items():
                entry = self.entries.get(name)
                if entry is None:
                    problems.append(f"{self.index_file.name} puts tensor {name} in {shard}, but {shard} does not contain it")
                elif entry.file.name != Path(shard).name:
                    problems.append(f"{self.index_file.name} puts tensor {name} in {shard}, but it is in {entry.file.name}")
        if problems:
            raise CheckpointError(self._problems_message(f"checkpoint {self.path} is damaged", problems, "copy the checkpoint again from its source"))

    # ------------------------------------------------------------------ finding files
    def _locate(self, stem: str) -> tuple[str, Path | None, list[Path], dict[str, str] | None]:
        path = self.path
        if path.is_file():
            if path.suffix == ".safetensors":
                return "safetensors", None, [path], None
            if path.suffix in (".bin", ".pt", ".pth"):
                return "bin", None, [path], None
            raise CheckpointError(f"{path} is neither a .safetensors nor a .bin file: point model.path at the model directory")
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist: model.path must be a local Hugging Face model directory")
        bin_stem = "pytorch_model" if stem == "model" else stem
        candidates = [
            ("safetensors", path / f"{stem}.safetensors.index.json", True),
            ("safetensors", path / f"{stem}.safetensors", False),
            ("bin", path / f"{bin_stem}.bin.index.json", True),
            ("bin", path / f"{bin_stem}.bin", False),
        ]
        for fmt, candidate, is_index in candidates:
            if not candidate.is_file():
                continue
            if fmt == "bin":
                log.warning("%s has no safetensors weights: reading %s (convert to safetensors to load with less memory)", path, candidate.name)
            if not is_index:
                return fmt, None, [candidate], None
            weight_map = self._read_index(candidate)
            shards = sorted(set(weight_map.values()))
            missing = [shard for shard in shards if not (path / shard).is_file()]
            if missing:
                listed = []
                for shard in missing:
                    held = _first(sorted(name for name, where in weight_map.items() if where == shard), 3)
                    listed.append(f"shard {shard} is missing (it should hold {', '.join(held)})")
                fix = "copy the missing shard files next to the index"
                raise CheckpointError(self._problems_message(f"checkpoint {path} is incomplete", listed, fix))
            return fmt, candidate, [path / shard for shard in shards], weight_map
        names = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
        raise CheckpointError(
            f"no weights in {path}: expected {stem}.safetensors, {stem}.safetensors.index.json or {bin_stem}.bin (the directory holds {names})"
        )

    @staticmethod
    def _read_index(file: Path) -> dict[str, str]:
        try:
            weight_map = json.loads(file.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{file} is not a valid checkpoint index (a JSON object with a weight_map): {err}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{file} has an empty or invalid weight_map")
        return weight_map

    @staticmethod
    def _read_safetensors_header(file: Path) -> list[TensorEntry]:
        """The tensors of one safetensors file, after checking that the file holds all their bytes."""
        size = file.stat().st_size
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{file.name} is truncated: {size} bytes, too short for a safetensors header")
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes > MAX_HEADER_BYTES:
                raise CheckpointError(f"{file.name} is not a safetensors file (its header length reads as {header_bytes} bytes)")
            if 8 + header_bytes > size:
                raise CheckpointError(f"{file.name} is truncated: {size:,} bytes, but its header alone needs {8 + header_bytes:,}")
            try:
                header = json.loads(handle.read(header_bytes))
            except ValueError as err:
                raise CheckpointError(f"{file.name} has an unreadable safetensors header: {err}") from None
        data_start = 8 + header_bytes
        entries, past_end, problems = [], [], []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
            if dtype is None:
                problems.append(f"tensor {name} in {file.name} has dtype {info.get('dtype')!r}, which this loader does not read")
                continue
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(v) for v in info["data_offsets"])
            entry = TensorEntry(name, file, dtype, shape, data_start + begin)
            if end - begin != entry.nbytes:
                problems.append(
                    f"tensor {name} in {file.name} has {end - begin} bytes of data for shape {list(shape)} {info['dtype']} ({entry.nbytes} expected)"
                )
            if data_start + end > size:
                past_end.append((begin, name))
            entries.append(entry)
        if past_end:
            names = [name for _, name in sorted(past_end)]
            needed = data_start + max(int(info["data_offsets"][1]) for key, info in header.items() if key != "__metadata__")
            more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
            problems.insert(
                0, f"{file.name} is truncated: {size:,} of {needed:,} bytes; tensor {', '.join(names[:3])}{more} lies past the end of the file"
            )
        if problems:
            raise CheckpointError("; ".join(problems))
        return entries

    def _read_bin_entries(self, file: Path) -> list[TensorEntry]:
        state = self._bin_state(file)
        return [TensorEntry(name, file, tensor.dtype, tuple(tensor.shape)) for name, tensor in state.items() if isinstance(tensor, torch.Tensor)]

    def _bin_state(self, file: Path) -> dict[str, torch.Tensor]:
        """A .bin file memory-mapped by torch.load; one file at a time stays open."""
        if self._bin_cache is not None and self._bin_cache[0] == file:
            return self._bin_cache[1]
        self._bin_cache = None  # drop the previous file's mapping before opening the next
        try:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # noqa: BLE001 - torch raises many types for a damaged zip
            raise CheckpointError(f"{file.name} cannot be read as a PyTorch checkpoint ({type(err).__name__}: {err}); it may be truncated") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{file.name} does not hold a state dict")
        self._bin_cache = (file, state)
        return state

    # ------------------------------------------------------------------ contents
    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> TensorEntry:
        return self.entries[name]

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    @property
    def files(self) -> list[Path]:
        return sorted({entry.file for entry in self.entries.values()})

    @property
    def total_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())

    def where(self, name: str) -> str:
        return self.entries[name].file.name

    def _problems_message(self, title: str, problems: list[str], fix: str) -> str:
        shown = problems[:LISTED_PROBLEMS]
        lines = [f"{title} ({len(problems)} problem(s)):"] + [f"  - {p}" for p in shown]
        if len(problems) > len(shown):
            lines.append(f"  - ... and {len(problems) - len(shown)} more")
        lines.append(f"Fix: {fix}.")
        return "\n".join(lines)

    # ------------------------------------------------------------------ matching
    def match(
        self,
        expected: Mapping[str, tuple[int, ...]],
        *,
        model_name: str = "the model",
        rename: Callable[[str], str] | None = None,
        tied: Mapping[str, str] | None = None,
        ignore_missing: Iterable[str] = (),
        ignore_unexpected: Iterable[str] = (),
    ) -> dict[str, str]:
        """Match the checkpoint against the model's state dict, before any data is read.

        Args:
            expected: model state-dict key -> shape the model expects.
            rename: checkpoint name -> model key (architecture renames, base-model prefix).
            tied: tied target -> source (``lm_head.weight -> model.embed_tokens.weight``). A
                target needs no tensor when its source has one; a source without a tensor takes
                its target's (the tensor is the same once tied).
            ignore_missing / ignore_unexpected: regular expressions of keys the model accepts
                missing (it initialises them) or ignores in checkpoints (old rotary buffers).

        Returns:
            model key -> checkpoint tensor name, for every key to load. Tied targets whose
            source is loaded are left out (they are tied afterwards), except when the checkpoint
            also holds the target: then both are returned, for the caller to compare.

        Raises:
            CheckpointError: every missing, unexpected and wrong-shaped tensor, each named with
                its file, in one message.
        """
        rename = rename or (lambda name: name)
        tied = dict(tied or {})
        skip_missing = _compile(ignore_missing)
        skip_unexpected = _compile(ignore_unexpected)
        sources: dict[str, str] = {}
        problems: list[str] = []
        unexpected: list[str] = []
        for name in self.entries:
            key = rename(name)
            if key not in expected:
                if not (skip_unexpected and skip_unexpected.search(key)):
                    unexpected.append(f"unexpected tensor {name} in {self.where(name)}: {model_name} has no {key}")
                continue
            if key in sources:
                problems.append(f"tensors {sources[key]} and {name} both load into {key}")
                continue
            sources[key] = name
        for target, source in tied.items():
            if source not in sources and target in sources:
                sources[source] = sources.pop(target)
            elif target in sources and source in sources:
                continue  # both present: the caller compares them before tying
            sources.pop(target, None)
        missing = []
        for key, shape in expected.items():
            name = sources.get(key)
            if name is None:
                if key in tied and tied[key] in sources:
                    continue
                if skip_missing and skip_missing.search(key):
                    continue
                missing.append(f"missing tensor {key}: {self._not_found_in()}")
                continue
            found = self.entries[name].shape
            if tuple(found) != tuple(shape):
                problems.append(f"tensor {name} in {self.where(name)} has shape {list(found)}, {model_name} expects {list(shape)} for {key}")
        problems = missing + unexpected + problems
        if problems:
            raise CheckpointError(
                self._problems_message(
                    f"checkpoint {self.path} does not match {model_name}",
                    problems,
                    "model.path must be the directory the weights were saved in with their own config.json; "
                    "a config.json from another model size or version gives shape mismatches",
                )
            )
        return sources

    def _not_found_in(self) -> str:
        if self.index_file is not None:
            return f"not in {self.index_file.name} nor in any of its {len(self.files)} shard(s)"
        return f"not in {', '.join(f.name for f in self.files)}"

    # ------------------------------------------------------------------ reading
    @contextlib.contextmanager
    def read(self, name: str, start_row: int | None = None, stop_row: int | None = None) -> Iterator[torch.Tensor]:
        """Yield tensor ``name`` (rows ``start_row:stop_row`` of its first dimension when given).

        The tensor is a view into the memory-mapped file, valid only inside the ``with``
        block: the file is unmapped when it ends, and the pages the copy touched leave the
        process's memory with it. Copy what you need inside the block.
        """
        entry = self.entries[name]
        sliced = start_row is not None and len(entry.shape) > 0
        if self.format == "safetensors":
            from safetensors import safe_open

            with safe_open(str(entry.file), framework="pt") as handle:
                yield handle.get_slice(name)[start_row:stop_row] if sliced else handle.get_tensor(name)
        else:
            tensor = self._bin_state(entry.file)[name]
            yield tensor[start_row:stop_row] if sliced else tensor

    def copy_elements(self, name: str, destination: torch.Tensor, start: int = 0, chunk_bytes: int = READ_CHUNK_BYTES) -> int:
        """Copy elements ``start:start + destination.numel()`` of flattened tensor ``name`` into ``destination``.

        ``destination`` is a 1-D tensor of any dtype and device (the copy converts). The rows
        that cover the range are read a chunk at a time, each chunk under its own mapping of
        the file, so the memory this takes beyond ``destination`` is one chunk. Returns the
        bytes read from the checkpoint.
        """
        entry = self.entries[name]
        count = destination.numel()
        if count == 0:
            return 0
        if not entry.shape:
            with self.read(name) as tensor:
                destination.copy_(tensor.reshape(-1))
            return entry.nbytes
        row_numel = math.prod(entry.shape[1:])
        first, last = covering_rows(start, start + count, row_numel)
        rows_per_chunk = max(1, chunk_bytes // max(1, row_numel * entry.dtype.itemsize))
        bytes_read = 0
        for chunk_first in range(first, last, rows_per_chunk):
            chunk_last = min(chunk_first + rows_per_chunk, last)
            lo = max(start, chunk_first * row_numel)
            hi = min(start + count, chunk_last * row_numel)
            with self.read(name, chunk_first, chunk_last) as rows:
                destination.narrow(0, lo - start, hi - lo).copy_(rows.reshape(-1).narrow(0, lo - chunk_first * row_numel, hi - lo))
            bytes_read += (chunk_last - chunk_first) * row_numel * entry.dtype.itemsize
        return bytes_read

    def mapped(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a copy-on-write view of the memory-mapped safetensors file (no copy).

        The view keeps the file mapped for as long as it lives; one mapping per file is shared
        by all the views taken before ``close``.
        """
        from safetensors import safe_open

        entry = self.entries[name]
        handle = self._mapped_files.get(entry.file)
        if handle is None:
            handle = self._mapped_files[entry.file] = safe_open(str(entry.file), framework="pt")
        return handle.get_tensor(name)

    def close(self) -> None:
        """Forget open files; tensors from ``mapped`` stay valid (they hold their mapping)."""
        self._bin_cache = None
        self._mapped_files.clear()

    def equal(self, first: str, second: str, rows_per_chunk: int = 1024) -> bool:
        """Whether two tensors of the checkpoint hold the same values, compared a chunk of rows at a time."""
        a, b = self.entries[first], self.entries[second]
        if a.shape != b.shape:
            return False
        rows = a.shape[0] if a.shape else 1
        for start in range(0, rows, rows_per_chunk):
            stop = min(start + rows_per_chunk, rows)
            with self.read(first, start, stop) as x, self.read(second, start, stop) as y:
                if not torch.equal(x, y.to(x.dtype)):
                    return False
        return True


def _first(items: list[str], count: int) -> list[str]:
    return items[:count] + ([f"... {len(items) - count} more"] if len(items) > count else [])


def _compile(patterns: Iterable[str]) -> re.Pattern | None:
    patterns = [p for p in patterns if p]
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def partition_range(numel: int, partition_numel: int, partition_rank: int) -> tuple[int, int]:
    """The [start, stop) elements of a flattened parameter that a ZeRO-3 partition holds.

    DeepSpeed pads a parameter of ``numel`` elements to a multiple of the partition count and
    gives rank r the elements ``[r * partition_numel, (r + 1) * partition_numel)`` of the padded
    tensor (``_partition_param`` in deepspeed/runtime/zero/partition_parameters.py); the last
    ranks may hold only padding, so ``stop`` is clipped to ``numel`` (``stop == start``: nothing).
    """
    start = partition_numel * partition_rank
    return start, max(start, min(start + partition_numel, numel))


def covering_rows(start: int, stop: int, row_numel: int) -> tuple[int, int]:
    """The rows [first, last) of a tensor whose rows hold ``row_numel`` elements that cover elements [start, stop)."""
    return start // row_numel, -(-stop // row_numel)
