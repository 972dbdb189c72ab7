"""The memory model's activation terms (``plan.memory``): what the forward pass saves for backward, and what activation offload moves to host RAM.

Pure functions of the model's shape and the choice, like the rest of the memory model; the
per-GPU and per-node peaks (``plan.totals``) add them to the model states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zeropipe.plan.hardware import Hardware
from zeropipe.plan.memory import FORWARD_BACKWARD, TRAINING, Choice, Term, gib_text, value_bytes

if TYPE_CHECKING:
    from zeropipe.plan.model_spec import BlockShape, LoraShape, ModelSpec


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


# parallel.tiled_loss: auto tiles the loss when one micro-batch's fp32 logits on one rank would exceed this.
AUTO_TILED_LOSS_BYTES = 1 << 30


def loss_tile_tokens(setting: bool | str, tokens: int, vocab: int, tile: int) -> int:
    """Tokens per tile of the LM loss for ``parallel.tiled_loss`` (true, false or "auto"), or 0 for the untiled loss.

    ``tokens``: the micro-batch's tokens on one rank (after the sequence-parallel split). The runtime
    (families/causal_lm/tiled_loss.py) and the planner decide with this same rule.
    """
    if setting is False or setting == "off" or not vocab or tile <= 0:
        return 0
    if setting is True or setting == "on" or tokens * vocab * 4 > AUTO_TILED_LOSS_BYTES:
        return min(tile, tokens)
    return 0


def loss_activation_bytes(block: BlockShape, vocab: int, tokens: int, precision: str, frozen: bool, tile: int = 0) -> tuple[int, int]:
    """(saved for backward, transient) bytes of the final norm, LM head, logits and loss.

    Untiled (``tile`` 0): transformers' loss upcasts the logits to fp32 and log-softmax saves its
    fp32 output: 4·s·b·V saved; at the peak the 16-bit logits and their fp32 copy exist too.
    Tiled (``parallel.tiled_loss``): nothing of the logits is saved; one tile's logits exist at a
    time, in forward and again when backward recomputes them (16-bit logits, their fp32 copy, the
    fp32 log-softmax and its gradient), and backward holds the fp32-free input gradient of the
    hidden states (s·b·h, in the training precision).
    """
    v = value_bytes(precision)
    norm = v if block.layernorm else 4 + (0 if frozen else (4 if block.norm_upcasts_weight else v))
    saved = tokens * block.hidden * norm
    if tile:
        saved += tokens * block.hidden * v  # the hidden states the tiled loss keeps (the LM head's input)
        transient = min(tile, tokens) * vocab * (v + 4 + 4 + (4 if v != 4 else 0)) + tokens * block.hidden * v
        return saved, transient
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
        saved, _ = loss_activation_bytes(spec.block, spec.vocab_size or 0, tokens, choice.precision, spec.lora is not None, _tile(spec, choice, tokens))
        return layers + saved
    if spec.activation_trace is not None:
        trace = spec.activation_trace
        per_sample = trace.checkpointed_bytes if choice.gradient_checkpointing else trace.saved_bytes
        return per_sample * choice.micro_batch_size * spec.sequences_per_example * _trace_scale(trace, choice) // choice.sequence_parallel
    return 0


def _tile(spec: ModelSpec, choice: Choice, tokens: int) -> int:
    return loss_tile_tokens(choice.tiled_loss, tokens, spec.vocab_size or 0, choice.loss_tile_tokens)


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
                    f"{spec.layers} layers x {gib_text(full)} (s={s}{split}, b={b}, h={block.hidden}); per token and layer "
                    f"{full // max(tokens, 1):,} bytes, counted tensor by tensor; {attention}"
                    + ("; frozen base layers save no inputs, adapters save theirs" if spec.lora else ""),
                    FORWARD_BACKWARD,
                )
            )
        tile = _tile(spec, choice, tokens)
        saved, transient = loss_activation_bytes(block, spec.vocab_size or 0, tokens, choice.precision, spec.lora is not None, tile)
        terms.append(
            Term(
                "logits and loss",
                saved + transient,
                (
                    f"tiled (parallel.tiled_loss): one tile of {tile:,} tokens x {spec.vocab_size:,} logits at a time, recomputed in "
                    f"backward, instead of s·b·V = {tokens:,} x {spec.vocab_size:,}; plus the kept hidden states and the final norm"
                    if tile
                    else f"s·b·V = {tokens:,} x {spec.vocab_size:,}: 16-bit logits, their fp32 copy in the loss and the fp32 log-softmax "
                    "saved for backward, plus the final norm"
                ),
                FORWARD_BACKWARD,
            )
        )
    elif spec.activation_trace is not None:
        trace = spec.activation_trace
        # Sequence parallelism: each rank of a group holds 1/N of the latent tokens (the text, whole on every rank, is a small share).
        scale = b * _trace_scale(trace, choice) / choice.sequence_parallel
        clip = f" x {trace.frames} frames" if trace.frames > 1 else ""
        # An objective that calls the denoiser on each example more than once with gradient (the flow map: twice) says so.
        calls = f" ({choice.micro_batch_size} x {spec.sequences_per_example}: the loss's call with gradient takes each example {spec.sequences_per_example} times)" if spec.sequences_per_example > 1 else ""
        where = f"traced on the meta device at {trace.resolution}x{trace.resolution} px{clip}, x {b} samples{calls}{split}"
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
            f"{gib_text(moved)} of block inputs wait in host RAM (train.activation_offload); on the GPU: what is saved outside the "
            f"checkpointed blocks ({gib_text(outside)}) and the inputs of the block being recomputed, brought back ({gib_text(per_block)})",
            FORWARD_BACKWARD,
        )
    largest = max(sizes, default=0)
    return Term(
        "activations (checkpointed layer inputs, offloaded)",
        largest,
        f"{len(sizes)} inputs ({gib_text(moved)}) wait in host RAM (train.activation_offload); the one of the layer being recomputed "
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
        f"{local} ranks x {len(sizes)} checkpointed block inputs of one micro-batch ({gib_text(held)} each rank), in {how}",
        TRAINING,
    )


def pinned_rounding_bytes(sizes: list[int]) -> int:
    """PyTorch's pinned-memory allocator rounds every block up to a power of two."""
    return sum((1 << (size - 1).bit_length()) - size for size in sizes if size > 0)
