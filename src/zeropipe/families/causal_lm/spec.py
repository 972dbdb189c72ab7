"""The planner's description of a run's causal LM (model.path or model.config), counted on the meta device."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from zeropipe.config.schema import RunConfig
from zeropipe.models.common import model_config
from zeropipe.plan.model_spec import GenerationShape, ModelSpec, QuantizedBase, _causal_lm_spec, with_expert_adapters  # the planner's meta-device counters


def causal_lm_config_spec(run_config: RunConfig) -> ModelSpec:
    """The causal LM of a run config (model.path or model.config), with its LoRA adapters.

    Raises:
        ConfigError: when transformers cannot build the configured architecture.
    """

    section = run_config.model
    vocab = None
    if section.config is not None and section.config.get("vocab_size") in (None, "auto"):
        # The tokenizer is trained on the data later; its size is the configured target.
        vocab = section.tokenizer_vocab_size
    hf_config = model_config(section, vocab_size=vocab)
    name = Path(section.path).name if section.path else f"inline {hf_config.model_type}"
    spec = _causal_lm_spec(hf_config, name, section.lora)
    if section.lora is not None:
        spec = with_expert_adapters(spec, section.lora.target_parameters, section.lora.r)  # a mixture of experts' LoRA on its experts
    quantized = None
    if section.quantization is not None and section.quantization.storage in ("fp8", "fp8_e5m2", "int8"):
        # bitsandbytes' int8 is also one byte per weight with a float32 scale per row (its SCB), held
        # whole by every rank (ZeRO-0..2 only); counted as the fp8 base is (its fp32 upcasts of the
        # norms by prepare_model_for_kbit_training are left out: a few MB).
        spec = spec.with_fp8_base(section.quantization.storage)
    elif section.quantization is not None and section.quantization.load_in_4bit:
        quantized = QuantizedBase(spec.quantizable_params, spec.frozen_base_params - spec.quantizable_params, section.quantization.double_quant)
    spec = replace(spec, source=f"run config: {'model.path ' + section.path if section.path else 'model.config'}", quantized=quantized)
    if run_config.preference is not None:
        from zeropipe.families.causal_lm.preference import reference_mode

        # A micro-batch of n pairs is 2n sequences; a LoRA reference is one more forward pass without gradient.
        spec = replace(spec, sequences_per_example=2, reference_forward=reference_mode(run_config) == "adapters_off")
    if run_config.grpo is not None:
        # A micro-batch of n prompts trains on n x num_generations sequences, sampled first in a generation round;
        # beta > 0 adds the reference's pass without gradient (the adapters off, or a frozen copy of the weights).
        grpo = run_config.grpo
        copy_reference = grpo.beta > 0 and (grpo.reference == "copy" or (grpo.reference == "auto" and run_config.model.lora is None))  # rl.reference_kind
        spec = replace(spec, sequences_per_example=grpo.num_generations, reference_forward=grpo.beta > 0,
                       generation=GenerationShape(grpo.num_generations, grpo.max_completion_length, copy_reference))
    return spec
