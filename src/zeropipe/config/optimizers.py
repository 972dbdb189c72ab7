"""The optimizers a run can choose (``train.optimizer``): who builds each, where it runs, what it holds.

One table, read by the DeepSpeed JSON writer (``config.deepspeed``), the rank that builds a
client optimizer (``engine.optimizers``), the checks (``check.rules``) and the planner's state
bytes (``plan.memory``), so that what the planner counts, what check allows and what the rank
builds never disagree.

DeepSpeed builds AdamW, Muon and Adafactor itself from the JSON's ``optimizer`` block (Adafactor
through its fallback ``getattr(torch.optim, type)``); bitsandbytes' AdamW8bit and Prodigy are not
known to DeepSpeed and are handed to ``deepspeed.initialize`` as client optimizers, which
DeepSpeed 0.17+ refuses together with ZeRO-Offload (``zero_force_ds_cpu_optimizer``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerKind:
    name: str
    # The JSON's optimizer type when DeepSpeed builds it; None: a client optimizer built by the rank.
    deepspeed_type: str | None
    # ZeRO stages whose optimizer this can be: see `stage_reason` for why others are refused.
    stages: tuple[int, ...]
    offload: bool
    # Bytes of optimizer state per trainable weight on top of the fp32 master copy (Adam: 8).
    state_bytes: float
    describe: str
    stage_reason: str = ""
    offload_reason: str = ""
    # The PyPI package a client optimizer needs, and how to install it.
    package: str | None = None


WHOLE_TENSORS = (
    "it needs whole tensors, and ZeRO 1-3 hand the optimizer flat partitions of many tensors"
)

OPTIMIZERS: dict[str, OptimizerKind] = {
    kind.name: kind
    for kind in (
        OptimizerKind("adamw", "AdamW", (0, 1, 2, 3), True, 8, "AdamW (DeepSpeed's; its CPU Adam with offload)"),
        OptimizerKind(
            "muon", "Muon", (0, 1, 2, 3), False, 4,
            "Muon (DeepSpeed's: Newton-Schulz orthogonalised momentum for the weight matrices, AdamW for embeddings, "
            "the output head, norms and biases)",
            # DeepSpeed 0.19.8 has a CPU-offload path for Muon under ZeRO 1-2 (stage_1_and_2's
            # _apply_muon_updates_cpu_offload), but a 3-step run of it on CPU ranks here did not finish in
            # 15 minutes, so ZeRO-Pipe does not offer what it could not verify.
            offload_reason="ZeRO-Pipe has not verified DeepSpeed's Muon with ZeRO-Offload (a 3-step run of it on CPU "
            "ranks did not finish in 15 minutes)",
        ),
        OptimizerKind(
            "adafactor", "Adafactor", (0,), False, 0,
            "Adafactor (torch.optim.Adafactor: factored second moments, no first moment)",
            stage_reason="Adafactor factors each weight matrix's second moment into row and column sums and scales "
            "steps by each tensor's RMS: " + WHOLE_TENSORS,
            offload_reason="DeepSpeed's ZeRO-Offload steps with its own CPU Adam only",
        ),
        OptimizerKind(
            "adamw8bit", None, (0, 1, 2, 3), False, 2,
            "AdamW8bit (bitsandbytes: moments stored in 8 bits, block-wise scaled)",
            offload_reason="DeepSpeed 0.17+ refuses a client optimizer with ZeRO-Offload (its CPU step is its own Adam)",
            package="bitsandbytes",
        ),
        OptimizerKind(
            "prodigy", None, (0,), False, 16,
            "Prodigy (prodigyopt: AdamW whose step size is estimated from the gradients; train.lr is a multiplier, "
            "usually 1.0)",
            stage_reason="Prodigy estimates its step size from sums over all weights, and under ZeRO 1-3 each rank "
            "would estimate it from its own partition",
            offload_reason="DeepSpeed 0.17+ refuses a client optimizer with ZeRO-Offload (its CPU step is its own Adam)",
            package="prodigyopt",
        ),
    )
}


def optimizer_kind(name: str) -> OptimizerKind:
    return OPTIMIZERS[name]


def deepspeed_type_to_name(deepspeed_type: str) -> str | None:
    """A DeepSpeed JSON's optimizer type as train.optimizer, or None when ZeRO-Pipe has no such choice."""
    lowered = deepspeed_type.lower()
    if lowered in ("adam", "adamw"):
        return "adamw"
    for kind in OPTIMIZERS.values():
        if kind.deepspeed_type and kind.deepspeed_type.lower() == lowered:
            return kind.name
    return None


def optimizer_problems(name: str, zero_stage: int, offload: bool) -> list[tuple[str, str, str]]:
    """(key, problem, fix) for an optimizer at a ZeRO stage and offload it cannot run with."""
    kind = OPTIMIZERS[name]
    problems = []
    if zero_stage not in kind.stages:
        allowed = ", ".join(str(stage) for stage in kind.stages)
        problems.append(
            ("train.optimizer", f"{name} cannot run under ZeRO-{zero_stage}: {kind.stage_reason}",
             f"set deepspeed.zero_stage: {allowed} or choose train.optimizer: adamw / muon / adamw8bit")
        )
    if offload and not kind.offload:
        problems.append(
            ("train.optimizer", f"{name} cannot run with deepspeed.offload_optimizer: cpu: {kind.offload_reason}",
             "set deepspeed.offload_optimizer: none, or train.optimizer: adamw (which offloads)")
        )
    return problems
