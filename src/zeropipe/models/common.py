"""What every model family's model code shares: dtypes by name, transformers configs, parameter counts, the ZeRO-3 context for transformers."""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from zeropipe.config.schema import ModelSection
from zeropipe.errors import ConfigError

log = logging.getLogger("zeropipe")

# LoRA's usual targets (model.lora.target_modules: auto): the attention projections, as each library names them.
TRANSFORMERS_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
DIFFUSERS_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")

# deepspeed.precision (and --dtype) names to torch dtypes.
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def encoder_precision_for(accelerator: str, device_precision: str, why: str) -> tuple[str, str]:
    """The dtype frozen text encoders are loaded in, by the node's setup process and by ranks encoding with caching off.

    bf16 where the device computes in it (UMT5-XXL then takes 11.4 GB instead of 22.7 GB), else
    fp32, never fp16 (T5 encoders overflow in it). VAEs stay fp32 (image VAEs overflow in half
    precision). The planner counts the same (``plan.memory.frozen_model_bytes``).
    """
    if device_precision == "bf16":
        return "bf16", why
    if accelerator == "cuda":
        return "fp32", f"{why}, and text encoders such as T5 overflow in fp16"
    return "fp32", why


def model_config(section: ModelSection, vocab_size: int | None = None):
    """The transformers config of the model (inline or read from model.path)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if section.path:
        return AutoConfig.from_pretrained(section.path)
    fields = dict(section.config or {})
    model_type = fields.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError([("model.config.model_type", f"unknown architecture {model_type!r}: use one transformers knows, e.g. llama, qwen2, mistral, gemma2")])
    if vocab_size is not None and fields.get("vocab_size") in (None, "auto"):
        fields["vocab_size"] = vocab_size
    try:
        return CONFIG_MAPPING[model_type](**fields)
    except (TypeError, ValueError) as err:
        raise ConfigError([("model.config", f"transformers rejected the inline {model_type} config: {err}")]) from None


def hidden_size_of(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "hidden_size", None)


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; works on ZeRO-3 partitioned parameters too."""
    trainable = total = 0
    for param in model.parameters():
        numel = getattr(param, "ds_numel", None) or param.numel()
        total += numel
        if param.requires_grad:
            trainable += numel
    return trainable, total


def trained_weights(model, section: ModelSection, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's weights to load into a family's export model (the causal LM's, the VLM's).

    A checkpoint of a quantized base (QLoRA's 4-bit, fp8) holds the base as packed bytes and their scales;
    the exported model is the full-precision base of model.path, so only what trained (the
    adapters) is taken from the checkpoint and the rest is the base's own. Other runs load the
    whole checkpoint.
    """
    if section.quantization is None:
        return state
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    # A trained tensor missing from the checkpoint stays missing: load_checked names it.
    base = {name: value for name, value in model.state_dict().items() if name not in trained}
    return base | {name: state[name] for name in trained if name in state}


def full_precision_kwargs(path: str | None) -> dict[str, Any]:
    """from_pretrained arguments that load model.path in full precision: a fine-grained FP8 or an MXFP4 (gpt-oss) checkpoint dequantized.

    An export's base is the full-precision model; transformers keeps such a checkpoint's FP8 layers on a GPU
    of compute capability 8.9+ (and dequantizes it elsewhere), which peft cannot merge into.
    """
    import json
    from pathlib import Path

    if not path:
        return {}
    try:
        quant = json.loads((Path(path).expanduser() / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return {}
    if quant.get("quant_method") == "mxfp4":
        # gpt-oss's published experts (MXFP4 blocks and scales): transformers dequantizes them on any device, CPU included.
        from transformers import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}
    if quant.get("quant_method") != "fp8":
        return {}
    from transformers import FineGrainedFP8Config

    return {"quantization_config": FineGrainedFP8Config(dequantize=True)}


def hf_zero3_config(ds_config: dict[str, Any], zero_stage: int):
    """An HfDeepSpeedConfig under ZeRO-3 (None otherwise); the caller keeps it alive for the whole run.

    transformers holds only a weak reference to it: while it lives, from_pretrained and
    from_config build models inside ``deepspeed.zero.Init``, and generate() knows to keep the
    ranks in step.
    """
    if zero_stage != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def log_partitioning(model) -> None:
    """Say whether construction was partitioned: under ZeRO-3 no rank may hold the full model."""
    params = list(model.parameters())
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    local = sum(p.ds_tensor.numel() for p in partitioned if getattr(p, "ds_tensor", None) is not None)
    full = sum(p.ds_numel for p in partitioned)
    log.info(
        "ZeRO-3: %d of %d parameter tensors partitioned at construction; this rank holds %s of %s elements",
        len(partitioned), len(params), f"{local:,}", f"{full:,}",
    )


def resolve_lora_targets(lora, defaults: tuple[str, ...]) -> list[str] | str:
    """The target_modules argument of peft's LoraConfig: model.lora.target_modules, with "auto" meaning the family's defaults."""
    if lora.target_modules == "auto":
        # A string is a regular expression peft matches against whole module names.
        return defaults if isinstance(defaults, str) else list(defaults)
    if isinstance(lora.target_modules, str):
        return lora.target_modules  # "all-linear", or a regular expression peft matches against whole module names
    return list(lora.target_modules)


def is_lora_target(name: str, targets: list[str] | str) -> bool:
    """Whether the module ``name`` is adapted, as peft decides: a string is a whole-name regular expression, a list holds name suffixes."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == target or name.endswith("." + target) for target in targets)
