"""Vision-language models through transformers' ``AutoModelForImageTextToText`` and ``AutoProcessor``.

A VLM is three parts: a vision tower that turns an image into features, a projector that maps
them into the language model's embedding space, and the language model that reads them as
tokens. ``model.trainable`` names the parts that train; every parameter of the other parts is
frozen (``requires_grad`` off) and is not handed to DeepSpeed, so it has no gradient and no
optimizer state. With ``model.lora`` the adapters go on the chosen parts only.

Parts are found by module name, not by class: transformers names them the same way across
architectures (``vision_tower``/``vision_model``/``visual``, ``multi_modal_projector``/
``connector``/``merger``, ``language_model``/``text_model`` + ``lm_head``), and the deepest
matching name wins, so Qwen2-VL's ``visual.merger`` is its projector although it sits inside
the vision module. A parameter that matches no part is an error, never silently frozen.

For randomly initialised models (``model.config``) the processor is built here, offline:
the image processor from its class with the vision tower's image size, and a byte-level BPE
tokenizer trained on the data with the architecture's image tokens added as special tokens;
the token ids are then written into the model config so that the two agree. LLaVA and
Gemma 3 are built this way; any architecture works with a saved processor (``model.path`` or
``model.processor``).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeropipe.config.schema import LoraSection, ModelSection
from zeropipe.data.tokenizer import train_tokenizer
from zeropipe.errors import ConfigError
from zeropipe.models.adapters import adapter_parameter_sizes, is_adapter_parameter, peft_adapter_config
from zeropipe.models.checkpointing import enable_checkpointing
from zeropipe.models.common import TORCH_DTYPES, full_precision_kwargs, is_lora_target, model_config
from zeropipe.models.loading import load_pretrained
from zeropipe.models.quantized import BLOCK_LINEAR, QuantizedStorage

PARTS = ("vision_tower", "projector", "language_model")
DEFAULT_TRAINABLE = ("projector", "language_model")

# Module names transformers gives each part (LLaVA, LLaVA-NeXT, Gemma 3, Mllama: vision_tower or
# vision_model, multi_modal_projector, language_model; Idefics3/SmolVLM: vision_model, connector,
# text_model; Qwen2-VL/2.5-VL: visual, whose merger is the projector).
PART_MODULE_NAMES: dict[str, tuple[str, ...]] = {
    "vision_tower": ("vision_tower", "vision_model", "visual", "vision_encoder"),
    "projector": ("multi_modal_projector", "mm_projector", "connector", "merger", "image_newline"),
    "language_model": ("language_model", "text_model", "lm_head"),
}

# LoRA's "auto" targets per part: the attention projections (CLIP and SigLIP call the output
# one out_proj), and every linear layer of the small projector.
LORA_AUTO_TARGETS: dict[str, tuple[str, ...] | None] = {
    "vision_tower": ("q_proj", "k_proj", "v_proj", "out_proj", "o_proj", "qkv", "proj"),
    "projector": None,  # None: every linear layer
    "language_model": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


@dataclass(frozen=True)
class OfflineProcessor:
    """How to build an architecture's processor without downloading anything."""

    tokens: dict[str, str]  # tokenizer attribute -> special token (image_token: "<image>", ...)
    config_ids: dict[str, str]  # model config field -> tokenizer attribute whose id it must hold
    build: str  # name of the builder below


OFFLINE_PROCESSORS: dict[str, OfflineProcessor] = {
    "llava": OfflineProcessor(tokens={"image_token": "<image>"}, config_ids={"image_token_id": "image_token"}, build="llava"),
    "gemma3": OfflineProcessor(
        tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
        config_ids={"image_token_id": "image_token", "boi_token_id": "boi_token", "eoi_token_id": "eoi_token"},
        build="gemma3",
    ),
}


# ---------------------------------------------------------------------------------------------
# Parts and what trains


def trainable_parts(section: ModelSection) -> tuple[str, ...]:
    """model.trainable, or the default (projector and language model: the usual LLaVA fine-tune)."""
    if section.trainable is None:
        return DEFAULT_TRAINABLE
    if not section.trainable:
        raise ConfigError([("model.trainable", "is empty, so nothing would train: name at least one of vision_tower, projector, language_model")])
    return tuple(dict.fromkeys(section.trainable))


def part_of(name: str) -> str | None:
    """The part a parameter or module belongs to, from its dotted name (peft's prefixes are ignored)."""
    components = name.split(".")
    for component in reversed(components):
        for part, names in PART_MODULE_NAMES.items():
            if component in names:
                return part
    return None


def parameters_by_part(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """Every parameter of the model grouped by part (tied parameters once, as DeepSpeed sees them).

    Raises:
        ConfigError: a parameter belongs to no known part (an architecture this does not know).
    """
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {part: [] for part in PARTS}
    unknown = []
    for name, param in model.named_parameters():
        if is_adapter_parameter(name):
            continue  # adapters are counted with what they adapt by the caller, not here
        part = part_of(name)
        if part is None:
            unknown.append(name)
        else:
            groups[part].append((name, param))
    if unknown:
        raise ConfigError(
            [
                (
                    "model.trainable",
                    f"{type(model).__name__} has parameters outside the vision tower, projector and language model "
                    f"({', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}): this architecture's parts are not known",
                )
            ]
        )
    return groups


def part_prefixes(model: torch.nn.Module) -> dict[str, list[str]]:
    """Module-name prefixes of each part (e.g. projector: model.multi_modal_projector), for messages and tests."""
    prefixes: dict[str, set[str]] = {part: set() for part in PARTS}
    for part, params in parameters_by_part(model).items():
        for name, _ in params:
            components = name.split(".")
            # The deepest component naming the part ends the prefix.
            for index in range(len(components) - 1, -1, -1):
                if components[index] in PART_MODULE_NAMES[part]:
                    prefixes[part].add(".".join(components[: index + 1]))
                    break
    return {part: sorted(names) for part, names in prefixes.items()}


def numel(param: torch.Tensor) -> int:
    """Elements of a parameter, also when ZeRO-3 has partitioned it away."""
    return int(getattr(param, "ds_numel", None) or param.numel())


def freeze_parts(model: torch.nn.Module, trainable: tuple[str, ...]) -> None:
    """requires_grad on for the parameters of the trainable parts, off for every other one (an fp8 base's byte weights stay frozen)."""
    for part, params in parameters_by_part(model).items():
        for _, param in params:
            param.requires_grad_(part in trainable and param.is_floating_point())


def language_model_block(name: str) -> bool:
    """The linear layers an fp8 VLM base stores in 8 bits: those of the language model's repeated blocks.

    The vision tower and the projector stay in the training precision: they are a small share of
    the weights (Gemma 3 27B, counted on the meta device from the planner's catalog config: the
    SigLIP tower 0.42B of 27.4B, while 25.6B language-model block weights go to fp8; Qwen2.5-VL 7B's
    tower is 0.7B of 8.3B as published), a curriculum trains them in full (model.trainable:
    vision_tower, projector), which fp8 weights cannot, and image features are what every answer reads.
    """
    return part_of(name) == "language_model" and bool(BLOCK_LINEAR.search(name))


def part_counts(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """{part: {"total": n, "trainable": n}}; a part's LoRA adapters count as its trainable parameters."""
    counts = {part: {"total": 0, "trainable": 0} for part in PARTS}
    for name, param in model.named_parameters():
        part = part_of(name)
        if part is None:
            continue
        if not is_adapter_parameter(name):
            counts[part]["total"] += numel(param)
        if param.requires_grad:
            counts[part]["trainable"] += numel(param)
    return counts


def lora_module_names(model: torch.nn.Module, lora: LoraSection, parts: tuple[str, ...]) -> list[str]:
    """The full names of the linear layers LoRA adapts: model.lora.target_modules within the chosen parts.

    Raises:
        ConfigError: a chosen part has none of the named layers (listing the ones it has).
    """
    chosen: list[str] = []
    problems = []
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for part in parts:
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and part_of(n) == part and m is not output]
        if lora.target_modules == "all-linear":
            names = [n for n, _ in linears]
        elif isinstance(lora.target_modules, str) and lora.target_modules != "auto":
            # A regular expression over whole module names (axolotl's vision recipes name the language model's layers so).
            names = [n for n, _ in linears if is_lora_target(n, lora.target_modules)]
        else:
            targets = LORA_AUTO_TARGETS[part] if lora.target_modules == "auto" else tuple(lora.target_modules)
            names = [n for n, _ in linears if targets is None or n.rsplit(".", 1)[-1] in targets or any(n.endswith("." + t) for t in targets)]
        if not names and not linears:
            # Gemma 3's projector is a bare weight matrix: there is nothing for LoRA to adapt.
            problems.append(
                (
                    "model.trainable",
                    f"the {part} of {type(model).__name__} has no linear layer for LoRA adapters: take {part} out of model.trainable "
                    "in LoRA runs (train it in full in a run or stage without model.lora)",
                )
            )
        elif not names:
            available = sorted({n.rsplit(".", 1)[-1] for n, _ in linears})
            problems.append(
                (
                    "model.lora.target_modules",
                    f"{lora.target_modules} match no linear layer of the {part}; its linear layers are: {', '.join(available)}. "
                    "Name some of them, use auto or all-linear, or take the part out of model.trainable",
                )
            )
        chosen += names
    if problems:
        raise ConfigError(problems)
    return chosen


def add_vlm_lora(model: torch.nn.Module, section: ModelSection) -> torch.nn.Module:
    """LoRA adapters on the chosen parts; everything else, the rest of those parts included, frozen."""
    from peft import get_peft_model

    lora = section.lora
    assert lora is not None
    targets = lora_module_names(model, lora, trainable_parts(section))
    peft_config = peft_adapter_config(lora, targets, task_type="CAUSAL_LM")
    return get_peft_model(model, peft_config)


# ---------------------------------------------------------------------------------------------
# Config and model


def vlm_config(section: ModelSection, vocab_size: int | None = None):
    """The transformers config of the VLM; an inline text_config without vocab_size gets ``vocab_size``."""

    if section.path or vocab_size is None or section.config is None:
        return model_config(section)
    fields = dict(section.config)
    text = dict(fields.get("text_config") or {})
    if text.get("vocab_size") in (None, "auto"):
        text["vocab_size"] = vocab_size
        fields["text_config"] = text
    return model_config(section.model_copy(update={"config": fields}))


def build_vlm(
    section: ModelSection, config: Any, precision: str, zero_stage: int = 0, dtype: torch.dtype | None = None, activation_offload: bool = False
) -> torch.nn.Module:
    """The model with model.trainable applied (and LoRA); call with ``HfDeepSpeedConfig`` alive for ZeRO-3."""
    from transformers import AutoModelForImageTextToText

    quant = section.quantization
    if quant is not None and not quant.is_fp8:
        raise ConfigError([("model.quantization", f"{quant.storage} (bitsandbytes) is not implemented for vision-language models: set model.quantization: fp8, or remove it")])
    dtype = dtype or TORCH_DTYPES[precision]
    attention = section.attn_implementation
    if section.path and quant is not None:
        # The fp8 base: the language model's block linears quantized by each rank while it streams
        # its own rows, as for causal LMs (see language_model_block for why the tower stays 16-bit).
        model = load_pretrained(
            AutoModelForImageTextToText, section.path, dtype=dtype, zero_stage=zero_stage, config=config, attn_implementation=attention,
            quantize=QuantizedStorage(quant.storage, quant.scale), quantize_select=language_model_block,
        )
    elif section.path and not section.load_kwargs:

        # Tensor by tensor from the memory-mapped checkpoint, as for causal LMs (host RAM stays flat).
        model = load_pretrained(
            AutoModelForImageTextToText, section.path, dtype=dtype, zero_stage=zero_stage, config=config, attn_implementation=attention
        )
    elif section.path:
        model = AutoModelForImageTextToText.from_pretrained(section.path, dtype=dtype, attn_implementation=attention, **section.load_kwargs)
    else:
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation=attention)
    # The KV cache is useless in training and costs memory.
    model.config.use_cache = False
    text_config = model.config.get_text_config()
    if text_config is not model.config:
        text_config.use_cache = False
    freeze_parts(model, trainable_parts(section))
    if section.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (a frozen vision tower, LoRA) and with ZeRO-3; activation offload rides on it.
        enable_checkpointing(model, offload=activation_offload)
    if section.lora is not None:
        model = add_vlm_lora(model, section)
    return model


def check_trainable(section: ModelSection, config: Any) -> dict[str, dict[str, int]]:
    """Resolve model.trainable (and LoRA's targets) on a skeleton on the meta device, before any rank starts.

    Returns:
        {part: {"total": n, "trainable": n}} as training will see it.

    Raises:
        ConfigError: an unknown architecture's parts, or LoRA targets missing from a chosen part.
    """
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    freeze_parts(model, trainable_parts(section))
    if section.lora is not None:
        lora_module_names(model, section.lora, trainable_parts(section))
    return part_counts(model)


def build_vlm_for_export(section: ModelSection) -> torch.nn.Module:
    """The model in fp32 with the same parameter names as in training (adapters included), to load a checkpoint into."""
    from transformers import AutoModelForImageTextToText

    if section.path:
        model = AutoModelForImageTextToText.from_pretrained(section.path, dtype=torch.float32, **full_precision_kwargs(section.path))
    else:
        model = AutoModelForImageTextToText.from_config(vlm_config(section), dtype=torch.float32)
    if section.lora is not None:
        model = add_vlm_lora(model, section)
    return model


def trainable_counts(model: torch.nn.Module, section: ModelSection) -> tuple[int, list[int], tuple[str, ...]]:
    """(trainable parameters, their sizes in order, LoRA target names) of a model built on the meta device, for the planner."""
    parts = trainable_parts(section)
    groups = parameters_by_part(model)
    if section.lora is None:
        sizes = [numel(p) for part in parts for _, p in groups[part]]
        return sum(sizes), sizes, ()
    names = lora_module_names(model, section.lora, parts)
    modules = dict(model.named_modules())
    sizes = []
    for name in names:
        linear = modules[name]
        sizes += adapter_parameter_sizes(section.lora, linear.in_features, linear.out_features)
    return sum(sizes), sizes, tuple(sorted({n.rsplit(".", 1)[-1] for n in names}))


# ---------------------------------------------------------------------------------------------
# Processor


@dataclass
class ResolvedConfig:
    """The inline model config completed from the tokenizer, and what was filled in."""

    fields: dict[str, Any]
    filled: list[str] = field(default_factory=list)


def offline_processor_spec(model_type: str) -> OfflineProcessor:
    spec = OFFLINE_PROCESSORS.get(model_type)
    if spec is None:
        raise ConfigError(
            [
                (
                    "model.processor",
                    f"a processor for {model_type!r} cannot be built offline (only for {', '.join(OFFLINE_PROCESSORS)}): "
                    "give model.processor, a directory with a saved processor (processor.save_pretrained)",
                )
            ]
        )
    return spec


def build_processor(model_fields: dict[str, Any], texts: list[str], vocab_size: int, out_dir: Path):
    """Build and save an architecture's processor: its image processor and a tokenizer trained on ``texts``.

    Args:
        model_fields: the inline model.config (model_type, vision_config...).
        texts: captions and messages to train the tokenizer on.
        vocab_size: BPE vocabulary size, before the image tokens are added.
        out_dir: where the processor is saved (the run's processor directory).

    Raises:
        ConfigError: no offline recipe for this architecture, or a vision config without image_size.
    """
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    model_type = model_fields.get("model_type")
    spec = offline_processor_spec(model_type)
    vision = dict(model_fields.get("vision_config") or {})
    image_size, patch_size = vision.get("image_size"), vision.get("patch_size")
    if not image_size or not patch_size:
        raise ConfigError([("model.config.vision_config", "set image_size and patch_size: the image processor is built with them")])
    with tempfile.TemporaryDirectory() as scratch:
        train_tokenizer(texts, vocab_size, Path(scratch))
        # Named special tokens (tokenizer.image_token...) are what the processors look up.
        tokenizer = AutoTokenizer.from_pretrained(scratch, **spec.tokens)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in spec.tokens.values()], special_tokens=True)
    if spec.build == "llava":
        from transformers import LlavaProcessor

        square = {"height": image_size, "width": image_size}
        image_processor = _image_processor("CLIPImageProcessor", size={"shortest_edge": image_size}, crop_size=square)
        processor = LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=patch_size,
            vision_feature_select_strategy=model_fields.get("vision_feature_select_strategy", "default"),
            image_token=spec.tokens["image_token"],
            num_additional_image_tokens=1,  # CLIP's class token
        )
    else:
        from transformers import Gemma3Processor

        image_processor = _image_processor("Gemma3ImageProcessor", size={"height": image_size, "width": image_size})
        tokens_per_image = int(model_fields.get("mm_tokens_per_image", 256))
        processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=tokens_per_image)
    out_dir.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(str(out_dir))
    return processor


def _image_processor(name: str, **kwargs):
    """The image processor class without torchvision when it is missing (the PIL backend, same results)."""
    import transformers

    try:
        import torchvision  # noqa: F401
    except ImportError:
        name += "Pil"
    return getattr(transformers, name)(**kwargs)


def resolve_inline_config(model_fields: dict[str, Any], tokenizer) -> ResolvedConfig:
    """model.config completed with what the tokenizer decides: vocabulary size and token ids.

    Raises:
        ConfigError: a value set in model.config disagrees with the tokenizer.
    """
    fields = {key: (dict(value) if isinstance(value, dict) else value) for key, value in model_fields.items()}
    text = fields.setdefault("text_config", {})
    filled, problems = [], []
    size = len(tokenizer)
    if text.get("vocab_size") in (None, "auto"):
        text["vocab_size"] = size
        filled.append(f"model.config.text_config.vocab_size = {size} (from the tokenizer)")
    elif text["vocab_size"] < size:
        message = f"{text['vocab_size']} is smaller than the tokenizer's {size} tokens: raise it or remove it"
        problems.append(("model.config.text_config.vocab_size", message))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token_id = getattr(tokenizer, key)
        if key not in text and token_id is not None:
            text[key] = token_id
    spec = OFFLINE_PROCESSORS.get(fields.get("model_type"))
    for config_key, attribute in (spec.config_ids.items() if spec else ()):
        token_id = tokenizer.convert_tokens_to_ids(getattr(tokenizer, attribute))
        if fields.get(config_key) is None:
            fields[config_key] = token_id
            filled.append(f"model.config.{config_key} = {token_id} (the tokenizer's {getattr(tokenizer, attribute)})")
        elif fields[config_key] != token_id:
            token = getattr(tokenizer, attribute)
            message = f"is {fields[config_key]} but the tokenizer's {token} is {token_id}: remove it (it is set from the tokenizer)"
            problems.append((f"model.config.{config_key}", message))
    if fields.get("model_type") == "gemma3":
        problems += _gemma3_geometry(fields)
    if problems:
        raise ConfigError(problems)
    return ResolvedConfig(fields, filled)


def _gemma3_geometry(fields: dict[str, Any]) -> list[tuple[str, str]]:
    """Gemma 3 pools the vision tower's patch grid to mm_tokens_per_image tokens: the sizes must divide."""
    vision = fields.get("vision_config") or {}
    tokens = int(fields.get("mm_tokens_per_image", 256))
    side = math.isqrt(tokens)
    patches = int(vision.get("image_size", 0)) // max(1, int(vision.get("patch_size", 1)))
    if side * side != tokens or side == 0 or patches % side:
        return [
            (
                "model.config.mm_tokens_per_image",
                f"{tokens} must be a square whose side divides the {patches}x{patches} patch grid "
                f"(vision_config.image_size / patch_size): e.g. {max(1, patches // 2) ** 2}",
            )
        ]
    return []


