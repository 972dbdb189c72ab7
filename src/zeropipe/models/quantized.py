"""A frozen base stored in 8-bit float (fp8 e4m3 / e5m2) with scales, computed in the training precision.

Why hand-written, and why this shape (issue 32's measurements, torch 2.13 / DeepSpeed 0.19.8):

- The stored weight is a ``uint8`` parameter holding the fp8 bytes (a byte view). gloo refuses
  ``float8_e4m3fn``/``float8_e5m2`` in ``all_gather`` and ``broadcast``, and ``zero.Init`` casts
  every floating-point parameter (fp8 included) to the training dtype; a uint8 parameter is
  neither cast by ``zero.Init`` nor by the engine (``CASTABLE_DTYPES``) and is partitioned,
  gathered and offloaded like any other tensor, one byte per weight. The same path runs on CPU
  ranks (gloo) and GPUs (NCCL), so what is trained and measured here is what runs there.
- The weight is dequantized inside a custom autograd function (as bitsandbytes' ``MatMul4Bit``):
  the full-precision copy lives only while the matmul runs, in forward and again in backward;
  autograd saves the byte parameter itself, never an upcast copy. diffusers' layerwise casting
  upcasts whole modules, keeps no scales and its upcast weights stay alive through autograd.
- torchao's float8 tensor subclasses need a CUDA GPU (its kernels are ``torch._scaled_mm``) and
  DeepSpeed does not partition tensor subclasses; bitsandbytes has no fp8 storage. Hence these
  few lines: a cast and a multiply.
- ``QuantizedLinear`` subclasses ``nn.Linear`` so that peft puts its LoRA ``Linear`` around it
  (peft moves adapters to the base weight's device and leaves a non-float dtype alone, as it
  does for bitsandbytes' int8 layers).

The scale is a float32 buffer with one value per output channel (``scale_weight``, ComfyUI's name
in its ``fp8_scaled`` files, where it is one value per tensor: then every channel holds it).
Buffers are whole on every rank under ZeRO-3 (4 bytes per output channel: 0.03% of a 5120-wide
layer's weight bytes).

A checkpoint in transformers' fine-grained FP8 layout (``quantization_config.quant_method: fp8``,
as Qwen3-*-FP8 and DeepSeek-V3 publish: e4m3 weights with a float32 ``weight_scale_inv`` per
block of e.g. 128x128) keeps its block scales: the buffer is then that 2-D grid and the layer's
``block_size`` says the block. Kept as stored rather than re-quantized to one scale per channel,
because re-quantizing rounds every weight a second time: measured on random-normal 4096x4096
weights in 128x128 blocks (torch 2.13, e4m3), the stored blocks dequantize exactly, and a
per-channel re-quantization of them is 2.6% RMS (relative) away from them, which takes the
error against the original weights from 2.6% to 3.7% (also with 1% of the columns 20x larger:
2.5%, 3.6%). ``tests/unit/models/test_prequantized_fp8.py`` holds a smaller case of it. The grid
costs 4 bytes per 128x128 block, less than the per-channel scale.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_FORMAT_OF_DTYPE = {dtype: name for name, dtype in FP8_DTYPES.items()}
SCALE_KEY = "scale_weight"  # ComfyUI's fp8_scaled name, so that such a file's keys load as they are
# Keys of ComfyUI fp8 files that carry no weight of the model: the marker of a scaled file and
# the activation scales its fp8 matmul kernels use (this layer computes in the training precision).
COMFY_EXTRA_KEYS = (r"(^|\.)scaled_fp8$", r"(^|\.)scale_input$")
# transformers' fine-grained FP8 layout: the weight's block scales (read with the weight) and a static
# activation scale its fp8 matmul kernels use (unused here, as ComfyUI's scale_input).
BLOCK_SCALE_KEY = "weight_scale_inv"
PREQUANTIZED_EXTRA_KEYS = (*COMFY_EXTRA_KEYS, rf"(^|\.){BLOCK_SCALE_KEY}$", r"(^|\.)activation_scale$")
# transformers' FineGrainedFP8Config default block (weight_block_size), used where a checkpoint does not say.
DEFAULT_WEIGHT_BLOCK = (128, 128)
# The linear layers stored quantized: those inside the repeated blocks, which hold nearly all the
# weights. Embedders, heads and norms stay in the training precision (as musubi-tuner and
# diffusion-pipe keep them), which also keeps code that reads an embedder's weight dtype right.
BLOCK_LINEAR = re.compile(r"(^|\.)(blocks|transformer_blocks|single_transformer_blocks|layers|h|block|visual_transformer_blocks|video_text_transformer_blocks|audio_text_transformer_blocks)\.\d+\.")


@dataclass(frozen=True)
class QuantizedStorage:
    """How the frozen base's linear layers are stored: ``format`` fp8 (e4m3) or fp8_e5m2, scales per ``scale`` (channel or tensor)."""

    format: str = "fp8"
    scale: str = "channel"

    @property
    def dtype(self) -> torch.dtype:
        return FP8_DTYPES[self.format]


def dequantize(
    weight_bytes: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, dtype: torch.dtype, block_size: tuple[int, int] | None = None
) -> torch.Tensor:
    """The weight in ``dtype``: fp8 values times their channel's (or block's) scale, one temporary weight in ``dtype`` and no more.

    fp8 values are exact in bf16, fp16 and fp32, so the cast loses nothing; the scale is rounded to
    ``dtype`` (bf16: 2^-9 relative, far below fp8's own 2^-4) and the product is computed in place,
    so the transient memory is one weight in the compute dtype, not a float32 copy beside it.
    ``block_size`` (rows, columns): ``scale`` is a grid of one value per block of the rows given
    (its rows already those of ``weight_bytes``' rows when ``block_size[0]`` is 1).
    """
    values = weight_bytes.view(fp8_dtype).to(dtype)
    if block_size is None:
        return values.mul_(scale.to(dtype).reshape(-1, *([1] * (values.dim() - 1))))
    return apply_block_scale(values, scale.to(dtype), block_size)


def apply_block_scale(values: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """Multiply a 2-D weight in place by its grid of block scales (transformers' ``_dequantize_fp8_weight`` does the same).

    The grid is expanded over rows only (rows x column blocks, 1/block_columns of the weight) and
    broadcast over each block's columns through a view, so no second weight-sized tensor is made.
    """
    rows, cols = values.shape
    block_rows, block_cols = block_size
    scale = scale.repeat_interleave(block_rows, dim=0)[:rows] if block_rows > 1 else scale[:rows]
    full, rest = divmod(cols, block_cols)
    values[:, : full * block_cols].unflatten(-1, (full, block_cols)).mul_(scale[:, :full, None])
    if rest:
        values[:, full * block_cols :].mul_(scale[:, full:])
    return values


def channel_absmax(rows: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of each row (float32)."""
    return rows.reshape(rows.shape[0], -1).abs().amax(dim=1).to(torch.float32) if rows.numel() else torch.zeros(rows.shape[0])


def scale_from_absmax(absmax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps each absmax onto the format's largest finite value (an all-zero row keeps scale 1)."""
    largest = torch.finfo(fp8_dtype).max
    return torch.where(absmax > 0, absmax / largest, torch.ones_like(absmax))


def quantize_rows(rows: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Rows of a weight as fp8 bytes (uint8), each row divided by its scale and rounded to nearest."""
    largest = torch.finfo(fp8_dtype).max
    values = rows.to(torch.float32) / scale.reshape(-1, *([1] * (rows.dim() - 1)))
    return values.clamp_(-largest, largest).to(fp8_dtype).view(torch.uint8)


def quantize(weight: torch.Tensor, storage: QuantizedStorage) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole weight as (fp8 bytes, per-channel float32 scale); per-tensor scale: every channel the same."""
    absmax = channel_absmax(weight)
    if storage.scale == "tensor":
        absmax = absmax.max().expand(absmax.shape).clone()
    scale = scale_from_absmax(absmax, storage.dtype)
    return quantize_rows(weight, scale, storage.dtype), scale


class DequantizedMatmul(torch.autograd.Function):
    """``x @ dequantize(weight).T + bias``, saving only the stored bytes for backward.

    The base is frozen: no gradient flows to the weight or its scale. Under ZeRO-3 the byte
    parameter is released after the forward pass and gathered again before this function's
    backward by DeepSpeed's module hooks, so the saved reference is valid when it is read.
    """

    @staticmethod
    def forward(ctx, x, weight_bytes, scale, bias, fp8_dtype, block_size=None):
        weight = dequantize(weight_bytes, scale, fp8_dtype, x.dtype, block_size)
        # Not save_for_backward: the parameter's storage is swapped by ZeRO-3 between the passes.
        ctx.weight_bytes, ctx.scale, ctx.fp8_dtype, ctx.block_size = weight_bytes, scale, fp8_dtype, block_size
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_output):
        grad_input = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = dequantize(ctx.weight_bytes, ctx.scale, ctx.fp8_dtype, grad_output.dtype, ctx.block_size)
            grad_input = grad_output @ weight
        if ctx.needs_input_grad[3]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, None, None, grad_bias, None, None


class QuantizedLinear(nn.Linear):
    """A frozen linear layer stored in fp8 bytes with per-channel scales (or a checkpoint's block scales), computed in the input's dtype."""

    block_size: tuple[int, int] | None = None  # set with a 2-D scale grid read from a fine-grained FP8 checkpoint

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, format: str = "fp8", device=None, dtype: torch.dtype | None = None
    ) -> None:
        # nn.Linear.__init__ would allocate (and, under zero.Init, partition) a float weight first.
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.format = in_features, out_features, format
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.uint8, device=device), requires_grad=False)
        self.register_buffer(SCALE_KEY, torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype or torch.get_default_dtype(), device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:  # a frozen base's weights come from its checkpoint
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DequantizedMatmul.apply(x, self.weight, getattr(self, SCALE_KEY), self.bias, FP8_DTYPES[self.format], self.block_size)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.weight, getattr(self, SCALE_KEY), FP8_DTYPES[self.format], dtype, self.block_size)

    def extra_repr(self) -> str:
        blocks = f", block_size={self.block_size}" if self.block_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, format={self.format}{blocks}"


def quantizable_linears(model: nn.Module, select: Callable[[str], bool] | None = None) -> list[str]:
    """Names of the plain ``nn.Linear`` layers to store quantized (by default those in the repeated blocks)."""
    select = select or (lambda name: bool(BLOCK_LINEAR.search(name)))
    return [name for name, module in model.named_modules() if type(module) is nn.Linear and select(name)]


def replace_linears(model: nn.Module, storage: QuantizedStorage, names: list[str]) -> None:
    """Swap each named ``nn.Linear`` for a ``QuantizedLinear`` on the same device (a meta skeleton's: meta), bias dtype kept."""
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, leaf)
        device = old.weight.device
        bias_dtype = old.bias.dtype if old.bias is not None else None
        setattr(parent, leaf, QuantizedLinear(old.in_features, old.out_features, old.bias is not None, format=storage.format, device=device, dtype=bias_dtype))


def quantize_model(model: nn.Module, storage: QuantizedStorage, select: Callable[[str], bool] | None = None) -> int:
    """Quantize a model held whole in memory (tests, an export's reference): returns the number of layers swapped."""
    names = quantizable_linears(model, select)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, leaf)
        new = QuantizedLinear(old.in_features, old.out_features, old.bias is not None, format=storage.format, device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            weight_bytes, scale = quantize(old.weight.detach(), storage)
            new.weight.copy_(weight_bytes)
            getattr(new, SCALE_KEY).copy_(scale)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        setattr(parent, leaf, new)
    return len(names)


def quantized_weight_names(model: nn.Module) -> list[str]:
    """State-dict keys of the stored (fp8 byte) weights and their scales: the frozen base a checkpoint need not hold."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            prefix = f"{name}." if name else ""
            names += [prefix + "weight", prefix + SCALE_KEY]
    return names


def dequantize_model(model: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Swap every ``QuantizedLinear`` back for an ``nn.Linear`` holding its dequantized weight (an export's base, read from an fp8 file)."""
    count = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, QuantizedLinear):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = nn.Linear(module.in_features, module.out_features, module.bias is not None, device=module.weight.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(module.dequantized_weight(dtype))
            if module.bias is not None:
                linear.bias.copy_(module.bias)
        setattr(parent, leaf, linear)
        count += 1
    return count
