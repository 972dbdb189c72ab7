"""The memory model: pure functions from (model, hardware, choice) to named byte counts.

(Over 600 lines on purpose: every term of the memory model, per GPU and per node, side by side,
so that the formulas that must agree with each other and with DeepSpeed are read together.)

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
    from zeropipe.plan.model_spec import BlockShape, Fp8Base, LoraShape, ModelSpec, QuantizedBase

# Phases of a rank's life: the peak is what is always there plus the larger phase.
ALWAYS = "always"
FORWARD_BACKWARD = "forward/backward"
OPTIMIZER_STEP = "optimizer step"
LOADING = "model loading"
TRAINING = "training"
GENERATION = "generation"  # GRPO's sampling round inside a step (plan.memory.generation_terms)
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
    where = f"spread over the node's {gpus} GPUs ({_gib(on_each)} each)" + (f", {_gib(streamed)} streamed from host RAM" if streamed else "")
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
            f"{_count(base.params_4bit)} linear-layer weights, two per byte, {share}; plus bitsandbytes' quantization constants "
            f"({_gib(constants)}{', double-quantized' if base.double_quant else ''}), whole on every rank",
        ),
        Term(
            "frozen weights upcast to fp32",
            held(base.params_upcast * 4),
            f"{_count(base.params_upcast)} weights outside the linear layers (embeddings, output head, norms), which "
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
            f"{_count(base.params_fp8)} weights of the blocks' linear layers, one byte each, {share}; "
            f"plus a float32 scale per output channel ({_count(base.channels)}), whole on every rank",
        ),
        Term(f"frozen base weights ({bits})", parameter_bytes(0, rest, n, choice), f"{_count(rest)} weights outside the blocks' linear layers (embedders, norms, heads), {share}"),
        Term(
            "dequantized weight (fp8 base)",
            base.largest_linear * v,
            f"the largest block linear ({_count(base.largest_linear)} weights) upcast to {bits} while it computes; never kept for backward",
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
        terms.append(Term(f"parameters ({bits})", parameter_bytes(trainable, 0, n, choice), f"{_count(trainable)} weights, {share}"))
    else:
        # LoRA, or frozen parts without LoRA (a vision-language model's frozen vision tower).
        label, what = ("LoRA adapters", f"trainable adapter weights (r={spec.lora.r})") if spec.lora is not None else ("trainable weights", "trainable weights")
        terms.append(Term(f"{label} ({bits})", parameter_bytes(trainable, 0, n, choice), f"{_count(trainable)} {what}, {share}"))
        if spec.quantized is not None:
            terms += quantized_base_terms(spec.quantized, n, choice)
        elif spec.fp8_base is not None:
            terms += fp8_base_terms(spec, spec.fp8_base, n, choice)
        else:
            terms.append(
                Term(
                    f"frozen base weights ({bits})",
                    parameter_bytes(0, frozen, n, choice),
                    f"{_count(frozen)} frozen weights: no gradients or optimizer states, {share}",
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
# Activations


def layer_activation_bytes(
    block: BlockShape,
    tokens: int,
    seq_len: int,
    precision: str,
    attention: str = "sdpa",
    lora: LoraShape | None = None,
) -> int:
    """Bytes one decoder layer saves for backward, counted tensor by tensor.

    This is Korthikanti et al.'s count ("Reducing Activation Recomputation in Large
    Transformer Models", 2022), done for the block at hand. For a GPT block (LayerNorm,
    4h GeLU MLP, dropout, eager attention in 16 bits) it gives their
    s·b·h·(34 + 5·a·s/h). For a Llama-style block (RMSNorm that upcasts to fp32, gated MLP,
    no dropout) it gives s·b·(20h + 4h_kv + 8i) with fused attention (SDPA/flash), which keeps
    only q, k, v, the output and a log-sum-exp: no s² term.

    With LoRA the base weights are frozen: a frozen linear layer needs no saved input (its
    input gradient uses the weight only), while each adapter saves its (dropped-out) input.
    """
    v = value_bytes(precision)
    h, q, kv, i, heads = block.hidden, block.q_dim, block.kv_dim, block.intermediate, block.heads
    frozen = lora is not None
    # Norms: LayerNorm saves its input; an RMSNorm that upcasts saves the fp32 input and, when its
    # weight trains, the normalized value (fp32 if the weight is upcast too, as in Gemma).
    if block.layernorm:
        per_token = block.norm_elements * v
    else:
        normalized = 0 if frozen else (4 if block.norm_upcasts_weight else v)
        per_token = block.norm_elements * (4 + normalized)
    # q, k and v as handed to attention (after rotary embedding).
    per_token += v * (q + 2 * kv)
    if attention == "eager":
        per_token += v * 2 * (q - kv)  # k and v repeated to every query head before the matmuls
        softmax = (4 + v) if block.softmax_fp32 else v  # fp32 probabilities and their 16-bit copy
        if block.dropout:
            softmax += 1 + v  # dropout mask and dropped probabilities
        per_token += heads * seq_len * softmax
    else:
        per_token += 4 * heads  # log-sum-exp of the fused kernel, fp32
    # MLP: the activation's input, and for a gated MLP its output and the up projection too.
    per_token += v * (3 * i if block.gated_mlp else i)
    # Inputs of the linear layers.
    if not frozen:
        per_token += v * (h + q + h + i)  # attention input, attention output, MLP input, MLP output
    else:
        per_token += lora_input_bytes_per_token(lora, v)
    if block.dropout:
        per_token += 2 * h  # residual dropout masks after attention and MLP
    return tokens * per_token


def lora_input_bytes_per_token(lora: LoraShape, v: int) -> int:
    """What LoRA adapters of one layer save per token: their inputs (or dropout mask + dropped input) and rank-r outputs."""
    saved = 0
    for _group, features, count in lora.adapted_inputs:
        # With dropout each adapter drops its own copy of the input; without, they share it.
        saved += count * features * (1 + v) if lora.dropout else features * v
        saved += count * lora.r * v
    return saved


def checkpointed_layer_bytes(block: BlockShape, tokens: int, precision: str) -> int:
    """With full activation checkpointing a layer keeps only its input: 2·s·b·h bytes in 16 bits."""
    return tokens * block.hidden * value_bytes(precision)


def loss_activation_bytes(block: BlockShape, vocab: int, tokens: int, precision: str, frozen: bool) -> tuple[int, int]:
    """(saved for backward, transient) bytes of the final norm, LM head, logits and loss.

    transformers' loss upcasts the logits to fp32 and log-softmax saves its fp32 output:
    4·s·b·V saved; at the peak the 16-bit logits and their fp32 copy exist too.
    """
    v = value_bytes(precision)
    norm = v if block.layernorm else 4 + (0 if frozen else (4 if block.norm_upcasts_weight else v))
    saved = tokens * block.hidden * norm
    if not frozen:
        saved += tokens * block.hidden * v  # input of the LM head
    saved += tokens * vocab * 4
    transient = tokens * vocab * (v + (4 if v != 4 else 0))
    return saved, transient


def saved_activation_bytes(spec: ModelSpec, choice: Choice) -> int:
    """Bytes saved for backward by the end of the forward pass (what ``saved_tensors_hooks`` sees)."""
    if spec.block is not None and spec.layers:
        tokens = choice.micro_batch_size * spec.sequences_per_example * choice.seq_len // choice.sequence_parallel
        if choice.gradient_checkpointing:
            layers = spec.layers * checkpointed_layer_bytes(spec.block, tokens, choice.precision)
        else:
            layers = spec.layers * layer_activation_bytes(spec.block, tokens, choice.seq_len, choice.precision, choice.attention, spec.lora)
        saved, _ = loss_activation_bytes(spec.block, spec.vocab_size or 0, tokens, choice.precision, spec.lora is not None)
        return layers + saved
    if spec.activation_trace is not None:
        trace = spec.activation_trace
        per_sample = trace.checkpointed_bytes if choice.gradient_checkpointing else trace.saved_bytes
        return per_sample * choice.micro_batch_size * spec.sequences_per_example * _trace_scale(trace, choice) // choice.sequence_parallel
    return 0


def _trace_scale(trace, choice: Choice) -> int:
    # Traces run in 16 bits; fp32 doubles every value (fp32 upcasts inside the model stay as they were, a slight overcount).
    return 2 if choice.precision == "fp32" and trace.precision != "fp32" else 1


def activation_terms(spec: ModelSpec, choice: Choice) -> list[Term]:
    """Activations of one micro-batch on one GPU, for the forward/backward phase."""
    b, s = choice.micro_batch_size * spec.sequences_per_example, choice.seq_len
    # Sequence parallelism: a rank holds s/N of each sample's tokens (inside attention, all s tokens of 1/N of the heads: the same bytes).
    tokens = b * s // choice.sequence_parallel
    split = f"/{choice.sequence_parallel} (sequence parallel)" if choice.sequence_parallel > 1 else ""
    terms: list[Term] = []
    if spec.block is not None and spec.layers:
        block = spec.block
        full = layer_activation_bytes(block, tokens, s, choice.precision, choice.attention, spec.lora)
        attention = "fused attention (SDPA/flash): no s² term" if choice.attention != "eager" else "eager attention: includes the a·s² scores"
        if choice.gradient_checkpointing:
            kept = spec.layers * checkpointed_layer_bytes(block, tokens, choice.precision)
            terms.append(
                offloaded_activation_gpu_term(spec, choice)
                if choice.activation_offload
                else Term(
                    "activations (checkpointed layer inputs)",
                    kept,
                    f"{spec.layers} layers keep only their input, s·b·h·{value_bytes(choice.precision)} bytes each (s={s}{split}, b={b}, h={block.hidden})",
                    FORWARD_BACKWARD,
                )
            )
            terms.append(
                Term(
                    "one layer recomputed in backward", full, f"the layer being recomputed holds its full activations; {attention}", FORWARD_BACKWARD
                )
            )
        else:
            terms.append(
                Term(
                    "activations saved for backward",
                    spec.layers * full,
                    f"{spec.layers} layers x {_gib(full)} (s={s}{split}, b={b}, h={block.hidden}); per token and layer "
                    f"{full // max(tokens, 1):,} bytes, counted tensor by tensor; {attention}"
                    + ("; frozen base layers save no inputs, adapters save theirs" if spec.lora else ""),
                    FORWARD_BACKWARD,
                )
            )
        saved, transient = loss_activation_bytes(block, spec.vocab_size or 0, tokens, choice.precision, spec.lora is not None)
        terms.append(
            Term(
                "logits and loss",
                saved + transient,
                f"s·b·V = {tokens:,} x {spec.vocab_size:,}: 16-bit logits, their fp32 copy in the loss and the fp32 log-softmax "
                "saved for backward, plus the final norm",
                FORWARD_BACKWARD,
            )
        )
    elif spec.activation_trace is not None:
        trace = spec.activation_trace
        # Sequence parallelism: each rank of a group holds 1/N of the latent tokens (the text, whole on every rank, is a small share).
        scale = b * _trace_scale(trace, choice) / choice.sequence_parallel
        clip = f" x {trace.frames} frames" if trace.frames > 1 else ""
        where = f"traced on the meta device at {trace.resolution}x{trace.resolution} px{clip}, x {b} samples{split}"
        if choice.gradient_checkpointing and choice.activation_offload:
            terms.append(offloaded_activation_gpu_term(spec, choice))
        if choice.gradient_checkpointing and not choice.activation_offload:
            terms.append(Term("activations (checkpointed block inputs)", int(trace.checkpointed_bytes * scale), where, FORWARD_BACKWARD))
        if choice.gradient_checkpointing:
            terms.append(
                Term(
                    "one block recomputed in backward",
                    int(trace.largest_block_bytes * scale),
                    "the largest checkpointed block's activations",
                    FORWARD_BACKWARD,
                )
            )
        else:
            terms.append(
                Term("activations saved for backward", int(trace.saved_bytes * scale), where + "; fused attention (no s² term)", FORWARD_BACKWARD)
            )
    else:
        terms.append(Term("activations", 0, "unknown for a bare parameter count: pass --model to include them", FORWARD_BACKWARD))
    terms += moe_router_terms(spec, choice)
    return terms


def moe_router_terms(spec: ModelSpec, choice: Choice) -> list[Term]:
    """What a mixture of experts' routers save for backward, beyond the experts' own activations (``BlockShape.intermediate``).

    Per token and MoE layer: the router's logits (16-bit) and their fp32 softmax over all experts, and
    the top-k probabilities (fp32) and expert indices (int64) the experts are weighted by. With
    checkpointing only the layer being recomputed holds them.
    """
    moe = spec.moe
    if moe is None:
        return []
    tokens = choice.micro_batch_size * spec.sequences_per_example * choice.seq_len
    per_token = moe.experts * (value_bytes(choice.precision) + 4) + moe.active_experts * (4 + 8)
    layers = 1 if choice.gradient_checkpointing else moe.moe_layers
    return [
        Term(
            "MoE routers",
            layers * tokens * per_token,
            f"{layers} MoE layer(s) x {tokens:,} tokens x {per_token:,} bytes: logits and fp32 softmax over {moe.experts} experts, "
            f"top-{moe.active_experts} weights and indices (the experts' own activations are in the layers' figure: {moe.active_experts} experts per token)",
            FORWARD_BACKWARD,
        )
    ]


# ---------------------------------------------------------------------------------------------
# Activation offload (train.activation_offload): the checkpointed blocks' inputs in host RAM
#
# zeropipe.models.checkpointing copies every tensor a checkpointed block is handed positionally
# (a decoder layer's hidden states; a DiT block's image and text streams, timestep embedding and
# rotary tables) into host memory when the block's forward saves it, and back when backward
# recomputes the block. Only those inputs move: what the recomputed block holds, and whatever is
# saved outside the checkpointed blocks (embeddings, the loss), stays on the GPU.


def offloaded_input_sizes(spec: ModelSpec, choice: Choice) -> list[int]:
    """Bytes of each tensor activation offload copies to host RAM for one micro-batch, one entry per copy."""
    if not choice.gradient_checkpointing:
        return []
    b = choice.micro_batch_size * spec.sequences_per_example
    if spec.block is not None and spec.layers:
        # transformers hands a decoder layer only its hidden states positionally (masks and rotary tables are keywords, kept once).
        return [checkpointed_layer_bytes(spec.block, b * choice.seq_len // choice.sequence_parallel, choice.precision)] * spec.layers
    trace = spec.activation_trace
    if trace is not None:
        scale = b * _trace_scale(trace, choice) / choice.sequence_parallel
        if trace.offloaded_sizes is not None:
            return [int(size * scale) for size in trace.offloaded_sizes]
        # A trace made before offload was counted: every checkpointed byte is taken to move (an overcount by what is saved outside the blocks).
        return [int(trace.checkpointed_bytes * scale)]
    return []


def offloaded_activation_bytes(spec: ModelSpec, choice: Choice) -> int:
    """Bytes of checkpointed block inputs that activation offload holds in host RAM per rank (one micro-batch's worth)."""
    return sum(offloaded_input_sizes(spec, choice))


def activation_offload_traffic_bytes(spec: ModelSpec, choice: Choice) -> int:
    """Bytes one rank moves over the host link per optimizer step for activation offload: each input out in forward, back in backward.

    Zero when the choice does not offload activations; the cost model prices these at the measured host-link bandwidth.
    """
    if not (choice.activation_offload and choice.gradient_checkpointing):
        return 0
    return 2 * offloaded_activation_bytes(spec, choice) * choice.gradient_accumulation_steps


def offloaded_activation_gpu_term(spec: ModelSpec, choice: Choice) -> Term:
    """What stays on the GPU of the checkpointed inputs when they are offloaded: the one being recomputed, and what lies outside the blocks."""
    sizes = offloaded_input_sizes(spec, choice)
    moved = sum(sizes)
    trace = spec.activation_trace if spec.block is None or not spec.layers else None
    if trace is not None and trace.offloaded_sizes is not None:
        scale = choice.micro_batch_size * spec.sequences_per_example * _trace_scale(trace, choice) / choice.sequence_parallel
        outside = int(max(0, trace.offload_resident_bytes or 0) * scale)
        per_block = moved // max(1, trace.checkpointed_blocks)
        return Term(
            "activations (checkpointed block inputs, offloaded)",
            outside + per_block,
            f"{_gib(moved)} of block inputs wait in host RAM (train.activation_offload); on the GPU: what is saved outside the "
            f"checkpointed blocks ({_gib(outside)}) and the inputs of the block being recomputed, brought back ({_gib(per_block)})",
            FORWARD_BACKWARD,
        )
    largest = max(sizes, default=0)
    return Term(
        "activations (checkpointed layer inputs, offloaded)",
        largest,
        f"{len(sizes)} inputs ({_gib(moved)}) wait in host RAM (train.activation_offload); the one of the layer being recomputed "
        "is brought back to the GPU",
        FORWARD_BACKWARD,
    )


def offloaded_activation_host_term(spec: ModelSpec, hardware: Hardware, choice: Choice) -> Term:
    """Host RAM of one node for the offloaded inputs: every local rank's micro-batch, pinned and rounded on GPU ranks."""
    sizes = offloaded_input_sizes(spec, choice)
    local = hardware.gpus_per_node
    held = sum(sizes)
    how = "pageable host RAM (CPU ranks: a copy that replaces the rank's own)"
    if hardware.accelerator == "cuda":
        held += pinned_rounding_bytes(sizes)
        how = "pinned host RAM, each copy rounded up to a power of two by PyTorch's pinned allocator, which keeps the blocks for the next micro-batch"
    return Term(
        "offloaded activations",
        local * held,
        f"{local} ranks x {len(sizes)} checkpointed block inputs of one micro-batch ({_gib(held)} each rank), in {how}",
        TRAINING,
    )


# ---------------------------------------------------------------------------------------------
# Per GPU and per node


def generation_terms(spec: ModelSpec, choice: Choice, ranks: int = 1) -> list[Term]:
    """GRPO's sampling round: the whole model gathered once (ZeRO-3), the KV cache and one step's logits of every completion;
    and a full fine-tune's KL reference, a frozen copy of the weights (1/ranks of it per GPU under ZeRO-3), held throughout.

    Its own phase: the gathered weights are freed before the training forward pass starts. The
    reference copy is gathered whole for its forward pass after the policy's weights are freed:
    the same bytes as the policy's, not more at once.
    """
    shape, block = spec.generation, spec.block
    if shape is None:
        return []
    v = value_bytes(choice.precision)
    sequences = choice.micro_batch_size * shape.completions_per_example
    positions = choice.seq_len + shape.completion_tokens  # the prompt (up to data.max_seq_len) and the completion
    terms = []
    if shape.reference_copy:
        shards = ranks if choice.zero_stage == 3 else 1
        terms.append(Term("KL reference (frozen copy)", -(-spec.total_params * v // shards),
                          f"a full fine-tune's reference for grpo.beta: the weights again, without gradients or optimizer state"
                          f"{f', partitioned over {shards} GPUs' if shards > 1 else ''}"))
    if choice.zero_stage == 3:
        terms.append(Term("weights gathered for generation", spec.total_params * v,
                          "the whole model gathered once per round (engine.generation), not layer by layer per token"
                          + ("; then the reference copy's, as large, for its forward pass" if shape.reference_copy else ""), GENERATION))
    if block is not None:
        kv = 2 * spec.layers * block.kv_dim * sequences * positions * v
        terms.append(Term("KV cache of the completions", kv, f"{sequences} completions x {positions} positions x {spec.layers} layers of keys and values", GENERATION))
    if spec.vocab_size:
        terms.append(Term("sampling logits", sequences * spec.vocab_size * 4 * 2, "one position's logits per completion, in fp32, and their softmax", GENERATION))
    return terms


def bucket_elements(spec: ModelSpec) -> tuple[int, int]:
    """(reduce bucket, ZeRO-3 prefetch bucket) elements as zeropipe's DeepSpeed config sets them."""
    if spec.hidden_size:
        return spec.hidden_size * spec.hidden_size, int(0.9 * spec.hidden_size * spec.hidden_size)
    return DEFAULT_REDUCE_BUCKET_ELEMENTS, DEFAULT_PREFETCH_BUCKET_ELEMENTS


def per_gpu_terms(spec: ModelSpec, hardware: Hardware, choice: Choice) -> list[Term]:
    """Everything one rank's GPU holds; its peak is ``peak_bytes`` of these."""
    n = hardware.world_size
    v = value_bytes(choice.precision)
    stage = choice.zero_stage
    terms = model_state_terms(spec, n, choice)
    reduce_bucket, prefetch_bucket = bucket_elements(spec)
    trainable = spec.trainable_params
    if stage == 0:
        chunk = min(trainable, DEFAULT_ALLREDUCE_BUCKET_ELEMENTS)
        terms.append(
            Term(
                "all-reduce buffer",
                chunk * v,
                f"gradients flattened in chunks of up to {_count(DEFAULT_ALLREDUCE_BUCKET_ELEMENTS)} for the all-reduce",
                OPTIMIZER_STEP,
            )
        )
    else:
        # DeepSpeed allocates the buckets whole (torch.empty). GPU memory is taken at once; on
        # CPU ranks a page of host RAM is taken only when written, and a bucket never holds more
        # than the trainable gradients (LoRA's few million elements in a 5e8-element bucket).
        touched = reduce_bucket if hardware.accelerator != "cpu" else min(reduce_bucket, trainable)
        cpu_note = f"; on CPU ranks only the {_count(touched)} elements gradients are written to take RAM" if touched < reduce_bucket else ""
        if stage in (1, 2):
            terms.append(
                Term("reduce buckets", 2 * touched * v, f"two {_count(reduce_bucket)}-element gradient buckets (overlap_comm double-buffers them){cpu_note}")
            )
        else:
            terms.append(Term("reduce bucket", touched * v, f"one {_count(reduce_bucket)}-element gradient bucket for the reduce-scatter{cpu_note}"))
    if stage == 3:
        largest = spec.largest_layer_params
        # One rank with the weights on its GPU: DeepSpeed gathers nothing (its NoGatherHandle hands each layer
        # a view of the rank's own partition, which is the whole weight), so no gathered copy is made or kept.
        single = n == 1 and not choice.offload_param
        retained = 0 if single else zero3_retained_elements(spec, choice)
        whole = single or retained >= spec.total_params
        # With LoRA the largest layer is frozen: it is gathered but has no full gradient. When the
        # whole model stays gathered (below), its weights are counted there.
        # On CPU ranks the all-gather goes through gloo, which stages a second full copy of the
        # parameter while it gathers (measured: a 501 MiB parameter peaks at +1002 MiB on 4 ranks).
        copies = 2 if hardware.accelerator == "cpu" else 1
        gathered = (0 if whole else copies * largest) + (0 if spec.lora is not None else largest)
        what = "full weights" if spec.lora is not None else "full weights and gradient"
        if copies == 2 and not whole:
            what += ", twice while gloo gathers it (CPU ranks)"
        if whole:
            what = "full gradient" if spec.lora is None else "nothing more (every layer stays gathered, below)"
        if single:
            what = ("full gradient" if spec.lora is None else "nothing") + ": one rank holds every weight whole and DeepSpeed gathers none"
        # QLoRA: the largest module is the embedding or the output head, upcast to fp32; the
        # kept-gathered weights are counted at the base's mean bytes per weight.
        gathered_v = 4 if spec.quantized is not None else v
        retained_bytes = retained * v
        if spec.fp8_base is not None:
            # The gathers move the stored bytes: one per weight of a block linear.
            gathered_v = 1 if spec.largest_layer_params <= spec.fp8_base.largest_linear * 1.01 else v  # (its bias stays 16-bit)
            retained_bytes = math.ceil(retained * fp8_bytes_per_weight(spec, choice.precision))
        if spec.quantized is not None:
            base = spec.quantized
            retained_bytes = math.ceil(retained * quantized_base_bytes(base) / max(1, base.params_4bit + base.params_upcast))
        terms.append(
            Term(
                "gathered layer + prefetch (ZeRO-3)",
                gathered * gathered_v + (0 if whole else prefetch_bucket) * v,
                f"the largest layer's {what} ({_count(largest)} weights, {spec.largest_layer_name or 'largest module'})"
                + ("" if whole else f" plus a {_count(prefetch_bucket)}-element prefetch bucket"),
                FORWARD_BACKWARD,
            )
        )
        live, distance = choice.zero3_max_live_parameters, choice.zero3_reuse_distance
        terms.append(
            Term(
                "parameters kept gathered (ZeRO-3)",
                retained_bytes,
                (
                    f"from the second step on DeepSpeed prefetches and keeps gathered weights up to stage3_max_live_parameters "
                    f"({_count(live)}) and keeps those used again within stage3_max_reuse_distance ({_count(distance)}): "
                    f"{'the whole model' if whole else _count(retained) + ' weights'} whole on each rank by the end of the forward pass; "
                    "deepspeed.overrides: {zero_optimization: {stage3_max_live_parameters: 0, stage3_max_reuse_distance: 0}} "
                    "releases each layer after use, at the cost of gathering it again without prefetch"
                )
                if retained
                else f"stage3_max_live_parameters {live}, stage3_max_reuse_distance {distance}: each layer is released after use",
                FORWARD_BACKWARD,
            )
        )
    if spec.quantized is not None and stage == 3:
        # transformers builds a quantized model outside deepspeed.zero.Init: every rank first
        # loads the whole 4-bit base onto its device; DeepSpeed partitions it only in initialize.
        whole = quantized_base_bytes(spec.quantized)
        held = sum(t.bytes for t in quantized_base_terms(spec.quantized, n, choice))
        terms.append(
            Term(
                "whole 4-bit base while loading (QLoRA)",
                max(0, whole - held),
                f"transformers loads a quantized model without deepspeed.zero.Init: each rank holds the whole base "
                f"({_gib(whole)}: 4-bit layers, constants, fp32 upcasts) until DeepSpeed partitions it",
                LOADING,
            )
        )
    if choice.offload_optimizer and stage in (1, 2):
        terms.append(Term("offload staging buffer", spec.largest_parameter * v, "one parameter's gradient staged for the copy to host RAM"))
    step = optimizer_step_bytes(trainable, n, choice)
    if step:
        terms.append(
            Term("fp32 gradients in the optimizer step", step, "the step upcasts the rank's gradient share to fp32 while it runs", OPTIMIZER_STEP)
        )
    terms += activation_terms(spec, choice)
    terms += generation_terms(spec, choice, n)
    if spec.frozen_model_params:
        names = ", ".join(m.name for m in spec.frozen_models)
        terms.append(
            Term(
                "frozen models (text encoders, VAE)",
                frozen_model_bytes(spec.frozen_models, choice.precision),
                f"{names}: {_count(spec.frozen_model_params)} weights on every GPU to encode captions and images each step "
                f"(encoders in {'bf16' if choice.precision == 'bf16' else 'fp32'}, the VAE in fp32); "
                "caching latents and text embeddings removes them",
            )
        )
    if spec.cached_models:
        names = ", ".join(m.name for m in spec.cached_models)
        saved = frozen_model_bytes(spec.cached_models, choice.precision)
        terms.append(Term("frozen models (text encoders, VAE)", 0, f"{names} not loaded: their outputs are cached before training (saves {_gib(saved)} per GPU)"))
    if hardware.accelerator == "cuda":
        terms.append(
            Term("CUDA context", CUDA_CONTEXT_BYTES, "CUDA context, cuBLAS workspace and NCCL buffers: about 1 GiB on current drivers (assumed)")
        )
    if hardware.accelerator == "cuda" and any(not m.name.startswith("vae") for m in spec.cached_models):
        on_first, _streamed, where = cache_filling_placement(spec, hardware, choice.precision)
        always = sum(t.bytes for t in terms if t.phase == ALWAYS)
        names = ", ".join(m.name for m in spec.cached_models if not m.name.startswith("vae"))
        terms.append(
            Term(
                "text encoders while filling the caches (node setup)",
                max(0, on_first + CUDA_CONTEXT_BYTES - always),
                f"{names}: {_gib(frozen_model_bytes([m for m in spec.cached_models if not m.name.startswith('vae')], choice.precision))} "
                f"{where}, with a CUDA context, before any rank starts; counted as the part above what a rank always holds",
                CACHE_FILLING,
            )
        )
    working = sum(t.bytes for t in terms if t.phase == FORWARD_BACKWARD)
    terms.append(
        Term(
            "allocator fragmentation",
            int(FRAGMENTATION_FRACTION * working),
            f"{FRAGMENTATION_FRACTION:.0%} of the forward/backward working memory, which the caching allocator cannot always reuse (assumed)",
            FORWARD_BACKWARD,
        )
    )
    return terms


def zero3_retained_elements(spec: ModelSpec, choice: Choice) -> int:
    """Weights DeepSpeed's ZeRO-3 keeps gathered on every rank at the end of the forward pass, from the second step on.

    Once the first step has traced the order of modules, two rules keep gathered weights
    instead of releasing them (``PartitionedParameterCoordinator``): prefetching gathers
    weights ahead while fewer than ``stage3_max_live_parameters`` are available, and marks
    them as fetched for a later use, which keeps them from release until then; and a weight
    used again within ``stage3_max_reuse_distance`` elements of gathering is not released.
    Between forward and backward the next use of every layer is its backward, so both rules
    hold layers through the whole forward pass: measured on 2 CPU ranks (tiny Llama), 86% of
    all weights stay whole with DeepSpeed's defaults (1e9, 1e9) under LoRA, 76% (LoRA) and 57%
    (full fine-tune) with the reuse distance at 0 alone, about 1% with max_live_parameters at
    1e6 or prefetch off; backward releases them again. This counts min(all weights, max(max_live_parameters, reuse / 2)):
    with the defaults, a model under 1e9 parameters is whole on every rank at that moment,
    the very copy ZeRO-3 was chosen to avoid. (The first step, with no trace yet, releases
    every layer after use.)
    """
    if choice.zero_stage != 3:
        return 0
    bound = max(choice.zero3_max_live_parameters, choice.zero3_reuse_distance // 2, 0)
    return min(spec.total_params, bound)


def pinned_rounding_bytes(sizes: list[int]) -> int:
    """PyTorch's pinned-memory allocator rounds every block up to a power of two."""
    return sum((1 << (size - 1).bit_length()) - size for size in sizes if size > 0)


def _sub_groups(elements: int) -> list[int]:
    full, rest = divmod(elements, STAGE3_SUB_GROUP_ELEMENTS)
    return [STAGE3_SUB_GROUP_ELEMENTS] * full + ([rest] if rest else [])


def per_node_terms(spec: ModelSpec, hardware: Hardware, choice: Choice, per_gpu_peak: int | None = None) -> list[Term]:
    """Host RAM of one node: its ranks' processes, the loading peak, offloaded states, workers.

    Args:
        per_gpu_peak: on CPU ranks the "GPU" is host RAM too; pass the per-rank peak to add it.
    """
    local = hardware.gpus_per_node
    n = hardware.world_size
    v = value_bytes(choice.precision)
    trainable, everything = spec.trainable_params, spec.total_params
    terms: list[Term] = []
    process = RANK_PROCESS_BYTES.get(hardware.accelerator, RANK_PROCESS_BYTES["cuda"])
    terms.append(
        Term("rank processes", local * process, f"{local} x {_gib(process)}: Python, torch, DeepSpeed and the CUDA libraries per rank (assumed)")
    )

    frozen_models = frozen_model_bytes(spec.frozen_models, choice.precision)
    method = choice.loading_method
    if spec.fp8_base is not None:
        stored = fp8_stored_bytes(spec, choice.precision)
        if choice.zero_stage == 3:
            loading = local * (math.ceil(stored / n) + FP8_LOAD_BATCH_BYTES + frozen_models)
            why = (
                f"{local} ranks each partition the model's skeleton a batch at a time and quantize their own rows while reading them: "
                f"a 1/{n} share of the stored model ({_gib(math.ceil(stored / n))}) plus one batch; no full-precision copy"
            )
        else:
            loading = local * (stored + FP8_LOAD_BATCH_BYTES + frozen_models)
            why = f"{local} ranks each quantize the whole base while reading it row by row ({_gib(stored)} stored each)"
    elif spec.quantized is not None:
        # QLoRA: every rank reads the memory-mapped checkpoint tensor by tensor and quantizes it
        # onto its device (on CPU ranks that device is host RAM: the per-rank peak below holds it).
        loading = local * spec.largest_parameter * v
        why = (
            f"{local} ranks each stage one checkpoint tensor at a time ({_gib(spec.largest_parameter * v)}) while bitsandbytes "
            "quantizes it on the rank's device; every rank ends with the whole 4-bit base (no deepspeed.zero.Init for quantized models)"
        )
    elif method == "partitioned":
        share = (partition_elements(everything, n) + spec.largest_layer_params) * v
        loading = local * (share + frozen_models)
        why = (
            f"{local} ranks each build a 1/{n} share inside deepspeed.zero.Init plus one gathered layer "
            f"({_gib(share)} each); checkpoint files are memory-mapped (page cache, reclaimable)"
        )
    elif method == "staggered":
        loading = everything * v + local * frozen_models
        why = "one rank at a time holds the whole model in host RAM, then moves it to its GPU"
    else:
        loading = local * (everything * v + frozen_models)
        why = (
            f"{local} ranks each hold the whole model ({_gib(everything * v)}) in host RAM at once before DeepSpeed "
            "moves it to the GPU: the peak that gets rank 0 SIGKILLed"
        )
    if frozen_models:
        why += f"; with the frozen models ({_gib(frozen_models)} per rank)"
    terms.append(Term("model loading peak", loading, why, LOADING))

    if hardware.accelerator == "cuda" and any(not m.name.startswith("vae") for m in spec.cached_models):
        _on_first, streamed, where = cache_filling_placement(spec, hardware, choice.precision)
        if streamed:
            terms.append(Term("text encoders streamed from host RAM (node setup)", streamed, f"while the caches are filled: {where}", CACHE_FILLING))
    if choice.offload_optimizer and choice.zero_stage > 0:
        share = partition_elements(trainable, n)
        k = optimizer_bytes_per_parameter(choice.precision, choice.zero_stage, spec.optimizer)
        terms.append(
            Term(
                "offloaded optimizer states",
                local * share * k,
                f"{local} ranks x {_count(share)} weights x {k} bytes (fp32 master + Adam moments)",
                TRAINING,
            )
        )
        terms.append(Term("offloaded fp32 gradients", local * share * 4, f"{local} ranks x {_count(share)} fp32 gradients for CPU Adam", TRAINING))
        pinned = [share * 4, share * 4] if choice.zero_stage < 3 else [g * 4 for g in _sub_groups(share)] * 2 + [share * v]
        if choice.zero_stage == 3:
            terms.append(
                Term(
                    "offloaded gradient partition",
                    local * share * v,
                    f"{local} ranks x {_count(share)} 16-bit gradients (ZeRO-3 keeps them on the offload device)",
                    TRAINING,
                )
            )
        else:
            terms.append(
                Term(
                    "offload staging buffers",
                    local * (share + spec.largest_parameter) * v,
                    "16-bit copy of the updated partition and one parameter's gradient, per rank",
                    TRAINING,
                )
            )
            pinned.append(share * v)
        if hardware.accelerator == "cuda":
            terms.append(
                Term(
                    "pinned-memory rounding",
                    local * pinned_rounding_bytes(pinned),
                    "offloaded buffers are pinned, and PyTorch rounds each pinned block up to a power of two",
                    TRAINING,
                )
            )
    if choice.offload_param and choice.zero_stage == 3:
        share = partition_elements(everything, n)
        offloaded, what = share * v, "16-bit"
        if spec.fp8_base is not None:
            offloaded, what = math.ceil(fp8_stored_bytes(spec, choice.precision) / n), f"the block linears in {spec.fp8_base.format}, the rest 16-bit"
        if spec.quantized is not None:
            # QLoRA: the base's share is offloaded as it is held, 4-bit layers and fp32 upcasts.
            offloaded = math.ceil((quantized_base_bytes(spec.quantized) - quantization_constant_bytes(spec.quantized)) / n) + partition_elements(trainable, n) * v
            what = "the base as bitsandbytes holds it, the adapters 16-bit"
        terms.append(Term("offloaded parameters", local * offloaded, f"{local} ranks x a 1/{n} share of the weights, {what}", TRAINING))
        if hardware.accelerator == "cuda":
            terms.append(
                Term(
                    "pinned-memory rounding (parameters)",
                    local * pinned_rounding_bytes([math.ceil(g * (fp8_bytes_per_weight(spec, choice.precision) if spec.fp8_base is not None else v)) for g in _sub_groups(share)]),
                    "pinned parameter buffers rounded up to powers of two",
                    TRAINING,
                )
            )
    if choice.activation_offload and choice.gradient_checkpointing:
        terms.append(offloaded_activation_host_term(spec, hardware, choice))
    workers = DATA_WORKERS_PER_RANK.get(spec.family, 0)
    if any(m.name == "vae" for m in spec.cached_models):
        workers = 0  # cached latents are read, not decoded
    if workers:
        terms.append(
            Term(
                "data loader workers",
                local * workers * DATA_WORKER_BYTES,
                f"{local} ranks x {workers} workers x {_gib(DATA_WORKER_BYTES)} decoding images (assumed)",
                TRAINING,
            )
        )
    if hardware.accelerator == "cpu" and per_gpu_peak is not None:
        terms.append(
            Term(
                "CPU ranks' working memory",
                local * per_gpu_peak,
                f"{local} CPU ranks x the per-rank peak above: on CPU ranks it is host RAM",
                TRAINING,
            )
        )
    return terms


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"
