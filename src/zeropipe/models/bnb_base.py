"""A frozen base in bitsandbytes' 4-bit (nf4, fp4) or int8 layers, filled by the streaming loader (diffusion denoisers, ZeRO-0..2).

Why bitsandbytes' own layers: its CPU backend (0.47 and later) runs ``Linear4bit`` and
``Linear8bitLt`` forward and backward (the input's gradient, all LoRA needs) on CPU tensors as on
GPUs; measured with bitsandbytes 0.50.2 on a 256->512 layer: the nf4 layer's output is 8.9% (RMS,
relative) from the bf16 layer's, int8's 0.4%, and both give the input gradient. peft wraps them in
its own LoRA layers (``model.is_loaded_in_4bit`` / ``is_loaded_in_8bit`` tell it to).

Why these layers are filled here and not by diffusers' ``BitsAndBytesConfig`` loading: diffusers
0.42 refuses to quantize without a GPU ("No GPU found. A GPU is needed for quantization."), so CPU
ranks could not run it. Here each block linear's weight is read whole from the memory-mapped
checkpoint, one layer at a time, and bitsandbytes quantizes it when it is moved to the rank's device
(``Params4bit`` / ``Int8Params``): no rank holds a 16-bit copy of the model.

Why ZeRO-0..2 only: ``Params4bit`` keeps its quantization state (absmax, code map) and
``Int8Params`` its row scales (SCB) as attributes of the weight tensor; ``zero.Init`` partitions
and gathers the tensor's data alone, so a gathered weight would come back without them. Under
ZeRO-0..2 each rank holds the whole quantized base, as the issue allows; fp8 (``models.quantized``)
is the 8-bit base ZeRO-3 partitions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

BNB_FORMATS = ("nf4", "fp4", "int8")
QUANT_STATE_SUFFIXES = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".quant_state.")


@dataclass(frozen=True)
class BitsAndBytesStorage:
    """A base stored by bitsandbytes: ``format`` nf4 / fp4 (4-bit, ``double_quant``: quantized scales too) or int8."""

    format: str = "nf4"
    double_quant: bool = True


def bnb_linear(linear: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None, storage: BitsAndBytesStorage, compute_dtype: torch.dtype, device) -> nn.Module:
    """A bitsandbytes layer holding ``weight`` quantized on ``device`` (in/out features from ``linear``, a meta skeleton's layer)."""
    import bitsandbytes as bnb

    has_bias = bias is not None
    if storage.format == "int8":
        layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False, threshold=0.0, device="cpu")
        layer.weight = bnb.nn.Int8Params(weight.to(torch.float16 if compute_dtype == torch.float16 else torch.float32), requires_grad=False, has_fp16_weights=False)
    else:
        layer = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=has_bias, compute_dtype=compute_dtype, compress_statistics=storage.double_quant,
            quant_type=storage.format, quant_storage=torch.uint8, device="cpu",
        )
        # On a CPU with AVX512-BF16 bitsandbytes repacks the weight on the first forward pass in eval mode (samples):
        # the same kernels in train and eval mode on every CPU.
        layer.support_avx512bf16_for_cpu = False
        layer.weight = bnb.nn.Params4bit(weight.to(compute_dtype), requires_grad=False, compress_statistics=storage.double_quant, quant_type=storage.format)
    if has_bias:
        layer.bias = nn.Parameter(bias.to(compute_dtype), requires_grad=False)
    layer = layer.to(device)  # bitsandbytes quantizes here
    layer.register_load_state_dict_pre_hook(drop_quant_state)
    return layer


def drop_quant_state(module, state_dict, prefix, *args) -> None:
    """A resume rebuilds the quantized base from model.path: the constants bitsandbytes writes beside each weight have nothing to go into."""
    for key in [key for key in state_dict if key.startswith(prefix + "weight.") and any(suffix in key[len(prefix) + 6 :] for suffix in QUANT_STATE_SUFFIXES)]:
        del state_dict[key]
    state_dict.pop(prefix + "SCB", None)
    state_dict.pop(prefix + "weight_format", None)


def is_bnb_layer(module: nn.Module) -> bool:
    return type(module).__module__.startswith("bitsandbytes")


def bnb_state_keys(name: str) -> bool:
    """A checkpoint key holding a bitsandbytes layer's quantization state (not a weight of the model)."""
    return any(suffix in name for suffix in QUANT_STATE_SUFFIXES) or name.endswith((".SCB", ".weight_format"))
