"""The memory model's peaks (``plan.memory``): every term of one GPU and of one node, by phase.

``per_gpu_terms`` and ``per_node_terms`` add the model states (``plan.memory``), the activations
(``plan.activations``), the buffers DeepSpeed allocates and the process overheads; ``plan.memory.peak_bytes``
turns either list into the peak the planner compares with the hardware.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from zeropipe.plan.activations import activation_terms, offloaded_activation_host_term, pinned_rounding_bytes
from zeropipe.plan.hardware import Hardware
from zeropipe.plan.memory import (
    ALWAYS,
    CACHE_FILLING,
    CUDA_CONTEXT_BYTES,
    DATA_WORKERS_PER_RANK,
    DATA_WORKER_BYTES,
    DEFAULT_ALLREDUCE_BUCKET_ELEMENTS,
    DEFAULT_PREFETCH_BUCKET_ELEMENTS,
    DEFAULT_REDUCE_BUCKET_ELEMENTS,
    FORWARD_BACKWARD,
    FP8_LOAD_BATCH_BYTES,
    FRAGMENTATION_FRACTION,
    GENERATION,
    LOADING,
    OPTIMIZER_STEP,
    RANK_PROCESS_BYTES,
    STAGE3_SUB_GROUP_ELEMENTS,
    TRAINING,
    Choice,
    Term,
    cache_filling_placement,
    count_text,
    fp8_bytes_per_weight,
    fp8_stored_bytes,
    frozen_model_bytes,
    gib_text,
    model_state_terms,
    optimizer_bytes_per_parameter,
    optimizer_step_bytes,
    partition_elements,
    quantization_constant_bytes,
    quantized_base_bytes,
    quantized_base_terms,
    value_bytes,
)

if TYPE_CHECKING:
    from zeropipe.plan.model_spec import ModelSpec


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
                f"gradients flattened in chunks of up to {count_text(DEFAULT_ALLREDUCE_BUCKET_ELEMENTS)} for the all-reduce",
                OPTIMIZER_STEP,
            )
        )
    else:
        # DeepSpeed allocates the buckets whole (torch.empty). GPU memory is taken at once; on
        # CPU ranks a page of host RAM is taken only when written, and a bucket never holds more
        # than the trainable gradients (LoRA's few million elements in a 5e8-element bucket).
        touched = reduce_bucket if hardware.accelerator != "cpu" else min(reduce_bucket, trainable)
        cpu_note = f"; on CPU ranks only the {count_text(touched)} elements gradients are written to take RAM" if touched < reduce_bucket else ""
        if stage in (1, 2):
            terms.append(
                Term("reduce buckets", 2 * touched * v, f"two {count_text(reduce_bucket)}-element gradient buckets (overlap_comm double-buffers them){cpu_note}")
            )
        else:
            terms.append(Term("reduce bucket", touched * v, f"one {count_text(reduce_bucket)}-element gradient bucket for the reduce-scatter{cpu_note}"))
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
                f"the largest layer's {what} ({count_text(largest)} weights, {spec.largest_layer_name or 'largest module'})"
                + ("" if whole else f" plus a {count_text(prefetch_bucket)}-element prefetch bucket"),
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
                    f"({count_text(live)}) and keeps those used again within stage3_max_reuse_distance ({count_text(distance)}): "
                    f"{'the whole model' if whole else count_text(retained) + ' weights'} whole on each rank by the end of the forward pass; "
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
                f"({gib_text(whole)}: 4-bit layers, constants, fp32 upcasts) until DeepSpeed partitions it",
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
                f"{names}: {count_text(spec.frozen_model_params)} weights on every GPU to encode captions and images each step "
                f"(encoders in {'bf16' if choice.precision == 'bf16' else 'fp32'}, the VAE in fp32); "
                "caching latents and text embeddings removes them",
            )
        )
    if spec.cached_models:
        names = ", ".join(m.name for m in spec.cached_models)
        saved = frozen_model_bytes(spec.cached_models, choice.precision)
        terms.append(Term("frozen models (text encoders, VAE)", 0, f"{names} not loaded: their outputs are cached before training (saves {gib_text(saved)} per GPU)"))
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
                f"{names}: {gib_text(frozen_model_bytes([m for m in spec.cached_models if not m.name.startswith('vae')], choice.precision))} "
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
        Term("rank processes", local * process, f"{local} x {gib_text(process)}: Python, torch, DeepSpeed and the CUDA libraries per rank (assumed)")
    )

    frozen_models = frozen_model_bytes(spec.frozen_models, choice.precision)
    method = choice.loading_method
    if spec.fp8_base is not None:
        stored = fp8_stored_bytes(spec, choice.precision)
        if choice.zero_stage == 3:
            loading = local * (math.ceil(stored / n) + FP8_LOAD_BATCH_BYTES + frozen_models)
            why = (
                f"{local} ranks each partition the model's skeleton a batch at a time and quantize their own rows while reading them: "
                f"a 1/{n} share of the stored model ({gib_text(math.ceil(stored / n))}) plus one batch; no full-precision copy"
            )
        else:
            loading = local * (stored + FP8_LOAD_BATCH_BYTES + frozen_models)
            why = f"{local} ranks each quantize the whole base while reading it row by row ({gib_text(stored)} stored each)"
    elif spec.quantized is not None:
        # QLoRA: every rank reads the memory-mapped checkpoint tensor by tensor and quantizes it
        # onto its device (on CPU ranks that device is host RAM: the per-rank peak below holds it).
        loading = local * spec.largest_parameter * v
        why = (
            f"{local} ranks each stage one checkpoint tensor at a time ({gib_text(spec.largest_parameter * v)}) while bitsandbytes "
            "quantizes it on the rank's device; every rank ends with the whole 4-bit base (no deepspeed.zero.Init for quantized models)"
        )
    elif method == "partitioned":
        share = (partition_elements(everything, n) + spec.largest_layer_params) * v
        loading = local * (share + frozen_models)
        why = (
            f"{local} ranks each build a 1/{n} share inside deepspeed.zero.Init plus one gathered layer "
            f"({gib_text(share)} each); checkpoint files are memory-mapped (page cache, reclaimable)"
        )
    elif method == "staggered":
        loading = everything * v + local * frozen_models
        why = "one rank at a time holds the whole model in host RAM, then moves it to its GPU"
    else:
        loading = local * (everything * v + frozen_models)
        why = (
            f"{local} ranks each hold the whole model ({gib_text(everything * v)}) in host RAM at once before DeepSpeed "
            "moves it to the GPU: the peak that gets rank 0 SIGKILLed"
        )
    if frozen_models:
        why += f"; with the frozen models ({gib_text(frozen_models)} per rank)"
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
                f"{local} ranks x {count_text(share)} weights x {k} bytes (fp32 master + Adam moments)",
                TRAINING,
            )
        )
        terms.append(Term("offloaded fp32 gradients", local * share * 4, f"{local} ranks x {count_text(share)} fp32 gradients for CPU Adam", TRAINING))
        pinned = [share * 4, share * 4] if choice.zero_stage < 3 else [g * 4 for g in _sub_groups(share)] * 2 + [share * v]
        if choice.zero_stage == 3:
            terms.append(
                Term(
                    "offloaded gradient partition",
                    local * share * v,
                    f"{local} ranks x {count_text(share)} 16-bit gradients (ZeRO-3 keeps them on the offload device)",
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
                f"{local} ranks x {workers} workers x {gib_text(DATA_WORKER_BYTES)} decoding images (assumed)",
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
