"""Gradient checkpointing for every family, and activation offload (``train.activation_offload``).

Every family switches checkpointing on here (``enable_checkpointing``), so a causal LM, a
vision-language model and a diffusion denoiser checkpoint the same way: non-reentrant
``torch.utils.checkpoint`` around each block (a transformers ``GradientCheckpointingLayer``, a
diffusers transformer or UNet block), keyword arguments passed on.

With activation offload, each checkpointed block's inputs are copied to host memory (pinned on
GPU ranks) when the block's forward saves them, and copied back when backward recomputes the
block. Why this and not DeepSpeed's ``cpu_checkpointing``:

- torch's non-reentrant checkpoint saves the block's positional inputs through autograd's
  saved-tensor hooks *outside* its own recomputation hooks (``_CheckpointFrame.save_inputs``), so
  saved-tensor hooks entered around the ``checkpoint`` call see exactly the block inputs and
  nothing the block computes. That is what ``torch.autograd.graph.save_on_cpu`` does over a whole
  forward; scoped to the checkpoint call, it moves only the checkpointed inputs (transformers
  5's own ``activation_checkpointing_enable(offload=True)`` scopes it the same way).
- DeepSpeed's ``deepspeed.checkpointing.checkpoint`` is configured through module-global state
  (``deepspeed.checkpointing.configure``), takes positional arguments only (HunyuanImage's
  transformer passes ``attention_mask=``), and its reentrant form gives frozen-input blocks (LoRA)
  no gradient path; transformers and diffusers hand their blocks to a checkpoint *function* they
  accept as an argument, which the hooks below wrap without touching the models.

The hooks copy explicitly (``save_on_cpu`` with ``pin_memory=False`` hands a CPU tensor back
as it is): on CPU ranks a copy into fresh host memory is what exercises the round trip, and the
original is freed once nothing else holds it, so the memory the run holds is the same.
The bytes copied are counted (``OffloadCounter``): the planner's trace counts its host-RAM term
with the very same function (``plan.trace``), and the engine can report it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils.checkpoint


@dataclass
class OffloadCounter:
    """What activation offload moved: bytes and the size of each copy (reset by the caller when it likes)."""

    bytes: int = 0
    copies: int = 0
    blocks: int = 0  # checkpointed block calls whose inputs went through the hooks
    record_sizes: bool = False
    sizes: list[int] | None = None

    def add(self, size: int) -> None:
        self.bytes += size
        self.copies += 1
        if self.record_sizes:
            if self.sizes is None:
                self.sizes = []
            self.sizes.append(size)


class HostActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep each saved tensor in host memory and bring it back to its device on use.

    ``save_on_cpu(pin_memory=True)``'s pack and unpack, with an explicit copy on CPU ranks and a
    byte count. ``count_only`` keeps the tensor where it is and only counts it (the planner's trace
    on the meta device, where nothing can be copied).
    """

    def __init__(self, counter: OffloadCounter | None = None, count_only: bool = False) -> None:
        pin = torch.cuda.is_available()

        def pack(tensor: torch.Tensor) -> Any:
            if counter is not None:
                counter.add(tensor.numel() * tensor.element_size())
            if count_only:
                return tensor
            # Pinned memory lets the copies run asynchronously on the compute stream (stream-ordered, so
            # the GPU tensor is not reused before the copy has read it).
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin and not tensor.is_sparse)
            host.copy_(tensor, non_blocking=pin)
            return tensor.device, host

        def unpack(packed: Any) -> torch.Tensor:
            if count_only:
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin)

        super().__init__(pack, unpack)


def checkpoint_function(offload: bool = False, counter: OffloadCounter | None = None, count_only: bool = False) -> Callable[..., Any]:
    """The function transformers' and diffusers' blocks call to checkpoint themselves: ``fn(block_call, *args, **kwargs)``.

    diffusers 0.42's default takes positional arguments only, and HunyuanImage's transformer passes
    ``attention_mask=``: this one passes keywords on, so every denoiser checkpoints as diffusers' default does.
    """
    if not offload:
        return _checkpoint
    return functools.partial(_offloaded_checkpoint, counter=counter, count_only=count_only)


def _checkpoint(function, *args, **kwargs):
    # Non-reentrant: works with frozen inputs (LoRA, a frozen vision tower) and with ZeRO-3's parameter hooks.
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def _offloaded_checkpoint(function, *args, counter: OffloadCounter | None = None, count_only: bool = False, **kwargs):
    # The hooks are entered around the checkpoint call: inside it, checkpoint's own hooks take over (innermost wins),
    # so only the inputs it saves for the recomputation pass through these.
    if counter is not None:
        counter.blocks += 1
    with HostActivations(counter, count_only):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def enable_checkpointing(model: torch.nn.Module, offload: bool = False, counter: OffloadCounter | None = None) -> None:
    """Switch on gradient checkpointing (and, with ``offload``, activation offload) for a transformers or diffusers model.

    Raises:
        ValueError: the model has no checkpointed blocks, so activation offload would move nothing.
    """
    if offload and counter is None:
        counter = OffloadCounter()
    function = checkpoint_function(offload, counter)
    if hasattr(model, "gradient_checkpointing_enable"):
        # transformers: its own enable also makes the embeddings' output require grad where checkpointed
        # blocks need it (frozen embeddings under LoRA); then every checkpointed layer gets this function.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")]
        for layer in layers:
            layer._gradient_checkpointing_func = function
    else:
        # diffusers: enable_gradient_checkpointing takes the function itself.
        model.enable_gradient_checkpointing(gradient_checkpointing_func=function)
        layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    if offload and not layers:
        raise ValueError(f"{type(model).__name__} has no checkpointed blocks: train.activation_offload has nothing to move; set it to false")
    if offload:
        # Found again by offload_counter() after peft and DeepSpeed have wrapped the model.
        model._zeropipe_activation_offload = counter


def offload_counter(model: torch.nn.Module) -> OffloadCounter | None:
    """The byte count of a model whose checkpointed inputs are offloaded (``enable_checkpointing(offload=True)``), else None."""
    for module in model.modules():
        counter = module.__dict__.get("_zeropipe_activation_offload")
        if counter is not None:
            return counter
    return None
