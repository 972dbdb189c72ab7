"""Causal language models through transformers' Auto classes, optionally with LoRA (peft).

Under ZeRO-3 the model must be built while transformers knows the DeepSpeed config
(``HfDeepSpeedConfig`` alive): transformers then constructs it inside ``deepspeed.zero.Init``
so no rank ever materialises the full model, and initialises or loads weights one gathered
module at a time. That is the order of operations that avoids meta-tensor errors without
patching anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zeropipe.config.schema import ModelSection, RunConfig
from zeropipe.errors import ConfigError
from zeropipe.models.adapters import peft_adapter_config
from zeropipe.models.checkpointing import enable_checkpointing
from zeropipe.models.common import TORCH_DTYPES, TRANSFORMERS_LORA_TARGETS, full_precision_kwargs, model_config, resolve_lora_targets, trained_weights  # noqa: F401 - trained_weights: this family's callers
from zeropipe.models.loading import load_pretrained
from zeropipe.models.moe import expert_parameter_names
from zeropipe.models.quantized import QuantizedStorage


def quantization_kwargs(section: ModelSection, precision: str, zero_stage: int) -> dict[str, Any]:
    """Keyword arguments of transformers' BitsAndBytesConfig for QLoRA.

    Under ZeRO-3 DeepSpeed partitions the packed 4-bit weights like any other tensor, which
    only works when they are stored in the dtype of the model's other parameters (the
    training precision, which is also the compute dtype unless compute_dtype says otherwise);
    "auto" picks that. Below ZeRO-3 the weights stay whole and bitsandbytes' uint8 is used.
    """
    quant = section.quantization
    assert quant is not None
    compute = precision if quant.compute_dtype == "auto" else quant.compute_dtype
    storage = quant.quant_storage
    if storage == "auto":
        storage = precision if zero_stage == 3 else "uint8"
    dtypes = {**TORCH_DTYPES, "uint8": torch.uint8}
    return {
        "load_in_4bit": quant.load_in_4bit,
        "bnb_4bit_quant_type": quant.quant_type,
        "bnb_4bit_use_double_quant": quant.double_quant,
        "bnb_4bit_compute_dtype": dtypes[compute],
        "bnb_4bit_quant_storage": dtypes[storage],
    }


def fp8_storage(section: ModelSection) -> QuantizedStorage:
    quant = section.quantization
    assert quant is not None and quant.is_fp8
    return QuantizedStorage(quant.storage, quant.scale)


def is_reward_model(config: RunConfig) -> bool:
    """A reward model's run: a scalar head on the transformer (AutoModelForSequenceClassification) instead of the LM head."""
    return config.preference is not None and config.preference.method == "reward"


def auto_class(reward: bool):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if reward else AutoModelForCausalLM


def build_model(section: ModelSection, config: Any, precision: str, zero_stage: int = 0, reward: bool = False, activation_offload: bool = False):
    """Instantiate the model (random init or pretrained), with LoRA adapters when configured.

    Call this with ``HfDeepSpeedConfig`` alive for ZeRO-3 so that construction is partitioned.
    ``reward``: a reward model, the transformer with a one-output score head (``config.num_labels`` 1).
    """
    AutoModelForCausalLM = auto_class(reward)  # noqa: N806 - the class transformers names so

    dtype = TORCH_DTYPES[precision]
    quant = section.quantization
    if section.path and quant is not None and quant.is_fp8:
        # The fp8 base: quantized by each rank while it streams its own rows (models.quantized).
        # transformers would skip zero.Init for a model loaded with a quantization_config.
        model = load_pretrained(
            AutoModelForCausalLM, section.path, dtype=dtype, zero_stage=zero_stage, config=config, attn_implementation=section.attn_implementation,
            quantize=fp8_storage(section), new_head=reward,
        )
    elif section.path and (mxfp4 := full_precision_kwargs(section.path).get("quantization_config")) is not None and type(mxfp4).__name__ == "Mxfp4Config":
        # gpt-oss's MXFP4 experts: transformers dequantizes them while it loads (training needs the 16/32-bit weights).
        if quant is not None:
            raise ConfigError([("model.quantization", f"{section.path} holds MXFP4 experts, which load dequantized: remove model.quantization, or start from a bf16 checkpoint")])
        model = AutoModelForCausalLM.from_pretrained(
            section.path, config=config, dtype=dtype, attn_implementation=section.attn_implementation, quantization_config=mxfp4, **section.load_kwargs
        )
    elif section.path and section.quantization is None and not section.load_kwargs:

        # Tensor by tensor from the memory-mapped checkpoint, each rank only what it keeps:
        # host RAM does not grow with the number of ranks (from_pretrained's does).
        model = load_pretrained(
            AutoModelForCausalLM, section.path, dtype=dtype, zero_stage=zero_stage, config=config, attn_implementation=section.attn_implementation,
            new_head=reward,
        )
    elif section.path:
        # QLoRA's 4-bit quantisation and extra from_pretrained arguments stay with transformers.
        kwargs = dict(section.load_kwargs)
        if section.quantization is not None:
            from transformers import BitsAndBytesConfig

            settings = {"load_in_8bit": True} if section.quantization.storage == "int8" else quantization_kwargs(section, precision, zero_stage)
            kwargs["quantization_config"] = BitsAndBytesConfig(**settings)
        # config: the run's (a reward model's num_labels and pad_token_id), not only the folder's config.json.
        model = AutoModelForCausalLM.from_pretrained(section.path, config=config, dtype=dtype, attn_implementation=section.attn_implementation, **kwargs)
        if section.quantization is not None:
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=section.gradient_checkpointing)
            prepare_4bit_modules(model)
    else:
        config._attn_implementation = section.attn_implementation
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # The KV cache is useless in training and costs memory.
    model.config.use_cache = False
    if section.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and with ZeRO-3; activation offload rides on it.
        enable_checkpointing(model, offload=activation_offload)
        if section.lora is not None:
            model.enable_input_require_grads()
    if section.lora is not None:
        model = add_lora(model, section, task_type="SEQ_CLS" if reward else "CAUSAL_LM")
    return model


QUANT_STATE_SUFFIXES = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".quant_state.")


def prepare_4bit_modules(model) -> None:
    """Make a QLoRA base's 4-bit layers fit the trainer's checkpoints and every CPU.

    - A resume loads the checkpoint's module state strictly. The frozen 4-bit base is rebuilt
      from model.path by the rank itself; the quantisation constants bitsandbytes writes beside
      each packed weight (``weight.absmax``, ``weight.quant_map``, ...) have no parameter to go
      into, so each 4-bit layer drops them from what it is handed (torch's load pre-hook).
    - On a CPU with AVX512-BF16, bitsandbytes' Linear4bit repacks its weight on the first
      forward pass in eval mode (samples, evaluation), replacing ``weight.data`` with a tensor of
      another shape and dtype: ZeRO-3's partitioned parameters cannot take that, and the repack
      needs in_features to be a multiple of the block size. Training ranks run the same kernels
      in train and eval mode, on every CPU.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            module.register_load_state_dict_pre_hook(drop_quant_state)


def drop_quant_state(module, state_dict, prefix, *args) -> None:
    for key in [key for key in state_dict if key.startswith(prefix + "weight.") and any(suffix in key[len(prefix) + 6 :] for suffix in QUANT_STATE_SUFFIXES)]:
        del state_dict[key]


def add_lora(model, section: ModelSection, task_type: str = "CAUSAL_LM"):
    from peft import get_peft_model

    lora = section.lora
    assert lora is not None
    target_parameters = getattr(lora, "target_parameters", None)
    if target_parameters == "experts":
        target_parameters = expert_parameter_names(model)
        if not target_parameters:
            raise ConfigError([("model.lora.target_parameters", "experts: this model has no mixture-of-experts blocks with 3-D expert weights: remove target_parameters")])
    # SEQ_CLS (a reward model): peft also trains and saves the score head
    peft_config = peft_adapter_config(lora, resolve_lora_targets(lora, TRANSFORMERS_LORA_TARGETS), task_type=task_type, target_parameters=target_parameters)
    try:
        return get_peft_model(model, peft_config)
    except ValueError as err:
        names = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)})
        raise ConfigError([("model.lora.target_modules", f"{err}. Linear layers of this model: {', '.join(names)}")]) from None


def causal_lm_for_export(config: RunConfig, pad_token_id: int | None = None):
    """The run's causal LM in fp32 (a reward model's sequence classifier), with its LoRA adapters when it trained some."""
    reward = is_reward_model(config)
    AutoModelForCausalLM = auto_class(reward)  # noqa: N806
    section = config.model
    hf_config = model_config(section)
    # A reward model scores a sequence at its last token before the padding: its config must name the pad token.
    head = {"num_labels": 1, "pad_token_id": pad_token_id} if reward else {}
    if section.path:
        model = AutoModelForCausalLM.from_pretrained(section.path, dtype=torch.float32, **head, **full_precision_kwargs(section.path))
    else:
        for key, value in head.items():
            setattr(hf_config, key, value)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    if section.lora is not None:
        return add_lora(model, section, task_type="SEQ_CLS" if reward else "CAUSAL_LM")
    return model


def save_tokenizer_dir(tokenizer, out: Path) -> None:
    tokenizer.save_pretrained(str(out))
