"""The planner's description of a run's vision-language model: every part counted, the trainable ones apart."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from zeropipe.config.schema import RunConfig
from zeropipe.engine.preference import reference_mode
from zeropipe.families.vlm.model import OFFLINE_PROCESSORS, language_model_block, trainable_counts, vlm_config
from zeropipe.plan.model_spec import LoraShape, ModelSpec, _block_linear_counts, _build_causal_lm, _causal_lm_spec  # the planner's meta-device counters


def vlm_config_spec(run_config: RunConfig) -> ModelSpec:
    """A vision-language model: every part counted, the trainable ones per model.trainable (or their LoRA adapters).

    Activations are those of the language model at data.max_seq_len (image tokens included);
    the vision tower's own activations are not modelled.
    """

    section = run_config.model
    text = (section.config or {}).get("text_config") or {}
    vocab = None
    if section.config is not None and text.get("vocab_size") in (None, "auto"):
        # The tokenizer trained on the data, plus the image tokens added to it.
        recipe = OFFLINE_PROCESSORS.get(section.config.get("model_type"))
        vocab = section.tokenizer_vocab_size + (len(recipe.tokens) if recipe else 0)
    hf_config = vlm_config(section, vocab_size=vocab)
    name = Path(section.path).name if section.path else f"inline {hf_config.model_type}"
    spec = _causal_lm_spec(hf_config, name, None)
    meta_model = _build_causal_lm(hf_config)
    trainable, sizes, targets = trainable_counts(meta_model, section)
    lora_shape = None
    if section.lora is not None:
        lora_shape = LoraShape(r=section.lora.r, dropout=section.lora.dropout > 0, target_modules=targets)
    # Only the language model's block linears are stored in fp8 (model.language_model_block), the tower stays 16-bit:
    # counted so for a configured fp8 base and for the planner's offer of one.
    spec = replace(spec, **_block_linear_counts(meta_model, language_model_block))
    if section.quantization is not None and section.quantization.is_fp8:
        spec = spec.with_fp8_base(section.quantization.storage)
    if run_config.preference is not None:
        # A micro-batch of n pairs is 2n sequences; a LoRA reference is one more forward pass without gradient.
        spec = replace(spec, sequences_per_example=2, reference_forward=reference_mode(run_config) == "adapters_off")
    return replace(
        spec,
        total_params=spec.total_params + (trainable if section.lora is not None else 0),
        trainable_params=trainable,
        parameter_sizes=tuple(sizes),
        lora=lora_shape,
        source=f"run config: {'model.path ' + section.path if section.path else 'model.config'} (vision-language)",
    )
