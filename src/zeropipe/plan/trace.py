"""Count what a model saves for backward by running its forward pass on the meta device.

Used for models with no closed-form activation count (SDXL's UNet, Flux's transformer): the
forward runs on meta tensors (shapes only, no memory, about a second), and every tensor
autograd saves for backward is counted once, however many ops share it.

On the meta device PyTorch's scaled_dot_product_attention falls back to the math path, which
materialises the a·s² attention matrix that the fused CUDA kernels never store. Inside the
trace, a torch-function mode stands in for it with what flash/memory-efficient attention
actually saves: q, k, v, the output and an fp32 log-sum-exp. ``torch.autocast`` on the meta device,
which torch refuses, is a no-op inside the trace (``_MetaAutocast``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class ActivationTrace:
    """Bytes one sample's forward saves for backward, at one resolution (and, for video models, one clip length)."""

    resolution: int
    saved_bytes: int
    checkpointed_bytes: int
    largest_block_bytes: int  # what recomputing the largest checkpointed block holds
    forward_flops: int  # per sample, for the cost model
    precision: str = "bf16"
    frames: int = 1  # video models: the clip length traced (tokens = latent frames x latent height x width / patch volume)
    # Activation offload (train.activation_offload): the bytes of each tensor it copies to host RAM, one entry per copy;
    # what stays saved on the GPU outside the checkpointed blocks; and how many blocks are checkpointed. None/0: not traced.
    offloaded_sizes: tuple[int, ...] | None = None
    offload_resident_bytes: int | None = None
    checkpointed_blocks: int = 0
    # What the planner needs to scale the trace to another shape (plan.variants): the prompt tokens traced,
    # pixels per latent along a side, frames per latent frame (0: unknown).
    text_tokens: int = 0
    vae_factor: int = 0
    temporal_factor: int = 0


class _FusedAttention(torch.autograd.Function):
    """Shapes and saved tensors of a fused attention kernel, without computing anything."""

    @staticmethod
    def forward(ctx, query, key, value):
        out = query.new_empty(*query.shape[:-1], value.shape[-1])
        log_sum_exp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, log_sum_exp)
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace never runs backward
        raise RuntimeError("traced attention has no backward")


class _FusedAttentionMode(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            names = ("query", "key", "value")
            query, key, value = (args[i] if i < len(args) else kwargs[name] for i, name in enumerate(names))
            # QK^T and PV: 2 multiply-adds each over Lq x Lk x d.
            self.flops += 4 * query.shape[:-1].numel() * key.shape[-2] * query.shape[-1]
            return _FusedAttention.apply(query, key, value)
        return func(*args, **kwargs)


class _MetaAutocast:
    """``torch.autocast`` for the trace: a no-op for ``device_type="meta"``, torch's own for any other device.

    The trace runs on the meta device, where torch refuses autocast; a denoiser that switches autocast on or off for its
    tensors' device (Cosmos 3's transformer turns it off around its rotary position ids, ``torch.autocast(device_type=
    position_ids.device.type, enabled=False)``) would stop the trace there. Nothing in the trace runs under an autocast, so
    turning it off is already what the trace does: the no-op changes no shape or dtype that is counted.
    """

    real = torch.autocast

    def __new__(cls, device_type, *args, **kwargs):
        if device_type == "meta":
            return contextlib.nullcontext()
        return cls.real(device_type, *args, **kwargs)


@contextlib.contextmanager
def _autocast_on_meta():
    """While the trace runs, ``torch.autocast`` is :class:`_MetaAutocast`; what it was is put back after, also when the forward raises."""
    before = torch.autocast
    torch.autocast = _MetaAutocast
    try:
        yield
    finally:
        torch.autocast = before


def _innermost_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Members of ModuleLists that hold no ModuleList themselves: the units checkpointing wraps."""
    blocks = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for child in module:
                if not any(isinstance(m, torch.nn.ModuleList) for m in child.modules()):
                    blocks.append(child)
    return blocks


def count_saved(model: torch.nn.Module, run: Callable[[], Any], per_block: bool = False, count_flops: bool = True) -> tuple[int, int, int]:
    """(bytes saved for backward, bytes of the largest block, forward FLOPs) of ``run()``.

    Parameters are not activations and are left out; tensors are counted once per storage.
    ``count_flops=False`` skips torch's FLOP counter (most of a trace's time) and reports 0 FLOPs.
    """
    from torch.utils.flop_counter import FlopCounterMode

    parameters = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}
    block_bytes: dict[int, int] = {}
    current: list[int] = []
    keep_alive: list[torch.Tensor] = []  # ids stay unique only while the tensors live

    def pack(tensor: torch.Tensor):
        base = tensor._base if tensor._base is not None else tensor
        key = id(base)
        if key not in parameters and key not in saved:
            size = base.numel() * base.element_size()
            saved[key] = size
            keep_alive.append(base)
            if current:
                block_bytes[current[-1]] = block_bytes.get(current[-1], 0) + size
        return tensor

    handles = []
    if per_block:
        for block in _innermost_blocks(model):
            handles.append(block.register_forward_pre_hook(lambda m, a: current.append(id(m))))
            # A forward hook's return value replaces the output: this one must return None.
            handles.append(block.register_forward_hook(lambda m, a, o: current.pop() and None))
    attention = _FusedAttentionMode()
    flops = FlopCounterMode(display=False) if count_flops else contextlib.nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), flops, attention, _autocast_on_meta():
            run()
    finally:
        for handle in handles:
            handle.remove()
    total_flops = int(flops.get_total_flops()) + attention.flops if count_flops else 0
    return sum(saved.values()), max(block_bytes.values(), default=0), total_flops


def trace_diffusion(model: torch.nn.Module, make_inputs: Callable[[], dict[str, Any]], resolution: int, frames: int = 1) -> ActivationTrace:
    """Trace a diffusers model (built on meta, 16-bit) without and with gradient checkpointing."""
    model.train()
    with torch.device("meta"):
        inputs = make_inputs()
    saved, largest, flops = count_saved(model, lambda: model(**inputs), per_block=True)
    checkpointed = saved
    offload = {}
    if getattr(model, "_supports_gradient_checkpointing", False):
        from zeropipe.models.checkpointing import OffloadCounter, checkpoint_function

        # Training's own checkpoint function (keyword arguments passed on: HunyuanImage's transformer passes some).
        model.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint_function())
        try:
            checkpointed, _, _ = count_saved(model, lambda: model(**inputs), count_flops=False)  # the FLOPs are the first pass's
            # With activation offload (train.activation_offload): the same function training uses, counting what it would copy
            # to host RAM; what the outer hooks still see stays on the GPU (saved outside the checkpointed blocks).
            counter = OffloadCounter(record_sizes=True)
            model.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint_function(offload=True, counter=counter, count_only=True))
            resident, _, _ = count_saved(model, lambda: model(**inputs), count_flops=False)
            offload = {"offloaded_sizes": tuple(counter.sizes or ()), "offload_resident_bytes": resident, "checkpointed_blocks": counter.blocks}
        finally:
            model.disable_gradient_checkpointing()
    return ActivationTrace(resolution, saved, checkpointed, largest, flops, frames=frames, **offload)
