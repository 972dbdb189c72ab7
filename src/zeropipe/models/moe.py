"""Mixture-of-experts causal LMs (Qwen3-MoE, gpt-oss, Mixtral, OLMoE...): what training one needs beyond a dense model.

Found from the model's own classes, never from a list per model:

- **The sparse MoE blocks**: the module that owns a router and its experts. transformers marks its
  routers itself (``_can_record_outputs["router_logits"]``, the class whose output the model records
  for the auxiliary loss); the block is the router's parent. A model without that marker is read by
  shape: a module with an ``experts`` child and a ``gate`` or ``router`` child.
- **ZeRO-3 leaves**: each block is registered with DeepSpeed (``deepspeed.utils.set_z3_leaf_modules``),
  so ZeRO-3 gathers a whole block (router and every expert) at once, by one hook, whatever the
  router chose. Without it, experts kept as separate modules (a ``ModuleList`` per expert, as
  transformers 4 and remote-code models keep them) are fetched in the order each rank's tokens
  reach them, which differs between ranks: ZeRO-3's prefetch then stalls or hangs. transformers 5
  stores a block's experts as 3-D tensors of one module, which is fetched whole anyway; the leaf
  still makes the block one fetch instead of two and keeps the older layouts safe.
- **The router's auxiliary loss**, as the model defines it: ``output_router_logits`` on and the
  model's own ``router_aux_loss_coef`` (or ``model.router_aux_loss_coef``) in the loss its forward
  returns; the loss and its auxiliary part (and a z-loss where a model has one) are logged.
- **The experts' kernel**: transformers' grouped matmul (``experts_implementation: grouped_mm``) where
  torch has it, else its batched or per-expert loop (``model.experts_implementation``).
- **LoRA on experts**: peft's ``target_parameters`` on the experts' 3-D weights (``model.lora.target_parameters:
  experts``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger("zeropipe")

# How the configs of transformers' MoE models name the number of experts and the experts a token goes to.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
ACTIVE_EXPERT_KEYS = ("num_experts_per_tok", "top_k", "moe_topk", "num_experts_per_token")
ROUTER_CHILD_NAMES = ("gate", "router")


@dataclass(frozen=True)
class MoeShape:
    """How many experts a config has and how many each token goes to."""

    experts: int
    active: int
    router_aux_loss_coef: float | None


def moe_shape(hf_config: Any) -> MoeShape | None:
    """The config's experts, or None for a dense model."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    experts = next((getattr(text, key) for key in EXPERT_COUNT_KEYS if isinstance(getattr(text, key, None), int)), 0)
    if experts <= 1:
        return None
    active = next((getattr(text, key) for key in ACTIVE_EXPERT_KEYS if isinstance(getattr(text, key, None), int)), 1)
    coef = getattr(text, "router_aux_loss_coef", None)
    return MoeShape(experts, active, float(coef) if coef is not None else None)


def configure_moe(hf_config: Any, router_aux_loss_coef: float | None, experts_implementation: str) -> list[str]:
    """Set the training options of an MoE config in place; returns what was set, for the run's notes.

    ``router_aux_loss_coef``: the user's coefficient (``model.router_aux_loss_coef``), or None for the
    model's own. The auxiliary loss is on whenever the coefficient is above zero (ms-swift's and
    LLaMA-Factory's rule): a router trained without it collapses onto a few experts.
    """
    shape = moe_shape(hf_config)
    if shape is None:
        return []
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    notes = [f"mixture of experts: {shape.experts} experts, {shape.active} per token"]
    coef = router_aux_loss_coef if router_aux_loss_coef is not None else shape.router_aux_loss_coef
    if coef is not None and hasattr(text, "output_router_logits"):
        text.router_aux_loss_coef = coef
        text.output_router_logits = coef > 0
        whose = "model.router_aux_loss_coef" if router_aux_loss_coef is not None else "the model's config"
        notes.append(f"router auxiliary loss x {coef:g} added to the loss ({whose})" if coef > 0 else "router auxiliary loss off (coefficient 0)")
    if experts_implementation != "auto":
        hf_config._experts_implementation = experts_implementation
        notes.append(f"experts computed with transformers' {experts_implementation} kernel (model.experts_implementation)")
    return notes


def router_classes(model: nn.Module) -> set[type]:
    """The router classes transformers records ``router_logits`` from (the model's own marker)."""
    classes: set[type] = set()
    for module in model.modules():
        recorders = getattr(type(module), "_can_record_outputs", None) or {}
        recorder = recorders.get("router_logits") if isinstance(recorders, dict) else None
        target = getattr(recorder, "target_class", recorder)
        if isinstance(target, type):
            classes.add(target)
    return classes


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every sparse MoE block: the parent of a router the model marks, or a module with experts and a gate/router child."""
    routers = tuple(router_classes(model))
    blocks = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if "experts" not in children:
            continue
        marked = bool(routers) and any(isinstance(child, routers) for child in children.values())
        shaped = any(child in children for child in ROUTER_CHILD_NAMES)
        if marked or shaped:
            blocks.append((name, module))
    return blocks


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each block's experts."""
    return [(f"{name}.experts" if name else "experts", block.experts) for name, block in moe_blocks(model)]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The experts' weight names for peft's ``target_parameters``: each experts module's 3-D weights, as ``experts.<weight>``.

    peft matches a ``target_parameters`` entry against the end of ``module.parameter``; the 3-D
    tensors (experts x in x out) are the projections, the 2-D ones their biases (gpt-oss).
    """
    names: set[str] = set()
    for _, experts in expert_modules(model):
        for name, param in experts.named_parameters(recurse=False):
            shape = getattr(param, "ds_shape", param.shape)
            if len(shape) == 3:
                names.add(f"experts.{name}")
    return sorted(names)


def mark_zero3_leaves(model: nn.Module) -> list[str]:
    """Register the model's sparse MoE blocks as ZeRO-3 leaf modules; returns their class names (empty for a dense model).

    Must run before ``deepspeed.initialize``: the engine installs its fetch hooks then.
    """
    blocks = moe_blocks(model)
    if not blocks:
        return []
    from deepspeed.utils import set_z3_leaf_modules

    classes = sorted({type(block) for _, block in blocks}, key=lambda cls: cls.__name__)
    set_z3_leaf_modules(model, classes)
    return [cls.__name__ for cls in classes]


def router_figures(output: Any) -> dict[str, torch.Tensor]:
    """The router's losses a forward returned (detached): ``aux_loss``, and ``z_loss`` where the model has one."""
    figures = {}
    for key, name in (("aux_loss", "router_aux_loss"), ("z_loss", "router_z_loss"), ("router_z_loss", "router_z_loss")):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            figures[name] = value.detach().float()
    return figures


def tokens_per_expert(output: Any, experts: int, top_k: int) -> torch.Tensor:
    """How many of a batch's tokens the first MoE layer sent to each expert (from the router logits a forward returned); zeros without them."""
    logits = getattr(output, "router_logits", None)
    if not logits:
        return torch.zeros(experts, dtype=torch.long)
    first = logits[0] if isinstance(logits, (tuple, list)) else logits
    chosen = torch.topk(first.detach().float(), top_k, dim=-1).indices.flatten().cpu()
    return torch.bincount(chosen, minlength=experts)
