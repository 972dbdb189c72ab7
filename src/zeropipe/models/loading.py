"""Pretrained weights loaded tensor by tensor, so that host RAM does not grow with the number of ranks.

(Over 600 lines: the four steps below are one path that every family's loading takes, and
each step's guarantees depend on the others'; the checkpoint index, step 1, is the part that
would stand alone.)

Five ranks each calling ``from_pretrained`` hold five copies of the model in host RAM before
DeepSpeed shards it, and the kernel kills rank 0 (USERS.md, failure 1). Here no rank ever
holds the whole model:

1. ``CheckpointIndex`` reads only the headers of the checkpoint (``model.safetensors``, or the
   shards named by ``model.safetensors.index.json``; ``pytorch_model.bin`` as a fallback): the
   name, dtype, shape and file of every tensor. It checks that no file is truncated and matches
   the tensors against the model's state dict before one byte of weights is read, and reports
   every problem (missing, unexpected, wrong shape) in one ``CheckpointError`` naming file and
   tensor. Every rank checks the same headers, so every rank fails the same way, before any
   collective call.
2. The model is constructed exactly as ``from_pretrained`` constructs it
   (``PreTrainedModel.get_init_context``): under ZeRO-3 inside ``deepspeed.zero.Init`` with
   weight initialisation disabled, so each parameter is partitioned as soon as its module
   exists and nothing is randomly initialised only to be overwritten; under ZeRO-0/1/2 on the
   meta device, so nothing is allocated.
3. Tensors are copied one at a time, in pieces of rows of at most ``READ_CHUNK_BYTES``, each
   under its own mapping of the memory-mapped file, so that the file pages a rank has mapped
   never exceed one piece. Under ZeRO-3 each rank reads only the rows that cover its own
   partition (``param.ds_tensor``) and no collective is needed; under ZeRO-0/1/2 each tensor is
   materialised straight on the rank's device. The copy converts dtypes element by element
   (bf16 on disk into an fp32 model, say), never as a whole-model copy. On a CPU device a
   tensor already in the right dtype is not copied at all: the parameter is a copy-on-write
   view of the mapped file, whose pages the ranks share (from_pretrained does the same).
4. The model is finished as ``from_pretrained`` finishes it: tied weights tied, the
   non-persistent buffers (rotary ``inv_freq``, embedding scales) recomputed by the model's own
   ``initialize_weights``, which skips every tensor that was loaded, and eval mode.

The steps are separate so that other families reuse them: a VLM is a transformers model and
goes through ``load_pretrained`` as it is; a diffusion model constructs itself under
``zero.Init`` or on the meta device, then calls ``CheckpointIndex(path, stem=...)``,
``CheckpointIndex.match`` and ``load_tensors``, and recomputes its own buffers.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import inspect
import json
import logging
import math
import re
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropipe.errors import CheckpointError
from zeropipe.models.bnb_base import BitsAndBytesStorage, bnb_linear
from zeropipe.models.quantized import (
    BLOCK_SCALE_KEY,
    DEFAULT_WEIGHT_BLOCK,
    FP8_DTYPES,
    FP8_FORMAT_OF_DTYPE,
    PREQUANTIZED_EXTRA_KEYS,
    SCALE_KEY,
    QuantizedLinear,
    QuantizedStorage,
    channel_absmax,
    dequantize,
    quantizable_linears,
    quantize_rows,
    replace_linears,
    scale_from_absmax,
)

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


# ---------------------------------------------------------------------- partitions
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


def _is_zero3_param(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id") and getattr(tensor, "ds_tensor", None) is not None


def _fill_partition(param: torch.Tensor, index: CheckpointIndex, name: str) -> int:
    """Copy this rank's part of tensor ``name`` into ``param.ds_tensor``; returns the bytes read."""
    import deepspeed.comm as dist

    if getattr(param, "ds_secondary_tensor", None) is not None or getattr(param.ds_tensor, "final_location", None) is not None:
        raise _StreamingUnsupported("hierarchical partitioning (hpZ) or NVMe parameter offload")
    partition = param.ds_tensor
    partition_numel = partition.ds_numel
    start, stop = partition_range(param.ds_numel, partition_numel, dist.get_rank(group=param.ds_process_group))
    with torch.no_grad():
        bytes_read = index.copy_elements(name, partition.narrow(0, 0, stop - start), start)
        if stop - start < partition_numel:
            # DeepSpeed's padding: never read, but gathers move it, so keep it finite.
            partition.narrow(0, stop - start, partition_numel - (stop - start)).zero_()
        if param.numel() == param.ds_numel:
            # A parameter left available (not partitioned) also holds the full data.
            bytes_read += index.copy_elements(name, param.data.view(-1))
    return bytes_read


def _owner(model: nn.Module, key: str) -> tuple[nn.Module, str]:
    module_name, _, leaf = key.rpartition(".")
    return model.get_submodule(module_name), leaf


def load_tensors(model: nn.Module, index: CheckpointIndex, sources: Mapping[str, str], *, device: torch.device | str) -> int:
    """Copy each tensor of the checkpoint into the model, one at a time; returns the bytes read by this rank.

    ``sources`` maps model state-dict keys to checkpoint names (``CheckpointIndex.match``).
    Each target is handled by what it is: a ZeRO-3 parameter gets this rank's partition only;
    a meta tensor is materialised on ``device`` with the checkpoint's values, converted to the
    model's dtype; any other tensor (a buffer under ZeRO-3) is overwritten in place. Every
    loaded tensor is flagged ``_is_hf_initialized`` so that transformers' weight
    initialisation leaves it alone.
    """
    bytes_read = 0
    order = sorted(sources.items(), key=lambda item: (str(index[item[1]].file), index[item[1]].offset, item[1]))
    for key, name in order:
        module, leaf = _owner(model, key)
        is_parameter = leaf in module._parameters
        current = module._parameters[leaf] if is_parameter else module._buffers[leaf]
        if _is_zero3_param(current):
            bytes_read += _fill_partition(current, index, name)
            loaded = current
        elif current.is_meta:
            if torch.device(device).type == "cpu" and index[name].dtype == current.dtype and index.format == "safetensors":
                # On CPU the mapped file is host memory already: every rank's parameter is a
                # copy-on-write view of the same page-cache pages (as from_pretrained's are),
                # counted once on the node until a rank writes it or DeepSpeed copies it.
                value = index.mapped(name)
                bytes_read += index[name].nbytes
            else:
                value = torch.empty(current.shape, dtype=current.dtype, device=device)
                bytes_read += index.copy_elements(name, value.view(-1))
            loaded = nn.Parameter(value, requires_grad=current.requires_grad) if is_parameter else value
            setattr(module, leaf, loaded)
        else:
            with torch.no_grad():
                if current.is_contiguous():
                    bytes_read += index.copy_elements(name, current.view(-1))
                else:
                    with index.read(name) as tensor:
                        current.copy_(tensor)
                    bytes_read += index[name].nbytes
            loaded = current
        loaded._is_hf_initialized = True
    index.close()
    return bytes_read


# ---------------------------------------------------------------------- quantized base
# How many bytes of a skeleton's parameters are materialised before zero.Init partitions them.
PARTITION_BATCH_BYTES = 64 * 2**20


def _quantized_skeleton(construct, index, path, rename, storage, select, zero_stage, ds_config, device, new_head: bool = False) -> tuple[nn.Module, dict[str, str]]:
    """The model as a skeleton with its block linears quantized, checked against the checkpoint; partitioned under ZeRO-3."""
    model = construct(on_meta=True)
    replace_linears(model, storage, quantizable_linears(model, select))
    sources = _plan(model, index, path, rename, new_head)
    if zero_stage == 3:
        _partition_skeleton(model, device, ds_config)
    return model, sources


def _load_bnb_base(construct, index, path, rename, storage: BitsAndBytesStorage, select, zero_stage: int, dtype: torch.dtype, device) -> tuple[nn.Module, int, int]:
    """A model whose block linears are bitsandbytes layers, each quantized from its checkpoint weight read whole, one layer at a time (ZeRO-0..2)."""
    if zero_stage == 3:
        raise ValueError(f"a {storage.format} (bitsandbytes) base is held whole by every rank: ZeRO-0..2 only (models.bnb_base says why)")
    model = construct(on_meta=True)
    names = quantizable_linears(model, select)
    sources = dict(_plan(model, index, path, rename))
    bytes_read = 0
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, leaf)
        tensors = {}
        for part in ("weight", "bias"):
            source = sources.pop(f"{name}.{part}", None)
            if source is not None:
                with index.read(source) as stored:
                    tensors[part] = stored.to(dtype, copy=True)
                bytes_read += index[source].nbytes
        setattr(parent, leaf, bnb_linear(old, tensors["weight"], tensors.get("bias"), storage, dtype, device))
    count = len(sources)
    bytes_read += load_tensors(model, index, sources, device=device)
    # peft wraps bitsandbytes layers in its own LoRA layers when the model says it holds them.
    model.is_loaded_in_4bit, model.is_loaded_in_8bit = storage.format != "int8", storage.format == "int8"
    return model, bytes_read, count + 2 * len(names)


def _partition_skeleton(model: nn.Module, device: torch.device, ds_config: dict | None) -> None:
    """Partition a meta skeleton's parameters with ``zero.Init(module=...)``, a batch of about PARTITION_BATCH_BYTES at a time.

    zero.Init's documented ``module`` argument partitions the parameters of an already built
    module as if it had been built inside the context; given a small holder of a few
    materialised parameters at a time, no rank holds more than one batch in full. Every rank
    walks the same parameters in the same order (each partitioning is a broadcast).
    """
    import deepspeed
    from transformers.integrations import deepspeed_config

    config = ds_config if ds_config is not None else deepspeed_config()
    batch: list[nn.Parameter] = []
    held = 0

    def flush() -> None:
        nonlocal batch, held
        if batch:
            holder = nn.ParameterList(batch)
            deepspeed.zero.Init(module=holder, config_dict_or_path=config, mem_efficient_linear=False)
        batch, held = [], 0

    made: dict[int, nn.Parameter] = {}  # a parameter shared by two modules (tied) is made once
    with _heap_returned(device.type == "cpu"):
        for module in model.modules():
            for leaf, param in list(module._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                if id(param) in made:
                    module._parameters[leaf] = made[id(param)]
                    continue
                real = made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad)
                module._parameters[leaf] = real
                batch.append(real)
                held += real.numel() * real.element_size()
                if held >= PARTITION_BATCH_BYTES:
                    flush()
        flush()


def _copy_rows(index: CheckpointIndex, name: str, destination: torch.Tensor, start: int, transform: Callable[[torch.Tensor, int], torch.Tensor]) -> int:
    """Copy elements ``start:`` of tensor ``name``, each chunk of whole rows passed through ``transform(rows, first_row)``; returns bytes read."""
    entry = index[name]
    count = destination.numel()
    if count == 0:
        return 0
    row_numel = math.prod(entry.shape[1:])
    first, last = covering_rows(start, start + count, row_numel)
    rows_per_chunk = max(1, READ_CHUNK_BYTES // max(1, row_numel * max(4, entry.dtype.itemsize)))
    bytes_read = 0
    for chunk_first in range(first, last, rows_per_chunk):
        chunk_last = min(chunk_first + rows_per_chunk, last)
        lo = max(start, chunk_first * row_numel)
        hi = min(start + count, chunk_last * row_numel)
        with index.read(name, chunk_first, chunk_last) as rows:
            values = transform(rows, chunk_first).reshape(-1)
            destination.narrow(0, lo - start, hi - lo).copy_(values.narrow(0, lo - chunk_first * row_numel, hi - lo))
        bytes_read += (chunk_last - chunk_first) * row_numel * entry.dtype.itemsize
    return bytes_read


def _row_absmax(index: CheckpointIndex, name: str, first: int, last: int, absmax: torch.Tensor) -> int:
    entry = index[name]
    row_bytes = max(1, math.prod(entry.shape[1:]) * max(4, entry.dtype.itemsize))
    step = max(1, READ_CHUNK_BYTES // row_bytes)
    for begin in range(first, last, step):
        end = min(begin + step, last)
        with index.read(name, begin, end) as rows:
            absmax[begin:end] = channel_absmax(rows)
    return (last - first) * math.prod(entry.shape[1:]) * entry.dtype.itemsize


def _destination(param: torch.Tensor, device) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Where this rank's elements of ``param`` go: (flat destination, first element, new full tensor or None)."""
    if _is_zero3_param(param):
        import deepspeed.comm as dist

        partition = param.ds_tensor
        start, stop = partition_range(param.ds_numel, partition.ds_numel, dist.get_rank(group=param.ds_process_group))
        if stop - start < partition.ds_numel:
            partition.narrow(0, stop - start, partition.ds_numel - (stop - start)).zero_()  # DeepSpeed's padding, gathered too
        return partition.narrow(0, 0, stop - start), start, None
    value = torch.empty(param.shape, dtype=param.dtype, device=device)
    return value.view(-1), 0, value


def _place(module: nn.Module, leaf: str, param: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
    if value is None:
        return param
    new = nn.Parameter(value, requires_grad=False)
    setattr(module, leaf, new)
    return new


def _checkpoint_scale(index: CheckpointIndex, name: str, weight_block: tuple[int, int] | None = None) -> tuple[torch.Tensor, tuple[int, int] | None, int]:
    """The scale an fp8 checkpoint stores beside weight ``name``: (per-channel scale or block grid, block size or None, bytes read).

    ComfyUI's ``scale_weight`` is one value per tensor or per channel (ones where the file stores
    none: its plain fp8); transformers' fine-grained ``weight_scale_inv`` is a grid of one value per
    block of ``weight_block`` (config.json's ``weight_block_size``; 128x128 where it says none).
    """
    shape = index[name].shape
    channels = shape[0]
    stem = name[: -len("weight")] if name.endswith("weight") else None
    scale_name = next((stem + key for key in (SCALE_KEY, BLOCK_SCALE_KEY) if stem is not None and stem + key in index), None)
    if scale_name is None:
        return torch.ones(channels), None, 0
    entry = index[scale_name]
    with index.read(scale_name) as stored:
        scale = stored.to(torch.float32).clone()
    if scale.dim() == 2 and scale.numel() > 1 and len(shape) == 2:
        block = tuple(weight_block or DEFAULT_WEIGHT_BLOCK)
        grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
        if tuple(scale.shape) != grid:
            raise CheckpointError(
                f"{scale_name} in {index.where(scale_name)} is a {tuple(scale.shape)} grid of block scales, but weight {name} {tuple(shape)} "
                f"in blocks of {block} needs {grid}: set quantization_config.weight_block_size in config.json to the block the file was written with"
            )
        return scale, block, entry.nbytes
    scale = scale.reshape(-1)
    if scale.numel() not in (1, channels):
        raise CheckpointError(f"{scale_name} in {index.where(scale_name)} holds {scale.numel()} scales for {channels} output channels: expected 1 or {channels}")
    return scale.expand(channels).clone(), None, entry.nbytes


def _rows_of_scale(scale: torch.Tensor, block: tuple[int, int] | None, first: int, count: int) -> torch.Tensor:
    """The scales of rows ``first:first+count``: per channel, or their rows of a block grid (one row per weight row)."""
    if block is None:
        return scale[first : first + count]
    return scale[first // block[0] : (first + count - 1) // block[0] + 1].repeat_interleave(block[0], dim=0)[first % block[0] :][:count]


def _fill_quantized(module: QuantizedLinear, index: CheckpointIndex, name: str, storage: QuantizedStorage, device, weight_block: tuple[int, int] | None = None) -> int:
    """This rank's rows of a quantized layer: fp8 bytes copied from an fp8 checkpoint (with its scales or block scales), or quantized from a full-precision one."""
    entry = index[name]
    param = module.weight
    destination, start, value = _destination(param, device)
    channels = entry.shape[0]
    block = None
    if entry.dtype in FP8_FORMAT_OF_DTYPE:
        stored_format = FP8_FORMAT_OF_DTYPE[entry.dtype]
        if stored_format != storage.format:
            raise CheckpointError(
                f"tensor {name} in {index.where(name)} is stored as {stored_format}, but model.quantization is {storage.format}: "
                f"set model.quantization: {stored_format} to train on the file as it is stored"
            )
        bytes_read = index.copy_elements(name, destination.view(entry.dtype), start)
        scale, block, scale_bytes = _checkpoint_scale(index, name, weight_block)
        bytes_read += scale_bytes
    else:
        # Each rank reads only the rows covering its partition: the scales of the rows it does not
        # hold come from the ranks that do (a max over ranks, where a row is split between two).
        absmax = torch.zeros(channels)
        row_numel = math.prod(entry.shape[1:])
        first, last = covering_rows(start, start + destination.numel(), row_numel) if destination.numel() else (0, 0)
        bytes_read = _row_absmax(index, name, first, last, absmax)
        if _is_zero3_param(param):
            import deepspeed.comm as dist

            dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=param.ds_process_group)
        if storage.scale == "tensor":
            absmax.fill_(float(absmax.max()))
        scale = scale_from_absmax(absmax, storage.dtype)
        bytes_read += _copy_rows(index, name, destination, start, lambda rows, row: quantize_rows(rows, scale[row : row + rows.shape[0]], storage.dtype))
    loaded = _place(module, "weight", param, value)
    module._buffers[SCALE_KEY] = scale.to(device)
    module.block_size = block
    loaded._is_hf_initialized = True
    return bytes_read


def _fill_dequantized(module: nn.Module, leaf: str, index: CheckpointIndex, name: str, device, weight_block: tuple[int, int] | None = None) -> int:
    """A layer kept in the training precision whose checkpoint tensor is fp8 (a ComfyUI file quantizes more than the blocks, an FP8 VLM its vision tower): fp8 times its scale."""
    entry = index[name]
    param = getattr(module, leaf)
    destination, start, value = _destination(param, device)
    scale, block, bytes_read = _checkpoint_scale(index, name, weight_block)
    columns = None if block is None else (1, block[1])  # the chunk's own rows of the grid: one per weight row

    def upcast(rows: torch.Tensor, row: int) -> torch.Tensor:
        return dequantize(rows.contiguous().view(torch.uint8), _rows_of_scale(scale, block, row, rows.shape[0]), entry.dtype, param.dtype, columns)

    with torch.no_grad():
        bytes_read += _copy_rows(index, name, destination, start, upcast)
    _place(module, leaf, param, value)._is_hf_initialized = True
    return bytes_read


def load_quantized_tensors(
    model: nn.Module, index: CheckpointIndex, sources: Mapping[str, str], storage: QuantizedStorage, *, device, weight_block: tuple[int, int] | None = None
) -> int:
    """``load_tensors`` for a model with quantized layers: their weights quantized (or copied) row by row, fp8 tensors of other layers upcast.

    ``weight_block``: the block of a fine-grained FP8 checkpoint's ``weight_scale_inv`` grids (config.json's weight_block_size).
    """
    bytes_read = 0
    rest = {}
    with torch.no_grad():
        for key, name in sorted(sources.items(), key=lambda item: (str(index[item[1]].file), index[item[1]].offset, item[1])):
            module, leaf = _owner(model, key)
            if isinstance(module, QuantizedLinear) and leaf == "weight":
                bytes_read += _fill_quantized(module, index, name, storage, device, weight_block)
            elif index[name].dtype in FP8_FORMAT_OF_DTYPE and index[name].shape:
                bytes_read += _fill_dequantized(module, leaf, index, name, device, weight_block)
            else:
                rest[key] = name
    return bytes_read + load_tensors(model, index, rest, device=device)


# ---------------------------------------------------------------------- transformers
class _StreamingUnsupported(Exception):
    """This checkpoint or setup needs transformers' own loading path; the message says why."""


def _signature_kwargs(function: Callable, **candidates: Any) -> dict[str, Any]:
    accepted = inspect.signature(function).parameters
    return {key: value for key, value in candidates.items() if key in accepted}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _zero3_visible(zero_stage: int, ds_config: dict | None) -> Iterator[None]:
    """Make transformers see the ZeRO-3 config while the model is constructed (or check it does not)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    enabled = is_deepspeed_zero3_enabled()
    if zero_stage == 3 and not enabled:
        if ds_config is None:
            raise ValueError("zero_stage=3 needs ds_config, or an HfDeepSpeedConfig kept alive by the caller (as the Trainer does)")
        from transformers.integrations import HfDeepSpeedConfig

        # Alive only while the model is constructed: keep your own HfDeepSpeedConfig for the
        # run when other transformers code (generate under ZeRO-3) must know about ZeRO-3.
        alive = HfDeepSpeedConfig(ds_config)  # noqa: F841 - transformers holds a weak reference to it
        yield
        return
    if zero_stage != 3 and enabled:
        raise ValueError(f"an HfDeepSpeedConfig for ZeRO-3 is alive but zero_stage={zero_stage}: the model would be partitioned")
    yield


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl...)
        return None


@contextlib.contextmanager
def _heap_returned(enabled: bool) -> Iterator[None]:
    """Return freed heap memory to the system before each new parameter while the model is constructed.

    zero.Init gives every new parameter a full-size buffer, broadcasts it and keeps only this
    rank's partition. On CPU ranks glibc serves those buffers from the heap once its dynamic
    mmap threshold has grown, and the holes they leave between the partitions are not given
    back: they added about 0.3x the checkpoint on 4 ranks (benchmarks/init_ram.py). Trimming
    before each parameter is allocated keeps only the one being built. With GPUs the buffers
    are GPU memory and this is off.
    """
    trim = _glibc_malloc_trim() if enabled else None
    if trim is None:
        yield
        return
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def before_next_parameter(module: nn.Module, name: str, param: Any) -> None:
        trim(0)

    handle = register_module_parameter_registration_hook(before_next_parameter)
    try:
        yield
    finally:
        handle.remove()
        trim(0)


def _construct(model_cls: type, config: Any, dtype: torch.dtype, *, on_meta: bool = False) -> nn.Module:
    """The model with no weights loaded, constructed with the contexts from_pretrained uses.

    ``on_meta`` builds it on the meta device even under ZeRO-3 (without ``zero.Init``): a
    skeleton whose keys and shapes are checked against the checkpoint before the partitioned
    construction, which takes collectives and time, starts.
    """
    context_kwargs = _signature_kwargs(
        model_cls.get_init_context, dtype=dtype, is_quantized=False, _is_ds_init_called=False, allow_all_kernels=False
    )
    contexts = list(model_cls.get_init_context(**context_kwargs))
    if on_meta:
        import deepspeed

        contexts = [c for c in contexts if not isinstance(c, (deepspeed.zero.Init, torch.device))] + [torch.device("meta")]
    with contextlib.ExitStack() as stack:
        if "dtype" not in context_kwargs:  # transformers 4.x sets the dtype outside get_init_context
            stack.enter_context(_default_dtype(dtype))
        for context in contexts:
            stack.enter_context(context)
        model = model_cls(config)
    try:
        from transformers.monkey_patching import patch_output_recorders
    except ImportError:
        pass
    else:
        patch_output_recorders(model)
    return model


def _construct_from_factory(
    factory: Callable[[], nn.Module], dtype: torch.dtype, zero_stage: int, ds_config: dict | None, *, on_meta: bool = False
) -> nn.Module:
    """A model from any factory: partitioned under zero.Init for ZeRO-3, else on the meta device."""
    with _default_dtype(dtype):
        if zero_stage == 3 and not on_meta:
            import deepspeed
            from transformers.integrations import deepspeed_config

            with deepspeed.zero.Init(config_dict_or_path=ds_config if ds_config is not None else deepspeed_config()):
                return factory()
        # Parameters on the meta device, buffers where they are computed (as diffusers'
        # from_pretrained builds its models): a buffer the model computes in __init__ and does
        # not save (Wan's rotary frequencies) keeps its values; the checkpoint fills the rest.
        # A skeleton (on_meta) is built the same way: a quantized base keeps it as the model.
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            return factory()


def _plan(model: nn.Module, index: CheckpointIndex, path: Path, rename: Callable[[str], str] | None = None, new_head: bool = False) -> dict[str, str]:
    """Model key -> checkpoint tensor for every tensor to load, or a CheckpointError listing every mismatch."""
    expected = _state_dict_shapes(model)
    tied = _tied_keys(model)
    ignore_missing, ignore_unexpected = _ignored_patterns(model)
    if new_head and getattr(model, "base_model_prefix", ""):
        # The head is every tensor outside the base model: the model's own one is initialised when the
        # checkpoint lacks it, the checkpoint's other one (a causal LM's lm_head) is left unread, as
        # from_pretrained does when it loads a causal LM as a sequence classifier.
        outside = rf"^(?!{re.escape(model.base_model_prefix)}\.)"
        ignore_missing, ignore_unexpected = [*ignore_missing, outside], [*ignore_unexpected, outside]
    quantized = any(isinstance(module, QuantizedLinear) for module in model.modules())
    if quantized:
        # A quantized layer's scale is computed from a full-precision checkpoint, or read beside
        # its weight from an fp8_scaled one (found by the weight's name, in any layout).
        expected = {key: shape for key, shape in expected.items() if not key.endswith("." + SCALE_KEY)}
        ignore_unexpected = [*ignore_unexpected, rf"(^|\.){SCALE_KEY}$", *PREQUANTIZED_EXTRA_KEYS]
    else:
        scaled = [name for name in index if name.rsplit(".", 1)[-1] in (SCALE_KEY, "scaled_fp8", BLOCK_SCALE_KEY)]
        if scaled:
            kind = "a fine-grained FP8 checkpoint" if scaled[0].endswith(BLOCK_SCALE_KEY) else "an fp8_scaled checkpoint"
            raise CheckpointError(
                f"{path} is {kind} ({scaled[0]}: its fp8 weights are stored divided by a scale): "
                "set model.quantization: fp8 to train on it as it is stored (fp8_e5m2 for an e5m2 file), or use a bf16/fp16 checkpoint"
            )
    sources = index.match(
        expected,
        model_name=type(model).__name__,
        rename=rename or _checkpoint_renamer(model, expected),
        tied=tied,
        ignore_missing=ignore_missing,
        ignore_unexpected=ignore_unexpected,
    )
    for target, source in tied.items():
        if target in sources and source in sources:
            # .bin checkpoints hold both tied tensors; from_pretrained ties them only when equal.
            if not index.equal(sources[target], sources[source]):
                raise CheckpointError(
                    f"config.json ties {target} to {source}, but {sources[target]} and {sources[source]} in {path} differ: "
                    "set tie_word_embeddings: false in config.json, or remove the extra tensor from the checkpoint"
                )
            del sources[target]
    return sources


def fine_grained_fp8_block(config: Any) -> tuple[int, int] | None:
    """The weight block of a transformers fine-grained FP8 checkpoint (config.json's quantization_config, quant_method fp8), else None."""
    quant = getattr(config, "quantization_config", None) if config is not None else None
    if quant is None:
        return None
    fields = quant if isinstance(quant, dict) else quant.to_dict()
    if fields.get("quant_method") != "fp8" or not fields.get("weight_block_size"):
        return None
    return tuple(int(size) for size in fields["weight_block_size"])


def _is_model_class(candidate: Any) -> bool:
    """A transformers model class or Auto class (anything else callable is a factory)."""
    return isinstance(candidate, type) and (hasattr(candidate, "get_init_context") or hasattr(candidate, "_model_mapping"))


def _resolve_class(model_cls_or_factory: Any, config: Any) -> type:
    """A concrete PreTrainedModel class: Auto classes resolve through their public mapping."""
    from transformers import PreTrainedModel

    if isinstance(model_cls_or_factory, type) and issubclass(model_cls_or_factory, PreTrainedModel):
        return model_cls_or_factory
    mapping = getattr(model_cls_or_factory, "_model_mapping", None)
    if mapping is not None:
        if getattr(config, "auto_map", None) and type(config) not in mapping:
            raise _StreamingUnsupported("remote-code architectures (config.json auto_map)")
        try:
            return mapping[type(config)]
        except KeyError:
            raise ValueError(f"{model_cls_or_factory.__name__} has no model for {type(config).__name__}") from None
    raise TypeError(f"load_pretrained needs a transformers model class or Auto class, not {model_cls_or_factory!r}")


def _checkpoint_renamer(model: nn.Module, expected: Mapping[str, Any]) -> Callable[[str], str]:
    """Checkpoint name -> model key, with the renames from_pretrained applies (base-model prefix, legacy names)."""
    if not hasattr(model, "base_model_prefix"):  # not a transformers model: names are the state-dict keys
        return lambda name: name
    prefix = model.base_model_prefix or ""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4.x: only the base-model prefix is renamed
        def rename(name: str) -> str:
            if name in expected or not prefix:
                return name
            if name.startswith(prefix + ".") and name[len(prefix) + 1 :] in expected:
                return name[len(prefix) + 1 :]
            return f"{prefix}.{name}" if f"{prefix}.{name}" in expected else name

        return rename

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if converters:
        # Fused or split tensors (MoE experts...) are built from several checkpoint tensors.
        first = converters[0]
        raise _StreamingUnsupported(f"weight conversions of {type(model).__name__} ({first.source_patterns} -> {first.target_patterns})")
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    present = dict.fromkeys(expected, True)
    return lambda name: rename_source_key(name, renamings, [], base_model_prefix=prefix or None, meta_state_dict=present)[0]


def _ignored_patterns(model: nn.Module) -> tuple[list[str], list[str]]:
    """Keys from_pretrained accepts missing / ignores when unexpected, for this model."""
    missing = list(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    unexpected = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    buffers = [name for name, _ in model.named_buffers()]
    # Old checkpoints saved these buffers, which are now non-persistent (from_pretrained does the same).
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        unexpected.append(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        unexpected.append(r"(^|\.)position_ids$")
    return missing, unexpected


def _tied_keys(model: nn.Module) -> dict[str, str]:
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is not None:
        return dict(tied)
    if not hasattr(model, "get_output_embeddings"):  # not a transformers model
        return {}
    # transformers 4.x: only input/output embeddings are tied.
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(config, "tie_word_embeddings", False) or model.get_output_embeddings() is None:
        return {}
    names = {id(module): name for name, module in model.named_modules()}
    return {f"{names[id(model.get_output_embeddings())]}.weight": f"{names[id(model.get_input_embeddings())]}.weight"}


def _state_dict_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(getattr(tensor, "ds_shape", tensor.shape)) for key, tensor in model.state_dict(keep_vars=True).items()}


def _finish(model: nn.Module, path: Path, device: torch.device | str) -> None:
    """Tie weights, recompute non-persistent buffers and initialise ignorable missing weights, as from_pretrained does."""
    if not hasattr(model, "initialize_weights"):
        # Not a transformers model: nothing recomputes what construction on the meta device lost.
        lost = [key for key, tensor in list(model.named_parameters()) + list(model.named_buffers()) if tensor.is_meta]
        if lost:
            raise ValueError(
                f"{type(model).__name__} has tensors the checkpoint does not hold and the meta device left empty: "
                f"{', '.join(lost[:5])}; build this model with transformers, or load it with zero_stage=3"
            )
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != torch.device(device):
                    module._buffers[name] = buffer.to(device)
        model.eval()
        return
    if "recompute_mapping" in inspect.signature(model.tie_weights).parameters:
        model.tie_weights(recompute_mapping=False)
    else:
        model.tie_weights()
    for key, tensor in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if tensor is not None and tensor.is_meta:
            # A buffer the model computes (inv_freq) or a weight the model may miss: given a
            # place here, given its values by initialize_weights below.
            module, leaf = _owner(model, key)
            value = torch.empty_like(tensor, device=device)
            setattr(module, leaf, nn.Parameter(value, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else value)
    uninitialised = [p for p in model.parameters() if not getattr(p, "_is_hf_initialized", False)]
    if uninitialised and any(_is_zero3_param(p) for p in uninitialised):
        import deepspeed

        # Rank 0 initialises the full weights the checkpoint may lack; the others receive them.
        with deepspeed.zero.GatheredParameters(uninitialised, modifier_rank=0):
            model.initialize_weights()
    elif hasattr(model, "initialize_weights"):
        # Skips every loaded tensor (flagged _is_hf_initialized): this recomputes the
        # non-persistent buffers from the config exactly as from_pretrained does.
        model.initialize_weights()
    model.config.name_or_path = str(path)
    if hasattr(model, "can_generate") and model.can_generate() and (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(path))
    model.eval()


def default_device() -> torch.device:
    """The rank's accelerator (the one DeepSpeed will train on), or the CPU."""
    if "deepspeed" in sys.modules:
        from deepspeed.accelerator import get_accelerator

        return torch.device(get_accelerator().current_device_name())
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_pretrained(
    model_cls_or_factory: Any,
    path: str | Path,
    *,
    dtype: torch.dtype,
    zero_stage: int,
    ds_config: dict | None = None,
    config: Any = None,
    attn_implementation: str | None = None,
    device: torch.device | str | None = None,
    stem: str = "model",
    rename: Callable[[str], str] | None = None,
    quantize: QuantizedStorage | BitsAndBytesStorage | None = None,
    quantize_select: Callable[[str], bool] | None = None,
    new_head: bool = False,
) -> nn.Module:
    """A model with the weights of a local checkpoint, loaded without a whole-model copy in host RAM.

    Args:
        model_cls_or_factory: a PreTrainedModel class or an Auto class (``AutoModelForCausalLM``):
            constructed as from_pretrained constructs it, from ``config``. Or a function that
            builds any ``nn.Module`` in the current dtype (a diffusers UNet from its config,
            say): called under ``zero.Init`` (stage 3), or with its parameters on the meta device
            and its buffers computed (accelerate's init_empty_weights, as diffusers does); its
            parameters must all be in the checkpoint unless it is a transformers model.
        path: local Hugging Face model directory (config.json + safetensors).
        dtype: dtype of the model's parameters; the checkpoint's are converted tensor by tensor.
        zero_stage: 3 constructs the model partitioned under ``deepspeed.zero.Init`` and fills
            each rank's partitions; 0-2 materialise every tensor on ``device``.
        ds_config: the DeepSpeed config, needed for stage 3 unless the caller keeps an
            ``HfDeepSpeedConfig`` alive (then that one is used).
        config: the transformers config (read from ``path`` when not given).
        attn_implementation: attention kernel set on the config ("sdpa", "eager").
        device: where stage 0-2 parameters are materialised; the rank's accelerator by default.
        stem: file name of the weights without extension (diffusers: "diffusion_pytorch_model").
        rename: checkpoint tensor name -> model key, for checkpoints in another layout (a
            single-file original checkpoint, renamed with diffusers' converter); the tensors
            are still read one by one, each rank only its partitions under ZeRO-3.
        quantize: store the linear layers of the repeated blocks (``quantize_select`` picks
            others) in fp8 (``models.quantized``): the model is built as a meta skeleton, those
            layers are swapped for ``QuantizedLinear``, and each rank quantizes its own rows
            while streaming them from a bf16/fp16/fp32 checkpoint, or copies the bytes and
            ``scale_weight`` keys of an fp8 (ComfyUI ``fp8_scaled``) one. Under ZeRO-3 the
            skeleton is partitioned a few modules at a time (``zero.Init(module=...)``), so no
            rank ever holds a full-precision copy of the model, nor its own partitions of one.
        new_head: the model's head (its tensors outside ``base_model_prefix``) is not the
            checkpoint's: a causal LM's checkpoint loaded as a reward model's sequence classifier.
            The head the checkpoint lacks is initialised, the one it has that the model lacks
            (``lm_head``) is not read; every base-model tensor must still match.
            A ``BitsAndBytesStorage`` (nf4, fp4, int8; ZeRO-0..2) swaps those layers for
            bitsandbytes' instead, each quantized from its weight read whole (``models.bnb_base``).

    Returns:
        The model in eval mode, as ``from_pretrained`` returns it, with the same values.

    Raises:
        CheckpointError: missing, unexpected or wrong-shaped tensors, truncated or damaged
            files, each named with file and tensor, raised before any weight is read.
    """
    path = Path(path)
    started = time.perf_counter()
    if _is_model_class(model_cls_or_factory):
        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(path))
        config = copy.deepcopy(config)
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        if hasattr(config, "dtype"):
            config.dtype = dtype
    device = torch.device(device) if device is not None else default_device()
    index = CheckpointIndex(path, stem=stem)  # a damaged checkpoint fails here, before the model is built
    try:
        if _is_model_class(model_cls_or_factory):
            model_cls = _resolve_class(model_cls_or_factory, config)

            def construct(on_meta: bool = False) -> nn.Module:
                return _construct(model_cls, config, dtype, on_meta=on_meta)
        else:

            def construct(on_meta: bool = False) -> nn.Module:
                return _construct_from_factory(model_cls_or_factory, dtype, zero_stage, ds_config, on_meta=on_meta)

        if isinstance(quantize, BitsAndBytesStorage):
            model, bytes_read, count = _load_bnb_base(construct, index, path, rename, quantize, quantize_select, zero_stage, dtype, device)
            _finish(model, path, device)
            log.info("loaded %d tensors from %s in %.1fs, linear layers of the blocks stored as %s (bitsandbytes); this rank read %.1f MB",
                     count, path, time.perf_counter() - started, quantize.format, bytes_read / 1e6)
            return model
        if quantize is not None:
            with _zero3_visible(zero_stage, ds_config):
                model, sources = _quantized_skeleton(construct, index, path, rename, quantize, quantize_select, zero_stage, ds_config, device, new_head)
            bytes_read = load_quantized_tensors(model, index, sources, quantize, device=device, weight_block=fine_grained_fp8_block(config))
            _finish(model, path, device)
            log.info("loaded %d tensors from %s in %.1fs, linear layers of the blocks stored as %s; this rank read %.1f MB",
                     len(sources), path, time.perf_counter() - started, quantize.format, bytes_read / 1e6)
            return model
        with _zero3_visible(zero_stage, ds_config):
            if zero_stage == 3:
                # Checked on a meta skeleton first: a mismatch fails in seconds, not after zero.Init.
                sources = _plan(construct(on_meta=True), index, path, rename, new_head)
            with _heap_returned(zero_stage == 3 and device.type == "cpu"):
                model = construct()
        log.debug("constructed %s (%s)", type(model).__name__, "partitioned by zero.Init" if zero_stage == 3 else "on the meta device")
        if zero_stage != 3:
            sources = _plan(model, index, path, rename, new_head)
        bytes_read = load_tensors(model, index, sources, device=device)
    except _StreamingUnsupported as reason:
        if not _is_model_class(model_cls_or_factory):
            raise ValueError(f"{path}: {reason} cannot be loaded tensor by tensor") from None
        if quantize is not None:
            # from_pretrained would load it in 16 bits: never a silent change of the storage asked for.
            raise CheckpointError(
                f"{path}: {reason} cannot be loaded tensor by tensor, which the {quantize.format} base needs (each rank quantizes its own rows): "
                "remove model.quantization to train LoRA on the 16-bit base"
            ) from None
        log.warning("%s: %s cannot be loaded tensor by tensor; using transformers' from_pretrained (higher host RAM peak)", path, reason)
        with _zero3_visible(zero_stage, ds_config):
            return model_cls_or_factory.from_pretrained(str(path), config=config, dtype=dtype)
    _finish(model, path, device)
    log.info(
        "loaded %d tensors (%.1f MB on disk) from %s in %.1fs; this rank read or mapped %.1f MB%s",
        len(sources), index.total_bytes / 1e6, path, time.perf_counter() - started, bytes_read / 1e6,
        " (its ZeRO-3 partitions)" if zero_stage == 3 else "",
    )
    return model
