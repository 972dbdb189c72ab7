"""The memory model: pure functions from (model, hardware, choice) to named byte counts.

This module holds the phases, ``Term`` and ``Choice`` and the model states; the activations
are ``plan.activations`` and the per-GPU and per-node lists of every term ``plan.totals``.

Every figure the planner shows is a ``Term``: a name in the user's words, a number of bytes
and the assumption behind it. Nothing here imports torch or touches a device.

Where the model states come from (Rajbhandari et al., "ZeRO", 2020, section 5): with mixed
precision and Adam, each parameter costs 2 bytes of 16-bit weight, 2 bytes of 16-bit gradient
and K = 12 bytes of optimizer state (fp32 master weight, momentum, variance). Across N_d ranks
ZeRO-1 partitions the 12, ZeRO-2 also the gradient, ZeRO-3 also the weight:
16Ψ, 4Ψ + 12Ψ/N_d, 2Ψ + 14Ψ/N_d, 16Ψ/N_d bytes per rank.

Where DeepSpeed (0.17+) holds more or less than that, the terms follow DeepSpeed, because the
integration tests hold them to what real runs allocate:

- ZeRO-1 keeps full gradients only while it accumulates: with ``overlap_comm`` (zeropipe
  always sets it) the last micro-batch's gradients are reduced bucket by bucket during the
  backward pass, so with no accumulation ZeRO-1 holds a gradient partition like ZeRO-2.
- ZeRO-1/2 copy the gradients of every parameter that *touches* the rank's partition into a
  contiguous buffer, whole: a parameter straddling a partition edge is held by both ranks.
- The optimizer step turns the rank's 16-bit gradient partition into an fp32 copy while it
  runs: a transient the paper's K = 12 leaves out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from zeropipe.config.optimizers import optimizer_kind
from zeropipe.plan.hardware import GIB, Hardware


if TYPE_CHECKING:
    from zeropipe.plan.model_spec import Fp8Base, ModelSpec, QuantizedBase

# Phases of a rank's life: the peak is what is always there plus the larger phase.
ALWAYS = "always"
FORWARD_BACKWARD = "forward/backward"
OPTIMIZER_STEP = "optimizer step"
LOADING = "model loading"
TRAINING = "training"
GENERATION = "generation"  # GRPO's sampling round inside a step (plan.totals.generation_terms)
CACHE_FILLING = "cache filling"  # the node's setup process, before any rank starts

# DeepSpeed's own defaults, used when the model's hidden size is unknown (--params).
DEFAULT_REDUCE_BUCKET_ELEMENTS = 500_000_000
DEFAULT_PREFETCH_BUCKET_ELEMENTS = 50_000_000
DEFAULT_ALLREDUCE_BUCKET_ELEMENTS = 500_000_000  # ZeRO-0 flattens gradients in chunks this big
STAGE3_SUB_GROUP_ELEMENTS = 1_000_000_000  # DeepSpeed's default sub_group_size: ZeRO-3 steps one sub-group at a time
# DeepSpeed's defaults for stage3_max_live_parameters and stage3_max_reuse_distance: together they
# decide how many gathered weights ZeRO-3 keeps whole on every rank (see zero3_retained_elements).
DEFAULT_STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000
DEFAULT_STAGE3_REUSE_DISTANCE = 1_000_000_000
# bitsandbytes' 4-bit format: one absmax per 64 weights; double quantization stores those as uint8
# with one fp32 scale per 256 of them.
QUANT_BLOCK_SIZE = 64
NESTED_QUANT_BLOCK_SIZE = 256
PARTITION_ALIGNMENT = 2  # ZeRO-1/2 pad the flat buffer to a multiple of 2 x ranks elements (NCCL 4-byte alignment)

# Assumptions about the software stack; each is said in the term that uses it.
CUDA_CONTEXT_BYTES = 1 * GIB
RANK_PROCESS_BYTES = {"cuda": 2 * GIB, "cpu": 3 * GIB // 4}
FRAGMENTATION_FRACTION = 0.10
DATA_WORKERS_PER_RANK = {"causal_lm": 0, "diffusion_unet": 2, "diffusion_transformer": 2, "unknown": 0}
DATA_WORKER_BYTES = 1 * GIB


@dataclass(frozen=True)
class Term:
    """One named part of a memory budget."""

    name: str
    bytes: int
    explanation: str
    phase: str = ALWAYS


@dataclass(frozen=True)
class Choice:
    """The settings a plan is made for: what the user (or the search) picks."""

    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    precision: str = "bf16"  # "bf16", "fp16" or "fp32"
    gradient_checkpointing: bool = False
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    seq_len: int = 2048
    attention: str = "sdpa"  # "sdpa" (fused kernels) or "eager"
    model_loading: str = "auto"  # "auto", "every_rank", "staggered" or "partitioned"
    # DeepSpeed's stage3_max_live_parameters and stage3_max_reuse_distance, as the run's DeepSpeed JSON sets them.
    zero3_max_live_parameters: int = DEFAULT_STAGE3_MAX_LIVE_PARAMETERS
    zero3_reuse_distance: int = DEFAULT_STAGE3_REUSE_DISTANCE
    # train.activation_offload: the checkpointed blocks' inputs wait in host RAM (needs gradient_checkpointing).
    activation_offload: bool = False
    # Ulysses sequence parallelism (parallel.sequence_parallel_size): each rank holds 1/N of a sample's tokens.
    sequence_parallel: int = 1
    # parallel.tiled_loss ("auto", True or False) and parallel.loss_tile_tokens: the LM loss tile by tile (plan.activations.loss_tile_tokens).
    # plan_run passes the config's value (default "auto", as the run decides); a Choice made without a config counts the untiled loss.
    tiled_loss: bool | str = False
    loss_tile_tokens: int = 1024

    def describe(self) -> str:
        offload = []
        if self.offload_optimizer:
            offload.append("optimizer")
        if self.offload_param:
            offload.append("params")
        parts = [f"ZeRO-{self.zero_stage}"]
        parts.append(f"offload {'+'.join(offload)}" if offload else "no offload")
        parts.append(("checkpointing, inputs offloaded" if self.activation_offload else "checkpointing") if self.gradient_checkpointing else "no checkpointing")
        parts.append(f"micro-batch {self.micro_batch_size} x {self.gradient_accumulation_steps}")
        parts.append(self.precision)
        if self.sequence_parallel > 1:
            parts.append(f"sequence parallel {self.sequence_parallel}")
        return ", ".join(parts)

    @property
    def loading_method(self) -> str:
        if self.model_loading != "auto":
            return self.model_loading
        # zeropipe builds ZeRO-3 models inside deepspeed.zero.Init; other stages load on every rank at once.
        return "partitioned" if self.zero_stage == 3 else "every_rank"


def peak_bytes(terms: tuple[Term, ...] | list[Term]) -> int:
    """Always-held terms plus the largest phase: activations and the optimizer step never coexist."""
    always = sum(t.bytes for t in terms if t.phase == ALWAYS)
    phases: dict[str, int] = {}
    for term in terms:
        if term.phase != ALWAYS:
            phases[term.phase] = phases.get(term.phase, 0) + term.bytes
    return always + max(phases.values(), default=0)


# ---------------------------------------------------------------------------------------------
# Model states


def value_bytes(precision: str) -> int:
    """Bytes of one weight, gradient or activation value in the training precision."""
    return 4 if precision == "fp32" else 2


def optimizer_bytes_per_parameter(precision: str, zero_stage: int, optimizer: str = "adamw") -> int:
    """K: the optimizer's state (Adam's momentum and variance: 8 bytes) plus, with ZeRO or mixed precision, an fp32 master copy (4).

    DeepSpeed's ZeRO optimizers keep their own fp32 partition even when the weights already
    are fp32; only plain data parallelism in fp32 updates the weights in place. The state per
    weight is train.optimizer's (config.optimizers: Muon's momentum 4, AdamW8bit's 2, Adafactor's
    factored moments about 0, Prodigy's 16).
    """
    state = int(optimizer_kind(optimizer).state_bytes)
    if precision == "fp32" and zero_stage == 0:
        return state
    return 4 + state


def partition_elements(elements: int, world_size: int) -> int:
    return math.ceil(elements / world_size)


@lru_cache(maxsize=64)
def gradient_partition_elements(parameter_sizes: tuple[int, ...], world_size: int) -> int:
    """Gradient elements the busiest ZeRO-1/2 rank holds: whole gradients of every parameter touching its partition.

    DeepSpeed flattens the trainable parameters in order, pads the buffer to a multiple of
    2 x ranks elements, cuts it into equal partitions, and copies the gradient of each
    parameter that overlaps a rank's partition into that rank's contiguous buffer in full.
    """
    total = sum(parameter_sizes)
    if world_size == 1:
        return total
    align = PARTITION_ALIGNMENT * world_size
    partition = math.ceil(total / align) * align // world_size
    busiest = 0
    for rank in range(world_size):
        low, high = rank * partition, (rank + 1) * partition
        held, start = 0, 0
        for size in parameter_sizes:
            if start < high and start + size > low:
                held += size
            start += size
        busiest = max(busiest, held)
    return busiest


def parameter_bytes(trainable: int, frozen: int, world_size: int, choice: Choice) -> int:
    """16-bit (or fp32) weights on each GPU: all of them below ZeRO-3, a 1/N share under it, none when offloaded."""
    everything = trainable + frozen
    if choice.zero_stage < 3:
        return everything * value_bytes(choice.precision)
    if choice.offload_param:
        return 0
    return partition_elements(everything, world_size) * value_bytes(choice.precision)


def gradient_bytes(trainable: int, world_size: int, choice: Choice, parameter_sizes: tuple[int, ...] = ()) -> int:
    """Gradients held on each GPU between backward and step (see the module docstring for ZeRO-1)."""
    size = value_bytes(choice.precision)
    stage = choice.zero_stage
    if stage == 0 or (stage == 1 and choice.gradient_accumulation_steps > 1):
        return trainable * size
    if choice.offload_optimizer:
        # ZeRO-1/2 copy reduced gradients straight to the fp32 buffer in host RAM; ZeRO-3 keeps
        # its 16-bit gradient partition on the offload device too.
        return 0
    if stage == 3:
        return partition_elements(trainable, world_size) * size
    held = gradient_partition_elements(parameter_sizes, world_size) if parameter_sizes else partition_elements(trainable, world_size)
    return held * size


def optimizer_state_bytes(trainable: int, world_size: int, choice: Choice, optimizer: str = "adamw") -> int:
    """fp32 master weights and the optimizer's state on each GPU (none there when offloaded)."""
    if choice.offload_optimizer:
        return 0
    per_parameter = optimizer_bytes_per_parameter(choice.precision, choice.zero_stage, optimizer)
    if choice.zero_stage == 0:
        return trainable * per_parameter
    return partition_elements(trainable, world_size) * per_parameter


def optimizer_step_bytes(trainable: int, world_size: int, choice: Choice) -> int:
    """The fp32 gradient copy the optimizer step makes on the GPU (none when the step runs on the CPU)."""
    if choice.offload_optimizer or (choice.precision == "fp32" and choice.zero_stage == 0):
        return 0
    if choice.zero_stage == 0:
        return trainable * 4
    share = partition_elements(trainable, world_size)
    if choice.zero_stage == 3:
        share = min(share, STAGE3_SUB_GROUP_ELEMENTS)
    return share * 4


def frozen_model_bytes(models, precision: str) -> int:
    """Frozen encoders as the ranks load them with caching off (``models.common.encoder_precision_for``):
    text and image encoders in bf16 where the run is bf16, else fp32 (never fp16: T5 overflows); the VAE in fp32."""
    return sum(model.params * (2 if precision == "bf16" and not model.name.startswith("vae") else 4) for model in models)


def cache_filling_placement(spec: ModelSpec, hardware: Hardware, precision: str) -> tuple[int, int, str]:
    """(bytes on the node's first GPU, bytes streamed from host RAM, where) while the node's setup process encodes captions.

    It loads the text encoders on the first GPU; one larger than that GPU is spread over the
    node's GPUs and, beyond them, host RAM (``families.diffusion.pipelines.spread_placement``, which keeps
    10% of each GPU free).
    """
    encoders = [m for m in spec.cached_models if not m.name.startswith("vae")]
    text = frozen_model_bytes(encoders, precision)
    vae = frozen_model_bytes([m for m in spec.cached_models if m.name.startswith("vae")], precision)
    usable = int((hardware.gpu_memory_bytes - CUDA_CONTEXT_BYTES) * 0.9)
    if text <= usable:
        # The VAE (latents) and the text encoders (captions) are loaded one after the other.
        return max(text, vae), 0, "on the node's first GPU"
    gpus = hardware.gpus_per_node
    on_each = min(math.ceil(text / gpus), usable)
    streamed = max(0, text - on_each * gpus)
    where = f"spread over the node's {gpus} GPUs ({gib_text(on_each)} each)" + (f", {gib_text(streamed)} streamed from host RAM" if streamed else "")
    return max(on_each, vae), streamed, where


def quantization_constant_bytes(base: QuantizedBase) -> int:
    """bitsandbytes' absmax per block (and, with double quantization, their own scales): attributes, whole on every rank."""
    blocks = math.ceil(base.params_4bit / QUANT_BLOCK_SIZE)
    return blocks + 4 * math.ceil(blocks / NESTED_QUANT_BLOCK_SIZE) if base.double_quant else 4 * blocks


def quantized_base_bytes(base: QuantizedBase) -> int:
    """The whole QLoRA base as bitsandbytes holds it: two 4-bit weights per byte, the constants, the fp32 upcasts."""
    return math.ceil(base.params_4bit / 2) + quantization_constant_bytes(base) + base.params_upcast * 4


def quantized_base_terms(base: QuantizedBase, world_size: int, choice: Choice) -> list[Term]:
    """QLoRA's frozen base on one GPU: 4-bit linear layers and fp32 upcasts, a 1/N share of each under ZeRO-3."""
    n = world_size

    def held(total: int) -> int:
        if choice.zero_stage < 3:
            return total
        return 0 if choice.offload_param else math.ceil(total / n)

    share = "all of them" if choice.zero_stage < 3 else (f"a 1/{n} share (ZeRO-3)" if not choice.offload_param else "none: offloaded to host RAM (ZeRO-3)")
    constants = quantization_constant_bytes(base)
    return [
        Term(
            "frozen 4-bit base",
            held(math.ceil(base.params_4bit / 2)) + constants,
            f"{count_text(base.params_4bit)} linear-layer weights, two per byte, {share}; plus bitsandbytes' quantization constants "
            f"({gib_text(constants)}{', double-quantized' if base.double_quant else ''}), whole on every rank",
        ),
        Term(
            "frozen weights upcast to fp32",
            held(base.params_upcast * 4),
            f"{count_text(base.params_upcast)} weights outside the linear layers (embeddings, output head, norms), which "
            f"prepare_model_for_kbit_training casts to fp32, {share}",
        ),
    ]


# What models.loading holds while it partitions an fp8 skeleton (PARTITION_BATCH_BYTES) and reads a chunk of rows.
FP8_LOAD_BATCH_BYTES = 64 * 2**20 + 16 * 2**20


def fp8_stored_bytes(spec: ModelSpec, precision: str) -> int:
    """The whole model as an fp8 base stores it: block linears one byte per weight, the rest (and the adapters) in the precision."""
    base = spec.fp8_base
    assert base is not None
    return base.params_fp8 + (spec.total_params - base.params_fp8) * value_bytes(precision)


def fp8_bytes_per_weight(spec: ModelSpec, precision: str) -> float:
    return fp8_stored_bytes(spec, precision) / max(1, spec.total_params)


def fp8_base_terms(spec: ModelSpec, base: Fp8Base, world_size: int, choice: Choice) -> list[Term]:
    """An fp8 base on one GPU: the block linears' bytes (a 1/N share under ZeRO-3), their scales, the rest of the base in the precision."""
    n, v = world_size, value_bytes(choice.precision)
    share = "all of them" if choice.zero_stage < 3 else (f"a 1/{n} share (ZeRO-3)" if not choice.offload_param else "none: offloaded to host RAM (ZeRO-3)")
    held = base.params_fp8 if choice.zero_stage < 3 else (0 if choice.offload_param else partition_elements(base.params_fp8, n))
    rest = spec.frozen_base_params - base.params_fp8
    bits = "16-bit" if choice.precision != "fp32" else "fp32"
    return [
        Term(
            f"frozen {base.format} base",
            held + 4 * base.channels,
            f"{count_text(base.params_fp8)} weights of the blocks' linear layers, one byte each, {share}; "
            f"plus a float32 scale per output channel ({count_text(base.channels)}), whole on every rank",
        ),
        Term(f"frozen base weights ({bits})", parameter_bytes(0, rest, n, choice), f"{count_text(rest)} weights outside the blocks' linear layers (embedders, norms, heads), {share}"),
        Term(
            "dequantized weight (fp8 base)",
            base.largest_linear * v,
            f"the largest block linear ({count_text(base.largest_linear)} weights) upcast to {bits} while it computes; never kept for backward",
            FORWARD_BACKWARD,
        ),
    ]


def model_state_terms(spec: ModelSpec, world_size: int, choice: Choice) -> list[Term]:
    """Weights, gradients and optimizer states on one GPU: the ZeRO paper's 2Ψ + 2Ψ + KΨ, partitioned."""
    n = world_size
    stage = choice.zero_stage
    trainable, frozen = spec.trainable_params, spec.frozen_base_params
    bits = "16-bit" if choice.precision != "fp32" else "fp32"
    share = "all of them" if stage < 3 else (f"a 1/{n} share (ZeRO-3)" if not choice.offload_param else "none: offloaded to host RAM (ZeRO-3)")
    terms: list[Term] = []
    if spec.lora is None and frozen == 0:
        terms.append(Term(f"parameters ({bits})", parameter_bytes(trainable, 0, n, choice), f"{count_text(trainable)} weights, {share}"))
    else:
        # LoRA, or frozen parts without LoRA (a vision-language model's frozen vision tower).
        label, what = ("LoRA adapters", f"trainable adapter weights (r={spec.lora.r})") if spec.lora is not None else ("trainable weights", "trainable weights")
        terms.append(Term(f"{label} ({bits})", parameter_bytes(trainable, 0, n, choice), f"{count_text(trainable)} {what}, {share}"))
        if spec.quantized is not None:
            terms += quantized_base_terms(spec.quantized, n, choice)
        elif spec.fp8_base is not None:
            terms += fp8_base_terms(spec, spec.fp8_base, n, choice)
        else:
            terms.append(
                Term(
                    f"frozen base weights ({bits})",
                    parameter_bytes(0, frozen, n, choice),
                    f"{count_text(frozen)} frozen weights: no gradients or optimizer states, {share}",
                )
            )
    grads = gradient_bytes(trainable, n, choice, spec.parameter_sizes)
    if stage == 0:
        why = "one per trainable weight (plain data parallelism)"
    elif stage == 1 and choice.gradient_accumulation_steps > 1:
        why = "ZeRO-1 keeps full gradients while it accumulates micro-batches; they are reduced only at the step"
    elif choice.offload_optimizer:
        why = "none on the GPU: reduced gradients go to buffers in host RAM"
    elif stage == 3:
        why = f"a 1/{n} share of the trainable weights' gradients"
    else:
        why = (
            f"a 1/{n} partition, reduced bucket by bucket during backward; DeepSpeed keeps whole gradients of "
            "parameters that straddle a partition edge" + (" (counted from the parameter sizes)" if spec.parameter_sizes else "")
        )
    terms.append(Term(f"gradients ({bits})", grads, why))
    k = optimizer_bytes_per_parameter(choice.precision, stage, spec.optimizer)
    if choice.offload_optimizer:
        opt_why = "none on the GPU: offloaded to host RAM, stepped by DeepSpeed's CPU Adam"
    else:
        master = "fp32 master weight + " if not (choice.precision == "fp32" and stage == 0) else ""
        state = "Adam momentum + variance, fp32" if spec.optimizer == "adamw" else f"{spec.optimizer}'s state"
        opt_why = f"K={k} bytes per trainable weight ({master}{state})" + (f", a 1/{n} partition" if stage else "")
    terms.append(Term("optimizer states", optimizer_state_bytes(trainable, n, choice, spec.optimizer), opt_why))
    if spec.ema:
        terms.append(Term("EMA weights (fp32)", ema_bytes(trainable, n, choice), ema_why(n, choice)))
    return terms


def ema_bytes(trainable: int, world_size: int, choice: Choice) -> int:
    """train.ema: 4 bytes per trainable weight of the rank's partition, where its master weights are (engine/ema.py)."""
    if choice.offload_optimizer:
        return 0
    return partition_elements(trainable, world_size) * 4 if choice.zero_stage else trainable * 4


def ema_why(world_size: int, choice: Choice) -> str:
    if choice.offload_optimizer:
        return "none on the GPU: kept in host RAM beside the offloaded fp32 master weights"
    return "train.ema: 4 bytes per trainable weight" + (f", a 1/{world_size} partition (beside the fp32 master weights)" if choice.zero_stage else " (every rank)")


# ---------------------------------------------------------------------------------------------
# How the terms name their figures


def count_text(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def gib_text(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"
