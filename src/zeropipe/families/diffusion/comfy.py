"""The original (ComfyUI) LoRA key layout the entries export: ``diffusion_model.<original module>.lora_A.weight``,
``lora_B.weight`` and ``.alpha`` per adapted module, one helper instead of a copy per entry.

An entry's ``original_lora_layout`` names its modules as the original checkpoints do (``rename``: Wan's
and Cosmos' tables, checked against diffusers' converters) or keeps diffusers' names where they are the
original ones (Qwen-Image, Z-Image, Kandinsky 5, LTX-Video); layouts that fuse layers (FLUX.2, Chroma,
HunyuanVideo) or fold the strength differently build their keys on ``COMFY_PREFIX`` themselves.
"""

from __future__ import annotations

from typing import Callable

import torch

COMFY_PREFIX = "diffusion_model."


def comfy_lora_layout(layers: dict[str, torch.Tensor], alpha: float, rename: Callable[[str], str] | None = None, fold_alpha: bool = False) -> dict[str, torch.Tensor]:
    """A peft LoRA (``<module>.lora_A.weight`` / ``lora_B.weight``) under ``diffusion_model.`` with its modules' original names.

    ``fold_alpha``: the strength ``alpha / r`` is folded into ``lora_B`` and no ``.alpha`` keys are written
    (diffusion-pipe's LTX-Video layout); else each module gets an ``.alpha`` key.
    """
    out: dict[str, torch.Tensor] = {}
    for key, tensor in layers.items():
        module, _, part = key.partition(".lora_")
        original = rename(module) if rename is not None else module
        if fold_alpha and part.startswith("B"):
            tensor = tensor * (alpha / layers[f"{module}.lora_A.weight"].shape[0])
        out[f"{COMFY_PREFIX}{original}.lora_{part}"] = tensor.contiguous()
        if not fold_alpha:
            out[f"{COMFY_PREFIX}{original}.alpha"] = torch.tensor(float(alpha))
    return out
