"""The adapter kinds ``model.lora.kind`` names, as peft builds them: LoRA, DoRA, LoKr and LoHa.

One place turns the config's ``model.lora`` section into peft's config object, for every family
(causal LMs and VLMs through ``get_peft_model``, diffusers denoisers through ``add_adapter``), and
counts an adapted layer's weights for the planner by letting peft build the adapter on the meta
device, so the planner's figure is peft's own (LoKr's Kronecker factors depend on how peft
factorises each dimension).

- ``lora``: ``LoraConfig``; ``dora``: the same with ``use_dora=True`` (a magnitude vector per output
  feature on top of LoRA's A and B);
- ``lokr``: ``LoKrConfig`` (LyCORIS's Kronecker product: ``lokr_w1`` and ``lokr_w2``, decomposed to
  rank ``r`` where the factor is large, ``model.lora.factor`` as ``decompose_factor``);
- ``loha``: ``LoHaConfig`` (LyCORIS's Hadamard product of two low-rank products).

peft's LoKr and LoHa have no dropout on the adapter's input: ``model.lora.dropout`` is LoRA's and
DoRA's; the config refuses a dropout set for the other two (``config.schema.LoraSection``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

ADAPTER_NAMES = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "loha": "LoHa"}


def adapter_name(lora: Any) -> str:
    """The adapter's name for people: LoRA, DoRA, LoKr or LoHa."""
    return ADAPTER_NAMES[getattr(lora, "kind", "lora")]


def peft_adapter_config(lora: Any, target_modules: Any, task_type: str | None = None, gaussian_init: bool = False, target_parameters: list[str] | None = None):
    """peft's config of the adapter ``model.lora`` describes, on ``target_modules``.

    Args:
        target_parameters: parameters (not modules) to adapt as well: the experts' 3-D weights of an MoE model.
        gaussian_init: LoRA/DoRA's A drawn from a Gaussian (diffusers' training scripts), not Kaiming-uniform.
            LoKr and LoHa keep peft's own initialisation (one factor zero: the adapter starts as no change).
    """
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    kind = getattr(lora, "kind", "lora")
    extra = {"task_type": task_type} if task_type else {}
    if kind in ("lora", "dora"):
        init = {"init_lora_weights": "gaussian"} if gaussian_init else {}
        if target_parameters:
            extra["target_parameters"] = target_parameters  # a mixture of experts' 3-D expert weights (models.moe)
        return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=target_modules, use_dora=kind == "dora", **init, **extra)
    if kind == "lokr":
        return LoKrConfig(r=lora.r, alpha=lora.alpha, target_modules=target_modules, decompose_factor=lora.factor, **extra)
    if kind == "loha":
        return LoHaConfig(r=lora.r, alpha=lora.alpha, target_modules=target_modules, **extra)
    raise ValueError(f"unknown adapter kind {kind!r}: use one of {', '.join(ADAPTER_NAMES)}")


def adapter_parameter_sizes(lora: Any, in_features: int, out_features: int) -> list[int]:
    """The sizes of the adapter tensors peft adds to one ``Linear(in_features, out_features)``."""
    return list(_sizes(getattr(lora, "kind", "lora"), lora.r, float(lora.alpha), int(getattr(lora, "factor", -1)), in_features, out_features))


@lru_cache(maxsize=4096)
def _sizes(kind: str, r: int, alpha: float, factor: int, in_features: int, out_features: int) -> tuple[int, ...]:
    if kind == "lora":  # r x in (A) and out x r (B); arithmetic, as peft builds them
        return (r * in_features, out_features * r)
    import torch
    from peft import inject_adapter_in_model

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(in_features, out_features, bias=False)

    section = type("Section", (), {"kind": kind, "r": r, "alpha": alpha, "dropout": 0.0, "factor": factor})()
    with torch.device("meta"):
        model = One()
        inject_adapter_in_model(peft_adapter_config(section, ["layer"]), model)
    return tuple(parameter.numel() for name, parameter in model.named_parameters() if name != "layer.base_layer.weight" and name != "layer.weight")


# The names peft gives each kind's weights: LoRA/DoRA's lora_A, lora_B, lora_magnitude_vector; LoKr's lokr_w1...; LoHa's hada_w1_a...
ADAPTER_PARAMETER_MARKERS = ("lora_", "lokr_", "hada_")


def is_adapter_parameter(name: str) -> bool:
    """Whether a parameter name is an adapter's weight (any kind), not the base model's."""
    return any(marker in name for marker in ADAPTER_PARAMETER_MARKERS)
