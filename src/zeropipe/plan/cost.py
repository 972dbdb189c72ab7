"""A simple relative cost model: how long one optimizer step takes, in units of the bare compute.

It only has to rank candidates for the same model on the same machine, so it counts the
things that differ between them, each with a stated speed:

- compute: forward 2 FLOPs per weight per token (plus attention), backward twice that (once
  with LoRA: frozen weights need no weight gradients), one more forward with checkpointing;
- communication per rank on a ring: ZeRO-0/1 reduce gradients and (1) gather weights once
  per step, ZeRO-2 reduce-scatters every micro-batch, ZeRO-3 also gathers the weights in
  forward and again in backward for every micro-batch (the paper's 1.5x of plain data
  parallelism);
- offload: gradients down and weights up the host link, and DeepSpeed's CPU Adam, which all
  ranks of a node share;
- a fixed overhead per micro-batch (kernel launches, Python), so fewer, larger micro-batches win.

Communication is not assumed to overlap compute. 1.00 means the bare forward + backward.

The speeds are measured ones when ``zeropipe calibrate`` has measured this kind of machine
(``Hardware.calibration``, read once by ``detect_hardware``), else round figures assumed for
a consumer box; ``Speeds.measured`` names which figures were measured, and the plan says so.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, replace

from zeropipe.plan.hardware import Hardware
from zeropipe.plan.memory import Choice, value_bytes
from zeropipe.plan.model_spec import ModelSpec


@dataclass(frozen=True)
class Speeds:
    """Assumed speeds of a consumer multi-GPU box; every figure is a round number, stated."""

    gpu_flops: float = 50e12  # sustained bf16 matmul FLOP/s of an RTX 3090/4090-class card
    fp32_slowdown: float = 4.0  # fp32 without tensor cores
    intra_node_bytes_per_second: float = 10e9  # NCCL over PCIe without NVLink
    inter_node_bytes_per_second: float = 1.25e9  # 10 GbE
    host_link_bytes_per_second: float = 12e9  # GPU <-> host RAM over PCIe, per GPU
    cpu_adam_params_per_second: float = 1e9  # DeepSpeed CPU Adam, one node's cores together
    micro_step_seconds: float = 0.005
    gpu_memory_bytes_per_second: float = 900e9  # device memory bandwidth (RTX 3090: 936 GB/s): what dequantising a base reads and writes
    measured: frozenset[str] = frozenset()  # the fields above that zeropipe calibrate measured; the rest are assumed
    source: str = "assumed round figures for an RTX 3090/4090-class box"


CPU_SPEEDS = Speeds(
    gpu_flops=0.2e12,
    fp32_slowdown=1.0,  # CPUs without AMX run bf16 no faster than fp32
    intra_node_bytes_per_second=4e9,  # gloo over loopback
    inter_node_bytes_per_second=1.25e9,
    host_link_bytes_per_second=float("inf"),  # "offloading" a CPU rank moves nothing
    cpu_adam_params_per_second=1e9,
    micro_step_seconds=0.005,
    gpu_memory_bytes_per_second=20e9,  # one socket's DRAM
)


def speeds_for(hardware: Hardware) -> Speeds:
    """The speeds of ``hardware``: measured by ``zeropipe calibrate`` where its profile describes this machine, else assumed."""
    assumed = CPU_SPEEDS if hardware.accelerator == "cpu" else Speeds()
    calibration = hardware.calibration
    if calibration is None or not calibration.describes(hardware.accelerator, hardware.gpu_name):
        if hardware.accelerator == "cpu":
            return replace(assumed, source="assumed round figures for CPU ranks")
        return assumed
    flops = calibration.matmul_flops
    fast = flops.get("bf16") or flops.get("fp16") or flops["fp32"]
    measured = {"gpu_flops", "fp32_slowdown", "cpu_adam_params_per_second"}
    values: dict = {"gpu_flops": fast, "fp32_slowdown": fast / flops["fp32"], "cpu_adam_params_per_second": calibration.optimizer_params_per_second}
    if calibration.collective_bytes_per_second:
        values["intra_node_bytes_per_second"] = calibration.collective_bytes_per_second
        measured.add("intra_node_bytes_per_second")
    if calibration.host_link_bytes_per_second:
        values["host_link_bytes_per_second"] = calibration.host_link_bytes_per_second
        measured.add("host_link_bytes_per_second")
    return replace(
        assumed,
        **values,
        measured=frozenset(measured),
        source=f"measured by zeropipe calibrate on {calibration.measured_at or 'an unknown date'} ({calibration.device_name})",
    )


def offload_param_measured(hardware: Hardware, speeds: Speeds | None = None) -> bool:
    """Whether the host link that parameter offload crosses every micro-batch was measured on GPUs.

    CPU ranks never offload, and until a GPU's host link is measured the planner does not rank
    ``offload_param`` ahead of a setting without it that also fits: DeepSpeed's users measure
    parameter offload at about twice the step time of plain ZeRO-3 (DeepSpeed #3901), more than
    the assumed 12 GB/s link predicts.
    """
    speeds = speeds or speeds_for(hardware)
    return hardware.accelerator == "cuda" and "host_link_bytes_per_second" in speeds.measured


def forward_flops_per_sample(spec: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs of one sample: 2 per weight per token, plus causal attention for LMs; traced for diffusion."""
    if spec.activation_trace is not None:
        return float(spec.activation_trace.forward_flops)
    flops = 2.0 * spec.total_params * seq_len
    if spec.block is not None and spec.layers:
        # QK^T and PV, halved by the causal mask: 2 x 2 x s x q_dim per token per layer, halved.
        flops += 2.0 * spec.layers * seq_len * seq_len * spec.block.q_dim
    return flops


def step_seconds(spec: ModelSpec, hardware: Hardware, choice: Choice, speeds: Speeds | None = None) -> dict[str, float]:
    """Seconds of one optimizer step on one rank, by cause."""
    speeds = speeds or speeds_for(hardware)
    n = hardware.world_size
    v = value_bytes(choice.precision)
    micro_steps = choice.gradient_accumulation_steps
    sp = choice.sequence_parallel  # a group of sp ranks shares each sample: each computes 1/sp of it
    forward = forward_flops_per_sample(spec, choice.seq_len) * choice.micro_batch_size * spec.sequences_per_example * micro_steps / sp
    backward = forward * (1.0 if spec.lora is not None else 2.0)
    reference = forward if spec.reference_forward else 0.0  # the reference's pass (LoRA adapters off), without backward
    slowdown = speeds.fp32_slowdown if choice.precision == "fp32" else 1.0
    parts = {
        "compute": (forward + reference + backward) / speeds.gpu_flops * slowdown + micro_steps * speeds.micro_step_seconds,
        "recompute": forward / speeds.gpu_flops * slowdown if choice.gradient_checkpointing else 0.0,
        "communication": 0.0,
        "offload": 0.0,
    }
    trainable_bytes = spec.trainable_params * v
    weight_bytes = spec.total_params * v
    if n > 1:
        ring = (n - 1) / n
        bandwidth = speeds.inter_node_bytes_per_second if hardware.nodes > 1 else speeds.intra_node_bytes_per_second
        stage = choice.zero_stage
        if stage == 0:
            moved = 2 * ring * trainable_bytes  # all-reduce at the step
        elif stage == 1:
            moved = 2 * ring * trainable_bytes  # reduce-scatter at the step, all-gather after it
        elif stage == 2:
            moved = ring * trainable_bytes * micro_steps + ring * trainable_bytes
        else:
            moved = ring * (2 * weight_bytes + trainable_bytes) * micro_steps
        parts["communication"] = moved / bandwidth
    share = spec.trainable_params / n
    if choice.offload_optimizer and choice.zero_stage > 0:
        # Gradients go down every micro-batch (accumulated on the host), updated weights come back once.
        moved = share * v * (micro_steps + 1)
        parts["offload"] += moved / speeds.host_link_bytes_per_second
        parts["offload"] += spec.trainable_params / hardware.nodes / speeds.cpu_adam_params_per_second
    if choice.offload_param and choice.zero_stage == 3:
        parts["offload"] += 2 * micro_steps * (weight_bytes / n) / speeds.host_link_bytes_per_second
    if getattr(choice, "activation_offload", False) and choice.gradient_checkpointing:
        # The checkpointed block inputs go to pinned host memory in forward and come back in backward.
        parts["offload"] += 2 * micro_steps * checkpointed_input_bytes(spec, choice) / speeds.host_link_bytes_per_second
    parts["dequantise"] = micro_steps * dequantise_seconds(spec, choice, speeds)
    parts["sequence_parallel"] = micro_steps * sequence_parallel_bytes(spec, choice) / speeds.intra_node_bytes_per_second if sp > 1 else 0.0
    return parts


def sequence_parallel_bytes(spec: ModelSpec, choice: Choice) -> float:
    """Bytes one rank sends per micro-batch in Ulysses' all-to-alls: q, k, v and the output of every attention layer.

    Each is the size of the layer's input (tokens x hidden); a rank holds 1/N of the tokens and keeps 1/N of
    what it holds. Forward and backward, and the forward again where checkpointing recomputes it. Groups
    are consecutive ranks of one node: the intra-node link (``zeropipe calibrate`` measures it).
    """
    sp = choice.sequence_parallel
    whole = checkpointed_input_bytes(spec, dataclasses.replace(choice, sequence_parallel=1))
    passes = 3 if choice.gradient_checkpointing else 2
    return passes * 4 * whole / sp * (sp - 1) / sp


def checkpointed_input_bytes(spec: ModelSpec, choice: Choice) -> int:
    """The block inputs checkpointing keeps for one micro-batch: what activation offload moves each way."""
    from zeropipe.plan.activations import checkpointed_layer_bytes

    if spec.block is not None and spec.layers:
        tokens = choice.micro_batch_size * spec.sequences_per_example * choice.seq_len // choice.sequence_parallel
        return spec.layers * checkpointed_layer_bytes(spec.block, tokens, choice.precision)
    if spec.activation_trace is not None:
        return spec.activation_trace.checkpointed_bytes * choice.micro_batch_size * spec.sequences_per_example // choice.sequence_parallel
    return 0


def dequantise_seconds(spec: ModelSpec, choice: Choice, speeds: Speeds) -> float:
    """One micro-batch's dequantisation of a quantized base: each block linear read in its stored bytes and written in the precision, once per use.

    Uses: forward, the input gradient in backward, and the recomputed forward with checkpointing.
    A memory-bound copy at the device's bandwidth; the matmul itself is the same as on a 16-bit base.
    """
    v = value_bytes(choice.precision)
    if spec.fp8_base is not None:
        stored, weights = 1.0, spec.fp8_base.params_fp8
    elif spec.quantized is not None:
        stored, weights = 0.5, spec.quantized.params_4bit
    else:
        return 0.0
    uses = 3 if choice.gradient_checkpointing else 2
    return uses * weights * (stored + v) / speeds.gpu_memory_bytes_per_second


def caching_pass_seconds(spec: ModelSpec, examples: int, speeds: Speeds) -> float:
    """The one pass that fills the latent and text caches: each cached encoder's forward (2 FLOPs per weight per token), once per example.

    Paid once before training (and again only when the data or the encoders change); a rough
    figure from the encoders' weights and the plan's tokens per example.
    """
    tokens = spec.activation_trace.text_tokens if spec.activation_trace is not None and spec.activation_trace.text_tokens else 512
    flops = sum(2.0 * m.params * tokens for m in spec.cached_models)
    return examples * flops / speeds.gpu_flops


def relative_cost(spec: ModelSpec, hardware: Hardware, choice: Choice, speeds: Speeds | None = None) -> float:
    """Step time divided by the bare forward + backward compute of the same samples (1.00 = nothing else)."""
    speeds = speeds or speeds_for(hardware)
    parts = step_seconds(spec, hardware, choice, speeds)
    samples = choice.micro_batch_size * choice.gradient_accumulation_steps
    bare = 3.0 * forward_flops_per_sample(spec, choice.seq_len) * samples / speeds.gpu_flops
    return sum(parts.values()) / bare if bare > 0 else float("inf")
