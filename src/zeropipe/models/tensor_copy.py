"""Step 3 of loading pretrained weights (``models.loading``): tensors copied from the checkpoint into a constructed model.

``load_tensors`` copies each tensor (under ZeRO-3 only the rows covering this rank's partition),
``load_quantized_tensors`` quantizes (or copies) the weights of quantized layers row by row and
upcasts the fp8 tensors of the others. ``StreamingUnsupported`` says a setup needs transformers'
own loading path.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import torch
from torch import nn

from zeropipe.errors import CheckpointError
from zeropipe.models.checkpoint_index import READ_CHUNK_BYTES, CheckpointIndex, covering_rows, partition_range
from zeropipe.models.quantized import (
    BLOCK_SCALE_KEY,
    DEFAULT_WEIGHT_BLOCK,
    FP8_FORMAT_OF_DTYPE,
    SCALE_KEY,
    QuantizedLinear,
    QuantizedStorage,
    channel_absmax,
    dequantize,
    quantize_rows,
    scale_from_absmax,
)

log = logging.getLogger("zeropipe")


class StreamingUnsupported(Exception):
    """This checkpoint or setup needs transformers' own loading path; the message says why."""


def is_zero3_param(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id") and getattr(tensor, "ds_tensor", None) is not None


def _fill_partition(param: torch.Tensor, index: CheckpointIndex, name: str) -> int:
    """Copy this rank's part of tensor ``name`` into ``param.ds_tensor``; returns the bytes read."""
    import deepspeed.comm as dist

    if getattr(param, "ds_secondary_tensor", None) is not None or getattr(param.ds_tensor, "final_location", None) is not None:
        raise StreamingUnsupported("hierarchical partitioning (hpZ) or NVMe parameter offload")
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


def owner_of(model: nn.Module, key: str) -> tuple[nn.Module, str]:
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
        module, leaf = owner_of(model, key)
        is_parameter = leaf in module._parameters
        current = module._parameters[leaf] if is_parameter else module._buffers[leaf]
        if is_zero3_param(current):
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
    if is_zero3_param(param):
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
        if is_zero3_param(param):
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
            module, leaf = owner_of(model, key)
            if isinstance(module, QuantizedLinear) and leaf == "weight":
                bytes_read += _fill_quantized(module, index, name, storage, device, weight_block)
            elif index[name].dtype in FP8_FORMAT_OF_DTYPE and index[name].shape:
                bytes_read += _fill_dequantized(module, leaf, index, name, device, weight_block)
            else:
                rest[key] = name
    return bytes_read + load_tensors(model, index, rest, device=device)
