"""Pretrained weights loaded tensor by tensor, so that host RAM does not grow with the number of ranks.

The four steps below are one path that every family's loading takes. This module holds steps
2 and 4 and ``load_pretrained``, which runs them all; step 1, the checkpoint's index, is
``models.checkpoint_index``, step 3, the copies, ``models.tensor_copy``.

Five ranks each calling ``from_pretrained`` hold five copies of the model in host RAM before
DeepSpeed shards it, and the kernel kills rank 0 (USERS.md, failure 1). Here no rank ever
holds the whole model:

1. ``CheckpointIndex`` reads only the headers of the checkpoint (``model.safetensors``, or the
   shards named by ``model.safetensors.index.json``; ``pytorch_model.bin`` as a fallback): the
   name, dtype, shape and file of every tensor. It checks that no file is truncated and matches
   the tensors against the model's state dict before one byte of weights is read, and reports
   every problem (missing, unexpected, wrong shape) in one ``CheckpointError`` naming file and
   tensor. Every rank checks the same headers, so every rank fails the same way, before any
   collective call.
2. The model is constructed exactly as ``from_pretrained`` constructs it
   (``PreTrainedModel.get_init_context``): under ZeRO-3 inside ``deepspeed.zero.Init`` with
   weight initialisation disabled, so each parameter is partitioned as soon as its module
   exists and nothing is randomly initialised only to be overwritten; under ZeRO-0/1/2 on the
   meta device, so nothing is allocated.
3. Tensors are copied one at a time, in pieces of rows of at most ``READ_CHUNK_BYTES``, each
   under its own mapping of the memory-mapped file, so that the file pages a rank has mapped
   never exceed one piece. Under ZeRO-3 each rank reads only the rows that cover its own
   partition (``param.ds_tensor``) and no collective is needed; under ZeRO-0/1/2 each tensor is
   materialised straight on the rank's device. The copy converts dtypes element by element
   (bf16 on disk into an fp32 model, say), never as a whole-model copy. On a CPU device a
   tensor already in the right dtype is not copied at all: the parameter is a copy-on-write
   view of the mapped file, whose pages the ranks share (from_pretrained does the same).
4. The model is finished as ``from_pretrained`` finishes it: tied weights tied, the
   non-persistent buffers (rotary ``inv_freq``, embedding scales) recomputed by the model's own
   ``initialize_weights``, which skips every tensor that was loaded, and eval mode.

The steps are separate so that other families reuse them: a VLM is a transformers model and
goes through ``load_pretrained`` as it is; a diffusion model constructs itself under
``zero.Init`` or on the meta device, then calls ``CheckpointIndex(path, stem=...)``,
``CheckpointIndex.match`` and ``load_tensors``, and recomputes its own buffers.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import inspect
import logging
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropipe.errors import CheckpointError
from zeropipe.models.bnb_base import BitsAndBytesStorage, bnb_linear
from zeropipe.models.checkpoint_index import CheckpointIndex
from zeropipe.models.quantized import (
    BLOCK_SCALE_KEY,
    PREQUANTIZED_EXTRA_KEYS,
    SCALE_KEY,
    QuantizedLinear,
    QuantizedStorage,
    quantizable_linears,
    replace_linears,
)
from zeropipe.models.tensor_copy import StreamingUnsupported, is_zero3_param, load_quantized_tensors, load_tensors, owner_of

log = logging.getLogger("zeropipe")


# ---------------------------------------------------------------------- partitions


# ---------------------------------------------------------------------- quantized base
# How many bytes of a skeleton's parameters are materialised before zero.Init partitions them.
PARTITION_BATCH_BYTES = 64 * 2**20


def _quantized_skeleton(construct, index, path, rename, storage, select, zero_stage, ds_config, device, new_head: bool = False) -> tuple[nn.Module, dict[str, str]]:
    """The model as a skeleton with its block linears quantized, checked against the checkpoint; partitioned under ZeRO-3."""
    model = construct(on_meta=True)
    replace_linears(model, storage, quantizable_linears(model, select))
    sources = _plan(model, index, path, rename, new_head)
    if zero_stage == 3:
        _partition_skeleton(model, device, ds_config)
    return model, sources


def _load_bnb_base(construct, index, path, rename, storage: BitsAndBytesStorage, select, zero_stage: int, dtype: torch.dtype, device) -> tuple[nn.Module, int, int]:
    """A model whose block linears are bitsandbytes layers, each quantized from its checkpoint weight read whole, one layer at a time (ZeRO-0..2)."""
    if zero_stage == 3:
        raise ValueError(f"a {storage.format} (bitsandbytes) base is held whole by every rank: ZeRO-0..2 only (models.bnb_base says why)")
    model = construct(on_meta=True)
    names = quantizable_linears(model, select)
    sources = dict(_plan(model, index, path, rename))
    bytes_read = 0
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, leaf)
        tensors = {}
        for part in ("weight", "bias"):
            source = sources.pop(f"{name}.{part}", None)
            if source is not None:
                with index.read(source) as stored:
                    tensors[part] = stored.to(dtype, copy=True)
                bytes_read += index[source].nbytes
        setattr(parent, leaf, bnb_linear(old, tensors["weight"], tensors.get("bias"), storage, dtype, device))
    count = len(sources)
    bytes_read += load_tensors(model, index, sources, device=device)
    # peft wraps bitsandbytes layers in its own LoRA layers when the model says it holds them.
    model.is_loaded_in_4bit, model.is_loaded_in_8bit = storage.format != "int8", storage.format == "int8"
    return model, bytes_read, count + 2 * len(names)


def _partition_skeleton(model: nn.Module, device: torch.device, ds_config: dict | None) -> None:
    """Partition a meta skeleton's parameters with ``zero.Init(module=...)``, a batch of about PARTITION_BATCH_BYTES at a time.

    zero.Init's documented ``module`` argument partitions the parameters of an already built
    module as if it had been built inside the context; given a small holder of a few
    materialised parameters at a time, no rank holds more than one batch in full. Every rank
    walks the same parameters in the same order (each partitioning is a broadcast).
    """
    import deepspeed
    from transformers.integrations import deepspeed_config

    config = ds_config if ds_config is not None else deepspeed_config()
    batch: list[nn.Parameter] = []
    held = 0

    def flush() -> None:
        nonlocal batch, held
        if batch:
            holder = nn.ParameterList(batch)
            deepspeed.zero.Init(module=holder, config_dict_or_path=config, mem_efficient_linear=False)
        batch, held = [], 0

    made: dict[int, nn.Parameter] = {}  # a parameter shared by two modules (tied) is made once
    with _heap_returned(device.type == "cpu"):
        for module in model.modules():
            for leaf, param in list(module._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                if id(param) in made:
                    module._parameters[leaf] = made[id(param)]
                    continue
                real = made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad)
                module._parameters[leaf] = real
                batch.append(real)
                held += real.numel() * real.element_size()
                if held >= PARTITION_BATCH_BYTES:
                    flush()
        flush()


# ---------------------------------------------------------------------- transformers


def _signature_kwargs(function: Callable, **candidates: Any) -> dict[str, Any]:
    accepted = inspect.signature(function).parameters
    return {key: value for key, value in candidates.items() if key in accepted}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _zero3_visible(zero_stage: int, ds_config: dict | None) -> Iterator[None]:
    """Make transformers see the ZeRO-3 config while the model is constructed (or check it does not)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    enabled = is_deepspeed_zero3_enabled()
    if zero_stage == 3 and not enabled:
        if ds_config is None:
            raise ValueError("zero_stage=3 needs ds_config, or an HfDeepSpeedConfig kept alive by the caller (as the Trainer does)")
        from transformers.integrations import HfDeepSpeedConfig

        # Alive only while the model is constructed: keep your own HfDeepSpeedConfig for the
        # run when other transformers code (generate under ZeRO-3) must know about ZeRO-3.
        alive = HfDeepSpeedConfig(ds_config)  # noqa: F841 - transformers holds a weak reference to it
        yield
        return
    if zero_stage != 3 and enabled:
        raise ValueError(f"an HfDeepSpeedConfig for ZeRO-3 is alive but zero_stage={zero_stage}: the model would be partitioned")
    yield


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl...)
        return None


@contextlib.contextmanager
def _heap_returned(enabled: bool) -> Iterator[None]:
    """Return freed heap memory to the system before each new parameter while the model is constructed.

    zero.Init gives every new parameter a full-size buffer, broadcasts it and keeps only this
    rank's partition. On CPU ranks glibc serves those buffers from the heap once its dynamic
    mmap threshold has grown, and the holes they leave between the partitions are not given
    back: they added about 0.3x the checkpoint on 4 ranks (benchmarks/init_ram.py). Trimming
    before each parameter is allocated keeps only the one being built. With GPUs the buffers
    are GPU memory and this is off.
    """
    trim = _glibc_malloc_trim() if enabled else None
    if trim is None:
        yield
        return
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def before_next_parameter(module: nn.Module, name: str, param: Any) -> None:
        trim(0)

    handle = register_module_parameter_registration_hook(before_next_parameter)
    try:
        yield
    finally:
        handle.remove()
        trim(0)


def _construct(model_cls: type, config: Any, dtype: torch.dtype, *, on_meta: bool = False) -> nn.Module:
    """The model with no weights loaded, constructed with the contexts from_pretrained uses.

    ``on_meta`` builds it on the meta device even under ZeRO-3 (without ``zero.Init``): a
    skeleton whose keys and shapes are checked against the checkpoint before the partitioned
    construction, which takes collectives and time, starts.
    """
    context_kwargs = _signature_kwargs(
        model_cls.get_init_context, dtype=dtype, is_quantized=False, _is_ds_init_called=False, allow_all_kernels=False
    )
    contexts = list(model_cls.get_init_context(**context_kwargs))
    if on_meta:
        import deepspeed

        contexts = [c for c in contexts if not isinstance(c, (deepspeed.zero.Init, torch.device))] + [torch.device("meta")]
    with contextlib.ExitStack() as stack:
        if "dtype" not in context_kwargs:  # transformers 4.x sets the dtype outside get_init_context
            stack.enter_context(_default_dtype(dtype))
        for context in contexts:
            stack.enter_context(context)
        model = model_cls(config)
    try:
        from transformers.monkey_patching import patch_output_recorders
    except ImportError:
        pass
    else:
        patch_output_recorders(model)
    return model


def _construct_from_factory(
    factory: Callable[[], nn.Module], dtype: torch.dtype, zero_stage: int, ds_config: dict | None, *, on_meta: bool = False
) -> nn.Module:
    """A model from any factory: partitioned under zero.Init for ZeRO-3, else on the meta device."""
    with _default_dtype(dtype):
        if zero_stage == 3 and not on_meta:
            import deepspeed
            from transformers.integrations import deepspeed_config

            with deepspeed.zero.Init(config_dict_or_path=ds_config if ds_config is not None else deepspeed_config()):
                return factory()
        # Parameters on the meta device, buffers where they are computed (as diffusers'
        # from_pretrained builds its models): a buffer the model computes in __init__ and does
        # not save (Wan's rotary frequencies) keeps its values; the checkpoint fills the rest.
        # A skeleton (on_meta) is built the same way: a quantized base keeps it as the model.
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            return factory()


def _plan(model: nn.Module, index: CheckpointIndex, path: Path, rename: Callable[[str], str] | None = None, new_head: bool = False) -> dict[str, str]:
    """Model key -> checkpoint tensor for every tensor to load, or a CheckpointError listing every mismatch."""
    expected = _state_dict_shapes(model)
    tied = _tied_keys(model)
    ignore_missing, ignore_unexpected = _ignored_patterns(model)
    if new_head and getattr(model, "base_model_prefix", ""):
        # The head is every tensor outside the base model: the model's own one is initialised when the
        # checkpoint lacks it, the checkpoint's other one (a causal LM's lm_head) is left unread, as
        # from_pretrained does when it loads a causal LM as a sequence classifier.
        outside = rf"^(?!{re.escape(model.base_model_prefix)}\.)"
        ignore_missing, ignore_unexpected = [*ignore_missing, outside], [*ignore_unexpected, outside]
    quantized = any(isinstance(module, QuantizedLinear) for module in model.modules())
    if quantized:
        # A quantized layer's scale is computed from a full-precision checkpoint, or read beside
        # its weight from an fp8_scaled one (found by the weight's name, in any layout).
        expected = {key: shape for key, shape in expected.items() if not key.endswith("." + SCALE_KEY)}
        ignore_unexpected = [*ignore_unexpected, rf"(^|\.){SCALE_KEY}$", *PREQUANTIZED_EXTRA_KEYS]
    else:
        scaled = [name for name in index if name.rsplit(".", 1)[-1] in (SCALE_KEY, "scaled_fp8", BLOCK_SCALE_KEY)]
        if scaled:
            kind = "a fine-grained FP8 checkpoint" if scaled[0].endswith(BLOCK_SCALE_KEY) else "an fp8_scaled checkpoint"
            raise CheckpointError(
                f"{path} is {kind} ({scaled[0]}: its fp8 weights are stored divided by a scale): "
                "set model.quantization: fp8 to train on it as it is stored (fp8_e5m2 for an e5m2 file), or use a bf16/fp16 checkpoint"
            )
    sources = index.match(
        expected,
        model_name=type(model).__name__,
        rename=rename or _checkpoint_renamer(model, expected),
        tied=tied,
        ignore_missing=ignore_missing,
        ignore_unexpected=ignore_unexpected,
    )
    for target, source in tied.items():
        if target in sources and source in sources:
            # .bin checkpoints hold both tied tensors; from_pretrained ties them only when equal.
            if not index.equal(sources[target], sources[source]):
                raise CheckpointError(
                    f"config.json ties {target} to {source}, but {sources[target]} and {sources[source]} in {path} differ: "
                    "set tie_word_embeddings: false in config.json, or remove the extra tensor from the checkpoint"
                )
            del sources[target]
    return sources


def fine_grained_fp8_block(config: Any) -> tuple[int, int] | None:
    """The weight block of a transformers fine-grained FP8 checkpoint (config.json's quantization_config, quant_method fp8), else None."""
    quant = getattr(config, "quantization_config", None) if config is not None else None
    if quant is None:
        return None
    fields = quant if isinstance(quant, dict) else quant.to_dict()
    if fields.get("quant_method") != "fp8" or not fields.get("weight_block_size"):
        return None
    return tuple(int(size) for size in fields["weight_block_size"])


def _is_model_class(candidate: Any) -> bool:
    """A transformers model class or Auto class (anything else callable is a factory)."""
    return isinstance(candidate, type) and (hasattr(candidate, "get_init_context") or hasattr(candidate, "_model_mapping"))


def _resolve_class(model_cls_or_factory: Any, config: Any) -> type:
    """A concrete PreTrainedModel class: Auto classes resolve through their public mapping."""
    from transformers import PreTrainedModel

    if isinstance(model_cls_or_factory, type) and issubclass(model_cls_or_factory, PreTrainedModel):
        return model_cls_or_factory
    mapping = getattr(model_cls_or_factory, "_model_mapping", None)
    if mapping is not None:
        if getattr(config, "auto_map", None) and type(config) not in mapping:
            raise StreamingUnsupported("remote-code architectures (config.json auto_map)")
        try:
            return mapping[type(config)]
        except KeyError:
            raise ValueError(f"{model_cls_or_factory.__name__} has no model for {type(config).__name__}") from None
    raise TypeError(f"load_pretrained needs a transformers model class or Auto class, not {model_cls_or_factory!r}")


def _checkpoint_renamer(model: nn.Module, expected: Mapping[str, Any]) -> Callable[[str], str]:
    """Checkpoint name -> model key, with the renames from_pretrained applies (base-model prefix, legacy names)."""
    if not hasattr(model, "base_model_prefix"):  # not a transformers model: names are the state-dict keys
        return lambda name: name
    prefix = model.base_model_prefix or ""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4.x: only the base-model prefix is renamed
        def rename(name: str) -> str:
            if name in expected or not prefix:
                return name
            if name.startswith(prefix + ".") and name[len(prefix) + 1 :] in expected:
                return name[len(prefix) + 1 :]
            return f"{prefix}.{name}" if f"{prefix}.{name}" in expected else name

        return rename

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if converters:
        # Fused or split tensors (MoE experts...) are built from several checkpoint tensors.
        first = converters[0]
        raise StreamingUnsupported(f"weight conversions of {type(model).__name__} ({first.source_patterns} -> {first.target_patterns})")
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    present = dict.fromkeys(expected, True)
    return lambda name: rename_source_key(name, renamings, [], base_model_prefix=prefix or None, meta_state_dict=present)[0]


def _ignored_patterns(model: nn.Module) -> tuple[list[str], list[str]]:
    """Keys from_pretrained accepts missing / ignores when unexpected, for this model."""
    missing = list(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    unexpected = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    buffers = [name for name, _ in model.named_buffers()]
    # Old checkpoints saved these buffers, which are now non-persistent (from_pretrained does the same).
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        unexpected.append(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        unexpected.append(r"(^|\.)position_ids$")
    return missing, unexpected


def _tied_keys(model: nn.Module) -> dict[str, str]:
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is not None:
        return dict(tied)
    if not hasattr(model, "get_output_embeddings"):  # not a transformers model
        return {}
    # transformers 4.x: only input/output embeddings are tied.
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(config, "tie_word_embeddings", False) or model.get_output_embeddings() is None:
        return {}
    names = {id(module): name for name, module in model.named_modules()}
    return {f"{names[id(model.get_output_embeddings())]}.weight": f"{names[id(model.get_input_embeddings())]}.weight"}


def _state_dict_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(getattr(tensor, "ds_shape", tensor.shape)) for key, tensor in model.state_dict(keep_vars=True).items()}


def _finish(model: nn.Module, path: Path, device: torch.device | str) -> None:
    """Tie weights, recompute non-persistent buffers and initialise ignorable missing weights, as from_pretrained does."""
    if not hasattr(model, "initialize_weights"):
        # Not a transformers model: nothing recomputes what construction on the meta device lost.
        lost = [key for key, tensor in list(model.named_parameters()) + list(model.named_buffers()) if tensor.is_meta]
        if lost:
            raise ValueError(
                f"{type(model).__name__} has tensors the checkpoint does not hold and the meta device left empty: "
                f"{', '.join(lost[:5])}; build this model with transformers, or load it with zero_stage=3"
            )
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != torch.device(device):
                    module._buffers[name] = buffer.to(device)
        model.eval()
        return
    if "recompute_mapping" in inspect.signature(model.tie_weights).parameters:
        model.tie_weights(recompute_mapping=False)
    else:
        model.tie_weights()
    for key, tensor in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if tensor is not None and tensor.is_meta:
            # A buffer the model computes (inv_freq) or a weight the model may miss: given a
            # place here, given its values by initialize_weights below.
            module, leaf = owner_of(model, key)
            value = torch.empty_like(tensor, device=device)
            setattr(module, leaf, nn.Parameter(value, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else value)
    uninitialised = [p for p in model.parameters() if not getattr(p, "_is_hf_initialized", False)]
    if uninitialised and any(is_zero3_param(p) for p in uninitialised):
        import deepspeed

        # Rank 0 initialises the full weights the checkpoint may lack; the others receive them.
        with deepspeed.zero.GatheredParameters(uninitialised, modifier_rank=0):
            model.initialize_weights()
    elif hasattr(model, "initialize_weights"):
        # Skips every loaded tensor (flagged _is_hf_initialized): this recomputes the
        # non-persistent buffers from the config exactly as from_pretrained does.
        model.initialize_weights()
    model.config.name_or_path = str(path)
    if hasattr(model, "can_generate") and model.can_generate() and (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(path))
    model.eval()


def default_device() -> torch.device:
    """The rank's accelerator (the one DeepSpeed will train on), or the CPU."""
    if "deepspeed" in sys.modules:
        from deepspeed.accelerator import get_accelerator

        return torch.device(get_accelerator().current_device_name())
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_pretrained(
    model_cls_or_factory: Any,
    path: str | Path,
    *,
    dtype: torch.dtype,
    zero_stage: int,
    ds_config: dict | None = None,
    config: Any = None,
    attn_implementation: str | None = None,
    device: torch.device | str | None = None,
    stem: str = "model",
    rename: Callable[[str], str] | None = None,
    quantize: QuantizedStorage | BitsAndBytesStorage | None = None,
    quantize_select: Callable[[str], bool] | None = None,
    new_head: bool = False,
) -> nn.Module:
    """A model with the weights of a local checkpoint, loaded without a whole-model copy in host RAM.

    Args:
        model_cls_or_factory: a PreTrainedModel class or an Auto class (``AutoModelForCausalLM``):
            constructed as from_pretrained constructs it, from ``config``. Or a function that
            builds any ``nn.Module`` in the current dtype (a diffusers UNet from its config,
            say): called under ``zero.Init`` (stage 3), or with its parameters on the meta device
            and its buffers computed (accelerate's init_empty_weights, as diffusers does); its
            parameters must all be in the checkpoint unless it is a transformers model.
        path: local Hugging Face model directory (config.json + safetensors).
        dtype: dtype of the model's parameters; the checkpoint's are converted tensor by tensor.
        zero_stage: 3 constructs the model partitioned under ``deepspeed.zero.Init`` and fills
            each rank's partitions; 0-2 materialise every tensor on ``device``.
        ds_config: the DeepSpeed config, needed for stage 3 unless the caller keeps an
            ``HfDeepSpeedConfig`` alive (then that one is used).
        config: the transformers config (read from ``path`` when not given).
        attn_implementation: attention kernel set on the config ("sdpa", "eager").
        device: where stage 0-2 parameters are materialised; the rank's accelerator by default.
        stem: file name of the weights without extension (diffusers: "diffusion_pytorch_model").
        rename: checkpoint tensor name -> model key, for checkpoints in another layout (a
            single-file original checkpoint, renamed with diffusers' converter); the tensors
            are still read one by one, each rank only its partitions under ZeRO-3.
        quantize: store the linear layers of the repeated blocks (``quantize_select`` picks
            others) in fp8 (``models.quantized``): the model is built as a meta skeleton, those
            layers are swapped for ``QuantizedLinear``, and each rank quantizes its own rows
            while streaming them from a bf16/fp16/fp32 checkpoint, or copies the bytes and
            ``scale_weight`` keys of an fp8 (ComfyUI ``fp8_scaled``) one. Under ZeRO-3 the
            skeleton is partitioned a few modules at a time (``zero.Init(module=...)``), so no
            rank ever holds a full-precision copy of the model, nor its own partitions of one.
        new_head: the model's head (its tensors outside ``base_model_prefix``) is not the
            checkpoint's: a causal LM's checkpoint loaded as a reward model's sequence classifier.
            The head the checkpoint lacks is initialised, the one it has that the model lacks
            (``lm_head``) is not read; every base-model tensor must still match.
            A ``BitsAndBytesStorage`` (nf4, fp4, int8; ZeRO-0..2) swaps those layers for
            bitsandbytes' instead, each quantized from its weight read whole (``models.bnb_base``).

    Returns:
        The model in eval mode, as ``from_pretrained`` returns it, with the same values.

    Raises:
        CheckpointError: missing, unexpected or wrong-shaped tensors, truncated or damaged
            files, each named with file and tensor, raised before any weight is read.
    """
    path = Path(path)
    started = time.perf_counter()
    if _is_model_class(model_cls_or_factory):
        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(path))
        config = copy.deepcopy(config)
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        if hasattr(config, "dtype"):
            config.dtype = dtype
    device = torch.device(device) if device is not None else default_device()
    index = CheckpointIndex(path, stem=stem)  # a damaged checkpoint fails here, before the model is built
    try:
        if _is_model_class(model_cls_or_factory):
            model_cls = _resolve_class(model_cls_or_factory, config)

            def construct(on_meta: bool = False) -> nn.Module:
                return _construct(model_cls, config, dtype, on_meta=on_meta)
        else:

            def construct(on_meta: bool = False) -> nn.Module:
                return _construct_from_factory(model_cls_or_factory, dtype, zero_stage, ds_config, on_meta=on_meta)

        if isinstance(quantize, BitsAndBytesStorage):
            model, bytes_read, count = _load_bnb_base(construct, index, path, rename, quantize, quantize_select, zero_stage, dtype, device)
            _finish(model, path, device)
            log.info("loaded %d tensors from %s in %.1fs, linear layers of the blocks stored as %s (bitsandbytes); this rank read %.1f MB",
                     count, path, time.perf_counter() - started, quantize.format, bytes_read / 1e6)
            return model
        if quantize is not None:
            with _zero3_visible(zero_stage, ds_config):
                model, sources = _quantized_skeleton(construct, index, path, rename, quantize, quantize_select, zero_stage, ds_config, device, new_head)
            bytes_read = load_quantized_tensors(model, index, sources, quantize, device=device, weight_block=fine_grained_fp8_block(config))
            _finish(model, path, device)
            log.info("loaded %d tensors from %s in %.1fs, linear layers of the blocks stored as %s; this rank read %.1f MB",
                     len(sources), path, time.perf_counter() - started, quantize.format, bytes_read / 1e6)
            return model
        with _zero3_visible(zero_stage, ds_config):
            if zero_stage == 3:
                # Checked on a meta skeleton first: a mismatch fails in seconds, not after zero.Init.
                sources = _plan(construct(on_meta=True), index, path, rename, new_head)
            with _heap_returned(zero_stage == 3 and device.type == "cpu"):
                model = construct()
        log.debug("constructed %s (%s)", type(model).__name__, "partitioned by zero.Init" if zero_stage == 3 else "on the meta device")
        if zero_stage != 3:
            sources = _plan(model, index, path, rename, new_head)
        bytes_read = load_tensors(model, index, sources, device=device)
    except StreamingUnsupported as reason:
        if not _is_model_class(model_cls_or_factory):
            raise ValueError(f"{path}: {reason} cannot be loaded tensor by tensor") from None
        if quantize is not None:
            # from_pretrained would load it in 16 bits: never a silent change of the storage asked for.
            raise CheckpointError(
                f"{path}: {reason} cannot be loaded tensor by tensor, which the {quantize.format} base needs (each rank quantizes its own rows): "
                "remove model.quantization to train LoRA on the 16-bit base"
            ) from None
        log.warning("%s: %s cannot be loaded tensor by tensor; using transformers' from_pretrained (higher host RAM peak)", path, reason)
        with _zero3_visible(zero_stage, ds_config):
            return model_cls_or_factory.from_pretrained(str(path), config=config, dtype=dtype)
    _finish(model, path, device)
    log.info(
        "loaded %d tensors (%.1f MB on disk) from %s in %.1fs; this rank read or mapped %.1f MB%s",
        len(sources), index.total_bytes / 1e6, path, time.perf_counter() - started, bytes_read / 1e6,
        " (its ZeRO-3 partitions)" if zero_stage == 3 else "",
    )
    return model
