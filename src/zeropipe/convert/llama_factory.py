"""LLaMA-Factory (github.com/hiyouga/LLaMA-Factory) training YAMLs, with datasets from dataset_info.json."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from zeropipe.convert.common import (
    HELD_OUT_PAIRS,
    Conversion,
    ConversionError,
    PeerDefault,
    as_number,
    find_path,
    is_unset,
    list_rest,
    local_model,
    map_moe_keys,
    map_deepspeed,
    map_adapter_init,
    map_sequence_parallel,
    map_optimizer,
    map_output_dir,
    map_precision,
    map_schedule,
    map_sources,
    map_trainer_keys,
    map_warmup_ratio,
    to_float,
    to_int,
)

STAGES = {"sft": "supervised fine-tuning", "pt": "pre-training on plain text"}
REFUSED_STAGES = {"ppo": "PPO"}
# Preference stages: LLaMA-Factory's defaults (hparams/finetuning_args.py) and what its pref_loss names in ZeRO-Pipe.
PREFERENCE_STAGES = {"dpo": "DPO-family preference tuning", "kto": "KTO preference tuning", "rm": "reward-model training"}
PREF_LOSSES = {"sigmoid": ("dpo", ["sigmoid"]), "hinge": ("dpo", ["hinge"]), "ipo": ("dpo", ["ipo"]), "orpo": ("orpo", None), "simpo": ("simpo", None)}
# LLaMA-Factory's defaults where they differ from ZeRO-Pipe's (hparams/finetuning_args.py, data_args.py).
DEFAULT_CUTOFF_LEN = 2048
DEFAULT_EPOCHS = 3.0
# Hugging Face TrainingArguments' defaults, which LLaMA-Factory trains with when the YAML sets none.
HF_DEFAULT_LR = 5e-5
HF_DEFAULT_BATCH = 8
# Pre-quantized checkpoints (config.json's quantization_config.quant_method, or the Hub name's usual suffix).
PREQUANTIZED = ("awq", "gptq", "aqlm", "hqq", "eetq", "exl2", "marlin")
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output"}
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt", "system_tag": "system"}
OPENAI_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant", "system_tag": "system"}

# LLaMA-Factory's defaults that differ from ZeRO-Pipe's, where its source (github.com/hiyouga/LLaMA-Factory at ff6d4d1) or Hugging Face's
# TrainingArguments (transformers 5.x training_args.py, which LLaMA-Factory trains with) sets them: written when the file leaves the key out.
PEER_DEFAULTS = {
    "cutoff_len": PeerDefault("cutoff_len", DEFAULT_CUTOFF_LEN, "data.max_seq_len", "src/llamafactory/hparams/data_args.py:46"),
    "num_train_epochs": PeerDefault("num_train_epochs", DEFAULT_EPOCHS, "train.epochs", "transformers training_args.py:778", owner="Hugging Face"),
    "per_device_train_batch_size": PeerDefault("per_device_train_batch_size", HF_DEFAULT_BATCH, "train.micro_batch_size", "transformers training_args.py:777", owner="Hugging Face"),
    "learning_rate": PeerDefault("learning_rate", HF_DEFAULT_LR, "train.lr", "transformers training_args.py:787", owner="Hugging Face"),
    "lr_scheduler_type": PeerDefault("lr_scheduler_type", "linear", "train.schedule", "transformers training_args.py:788", owner="Hugging Face"),
    "disable_gradient_checkpointing": PeerDefault("disable_gradient_checkpointing", False, "model.gradient_checkpointing",
                                                  "src/llamafactory/hparams/model_args.py:145: activations are checkpointed", written=True),
    "lora_rank": PeerDefault("lora_rank", 8, "model.lora.r", "src/llamafactory/hparams/finetuning_args.py:77", "lora"),
    "lora_alpha": PeerDefault("lora_alpha", "2 x lora_rank", "model.lora.alpha", "src/llamafactory/hparams/finetuning_args.py:587", "lora"),
    "lora_dropout": PeerDefault("lora_dropout", 0.0, "model.lora.dropout", "src/llamafactory/hparams/finetuning_args.py:73", "lora"),
    "lora_target": PeerDefault("lora_target", "all", "model.lora.target_modules", "src/llamafactory/hparams/finetuning_args.py:81", "lora"),
    "freeze_vision_tower": PeerDefault("freeze_vision_tower", True, "model.trainable", "src/llamafactory/hparams/finetuning_args.py:546-554: "
                                       "tower and projector frozen, language model trained", "vlm"),
}

NOT_MAPPED = {
    "template": "ZeRO-Pipe renders conversations with the tokenizer's own chat template (a plain role-tagged layout when it has none)",
    "overwrite_cache": "the data is tokenized once per run into its memory-mapped cache",
    "preprocessing_num_workers": "the fast tokenizer batches the data itself",
    "dataloader_num_workers": "the token cache is memory-mapped; no loader workers",
    "plot_loss": "metrics.jsonl has every step; `zeropipe ui` plots it",
    "overwrite_output_dir": "a new run directory is made per run name; `--resume` continues one",
    "ddp_timeout": "ZeRO-Pipe sets the rendezvous itself",
    "max_samples": "every record of the file is used: cut the file to train on fewer",
    "resume_from_checkpoint": "resume with `zeropipe train FILE --resume [PATH]`",
    "eval_strategy": "evaluation runs every train.eval_every steps (from eval_steps)",
    "per_device_eval_batch_size": "evaluation uses train.micro_batch_size",
    "do_eval": "evaluation runs when held-out data is set (val_size)",
    "do_predict": "prediction is not part of training; `zeropipe generate RUN --prompt ...` answers prompts",
    "save_only_model": "checkpoints always hold the optimizer state so that --resume continues exactly",
    "report_to": "TensorBoard is always written; set logging.wandb / logging.mlflow",
    "flash_attn": "attention runs on PyTorch's sdpa kernels, which use flash kernels where they can",
    "image_max_pixels": "images are resized by the model's own image processor",
    "image_min_pixels": "images are resized by the model's own image processor",
    "video_max_pixels": "video is not supported",
    "quantization_method": "ZeRO-Pipe's quantized bases are bitsandbytes' (quantization_bit: 4, nf4) and fp8 (quantization_bit: 8); hqq and eetq are not run",
    "mask_history": "loss is on every assistant turn",
    "additional_target": "only LoRA adapters train in a LoRA run",
    "create_new_adapter": "a LoRA run starts fresh adapters",
    "use_rslora": "rank-stabilised LoRA is not supported: plain LoRA (set model.lora.alpha to r x sqrt(r) for the same scale)",
    "pissa_init": "PiSSA initialisation is not supported: plain LoRA",
    "use_unsloth": "unsloth kernels are not used",
    "enable_liger_kernel": "liger kernels are not used",
    "tokenized_path": "the data is tokenized into the run's memory-mapped cache (RUN/cache)",
    "streaming": "files are read whole, then memory-mapped",
    "mix_strategy": "several datasets become data.mixture, weighted by their sizes",
    "interleave_probs": "several datasets become data.mixture, weighted by their sizes",
}


def convert(path: Path, raw: dict[str, Any]) -> Conversion:
    conversion = Conversion("llama-factory", path)
    rest = dict(raw)
    bases = (Path.cwd(), path.parent)
    stage = str(rest.pop("stage", "sft"))
    if stage in REFUSED_STAGES:
        raise ConversionError(
            f"{path}: stage: {stage} is {REFUSED_STAGES[stage]} training, which ZeRO-Pipe does not do (it trains supervised: "
            "stage: sft, full, LoRA or QLoRA, and stage: pt): convert the sft stage of your recipe instead"
        )
    if stage in PREFERENCE_STAGES:
        _preference(conversion, stage, rest)
    elif stage not in STAGES:
        raise ConversionError(f"{path}: stage: {stage} is not one ZeRO-Pipe knows (it converts sft, pt, dpo, kto and rm)")
    else:
        conversion.already.append(f"stage: {stage} ({STAGES[stage]})")
    do_train = rest.pop("do_train", None)
    if do_train is False:
        conversion.skip("do_train", "false: this config does not train; the conversion is a training config anyway")
    elif do_train is not None:
        conversion.already.append(f"do_train: {do_train}")

    local_model(conversion, "model_name_or_path", str(rest.pop("model_name_or_path", "")), bases)
    prequantized = _prequantized(conversion, "model_name_or_path")
    remote = rest.pop("trust_remote_code", None)
    if remote:
        conversion.set("model.load_kwargs", {"trust_remote_code": True}, "from trust_remote_code")
    elif remote is False:
        conversion.already.append("trust_remote_code: false")
    # LLaMA-Factory checkpoints activations unless told not to.
    if "disable_gradient_checkpointing" in rest:
        no_checkpointing = bool(rest.pop("disable_gradient_checkpointing"))
        conversion.set("model.gradient_checkpointing", not no_checkpointing, f"from disable_gradient_checkpointing: {str(no_checkpointing).lower()}")
    else:
        conversion.default(PEER_DEFAULTS["disable_gradient_checkpointing"])
    # gradient_checkpointing is Hugging Face's own switch, which LLaMA-Factory sets itself from the key above.
    checkpointing = rest.pop("gradient_checkpointing", None)
    if checkpointing is not None:
        wanted = bool(checkpointing)
        if wanted == conversion.entries["model.gradient_checkpointing"].value:
            conversion.already.append(f"gradient_checkpointing: {str(checkpointing).lower()} (model.gradient_checkpointing: {str(wanted).lower()}, written)")
        else:
            conversion.skip("gradient_checkpointing", f"{checkpointing!r}: LLaMA-Factory decides from disable_gradient_checkpointing, which is what is written")
    _method(conversion, rest, prequantized)
    adapter = rest.pop("adapter_name_or_path", None)
    if "model.lora.r" in conversion.entries:
        map_adapter_init(conversion, "adapter_name_or_path", adapter)
    elif not is_unset(adapter):
        conversion.skip("adapter_name_or_path", f"{adapter!r}: a full fine-tune starts from the base; merge the adapter into it first (`zeropipe export --merge`, or peft's merge_and_unload) and set model.path to the merged folder")
    vision = any(key in rest for key in ("freeze_vision_tower", "freeze_multi_modal_projector", "freeze_language_model", "image_max_pixels"))
    _vision(conversion, rest, looks_like_vlm=vision or VLM_TEMPLATE.search(str(rest.get("template", ""))) is not None)

    fmt_stage = "text" if stage == "pt" else "preference" if stage in PREFERENCE_STAGES else None
    _datasets(conversion, rest, path, fmt_stage, vision or "model.trainable" in conversion.entries)
    if "eval_dataset" in rest:
        conversion.skip("eval_dataset", f"{rest.pop('eval_dataset')!r}: set data.eval_path to its file (or use val_size)")
    cutoff = rest.pop("cutoff_len", None)
    if cutoff:
        conversion.set("data.max_seq_len", to_int(cutoff, "cutoff_len"), "from cutoff_len")
    else:
        conversion.default(PEER_DEFAULTS["cutoff_len"])
    packing, neat = rest.pop("packing", None), rest.pop("neat_packing", None)
    if neat or packing:
        note = "from neat_packing" if neat else "from packing (ZeRO-Pipe's packing is always 'neat': examples never attend to each other)"
        conversion.set("data.packing", True, note)
    elif packing is False or neat is False:
        conversion.already.append("packing: false (no packing)")
    val = as_number(rest.pop("val_size", None))
    if val and fmt_stage == "preference":
        conversion.skip("val_size", f"{val}: {HELD_OUT_PAIRS}")
    elif val:
        if val < 1:
            conversion.set("data.eval_fraction", to_float(val, "val_size"), "from val_size")
        else:
            conversion.skip("val_size", f"{val}: a count of records; ZeRO-Pipe holds out a fraction: set data.eval_fraction")
    eval_steps = as_number(rest.pop("eval_steps", None))
    if eval_steps:
        if "data.eval_fraction" in conversion.entries:
            conversion.set("train.eval_every", to_int(eval_steps, "eval_steps"), "from eval_steps")
        else:
            conversion.skip("eval_steps", "no held-out data (val_size) to evaluate on")
    if rest.get("train_on_prompt"):
        conversion.skip("train_on_prompt", "true: loss is on the responses only; training on prompts is not supported")
    elif "train_on_prompt" in rest:
        conversion.already.append("train_on_prompt: false (loss on responses only)")
    rest.pop("train_on_prompt", None)

    if "per_device_train_batch_size" in rest:
        conversion.set("train.micro_batch_size", to_int(rest.pop("per_device_train_batch_size"), "per_device_train_batch_size"), "from per_device_train_batch_size")
    else:
        conversion.default(PEER_DEFAULTS["per_device_train_batch_size"])
    if "learning_rate" not in rest:
        conversion.default(PEER_DEFAULTS["learning_rate"])
    epochs = rest.pop("num_train_epochs", None)
    if epochs is not None:
        conversion.set("train.epochs", to_float(epochs, "num_train_epochs"), "from num_train_epochs")
    else:
        conversion.default(PEER_DEFAULTS["num_train_epochs"])
    map_trainer_keys(conversion, rest)
    if is_unset(rest.get("lr_scheduler_type")):
        rest.pop("lr_scheduler_type", None)
        conversion.default(PEER_DEFAULTS["lr_scheduler_type"])
        conversion.set("train.min_lr_ratio", 0.0, "Hugging Face's linear schedule decays to 0")
    else:
        map_schedule(conversion, "lr_scheduler_type", rest.pop("lr_scheduler_type"))
    map_optimizer(conversion, "optim", rest.pop("optim", None))
    map_warmup_ratio(conversion, "warmup_ratio", rest.pop("warmup_ratio", None))
    map_precision(conversion, rest, "LLaMA-Factory")
    map_deepspeed(conversion, "deepspeed", rest.pop("deepspeed", None), bases)
    map_sequence_parallel(conversion, rest, ("sequence_parallel_size",), "LLaMA-Factory's sequence parallelism (zigzag ring or Ulysses)", ("sequence_parallel_mode",))
    map_output_dir(conversion, rest.pop("output_dir", None))
    report_to = rest.get("report_to")
    if report_to == "wandb" or (isinstance(report_to, list) and "wandb" in report_to):
        rest.pop("report_to")
        conversion.set("logging.wandb", True, "from report_to: wandb")
    elif report_to in ("none", "tensorboard", None):
        rest.pop("report_to", None)
        if report_to is not None:
            conversion.already.append(f"report_to: {report_to} (TensorBoard files are written to the run directory either way)")

    map_moe_keys(conversion, rest)
    list_rest(conversion, rest, NOT_MAPPED)
    return conversion


def _method(conversion: Conversion, rest: dict[str, Any], prequantized: str | None = None) -> None:
    method = str(rest.pop("finetuning_type", "lora"))
    if method in ("full", "lora"):
        conversion.already.append(f"finetuning_type: {method} ({'no model.lora: every weight trains' if method == 'full' else 'model.lora'})")
    lora_keys = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target")
    if method == "full":
        if rest.get("use_dora"):
            conversion.skip("use_dora", "finetuning_type: full trains every weight; DoRA does not apply")
        rest.pop("use_dora", None)
        for key in lora_keys:
            if key in rest:
                conversion.skip(key, "finetuning_type: full trains every weight; LoRA settings do not apply")
                rest.pop(key)
    elif method == "freeze":
        conversion.skip(
            "finetuning_type",
            "freeze (only the last layers train) is not supported: converted as a full fine-tune; LoRA (finetuning_type: lora) trains far fewer weights",
        )
        for key in [k for k in rest if k.startswith("freeze_trainable") or k == "freeze_extra_modules"]:
            conversion.skip(key, "belongs to finetuning_type: freeze")
            rest.pop(key)
    elif method == "lora":
        given = {key for key in lora_keys if key in rest}
        rank = to_int(rest.pop("lora_rank", 8), "lora_rank")
        if "lora_rank" in given:
            conversion.set("model.lora.r", rank, "from lora_rank")
        else:
            conversion.default(PEER_DEFAULTS["lora_rank"])
        alpha = rest.pop("lora_alpha", None)
        if alpha is not None:
            conversion.set("model.lora.alpha", to_float(alpha, "lora_alpha"), "from lora_alpha")
        else:
            conversion.default(PEER_DEFAULTS["lora_alpha"], float(2 * rank))
        dropout = rest.pop("lora_dropout", None)
        if dropout is not None:
            conversion.set("model.lora.dropout", to_float(dropout, "lora_dropout"), "from lora_dropout")
        else:
            conversion.default(PEER_DEFAULTS["lora_dropout"])
        dora = rest.pop("use_dora", None)
        if dora:
            conversion.set("model.lora.kind", "dora", "from use_dora: true (peft's DoRA, as LLaMA-Factory trains it)")
        elif dora is False:
            conversion.already.append("use_dora: false (model.lora.kind: lora)")
        target = rest.pop("lora_target", "all")
        if target == "all":
            if "lora_target" in given:
                conversion.set("model.lora.target_modules", "all-linear", "from lora_target: all")
            else:
                conversion.default(PEER_DEFAULTS["lora_target"], "all-linear")
        else:
            names = [name.strip() for name in (target.split(",") if isinstance(target, str) else target) if str(name).strip()]
            conversion.set("model.lora.target_modules", names, "from lora_target")
    else:
        raise ConversionError(f"{conversion.source}: finetuning_type: {method} is not one ZeRO-Pipe knows (lora, full, freeze)")
    bits = rest.pop("quantization_bit", None)
    double = rest.pop("double_quantization", None)
    quant_type = rest.pop("quantization_type", None)
    if bits is not None:
        if to_int(bits, "quantization_bit") == 4 and method == "lora":
            conversion.set("model.quantization.load_in_4bit", True, "from quantization_bit: 4 (QLoRA)")
            conversion.set("model.quantization.double_quant", bool(double) if double is not None else True,
                           "from double_quantization" if double is not None else "LLaMA-Factory's default double_quantization is true")
            if quant_type is not None:
                if quant_type in ("nf4", "fp4"):
                    conversion.set("model.quantization.quant_type", quant_type, "from quantization_type")
                else:
                    conversion.skip("quantization_type", f"{quant_type!r}: nf4 or fp4")
            else:
                conversion.set("model.quantization.quant_type", "nf4", "LLaMA-Factory's default quantization_type is nf4")
        elif to_int(bits, "quantization_bit") == 8 and method == "lora":
            conversion.set(
                "model.quantization.format", "fp8",
                "from quantization_bit: 8: the base stored in 8 bits; LLaMA-Factory's is bitsandbytes' int8, ZeRO-Pipe's 8-bit base is fp8 (e4m3, a scale "
                "per output channel), which ZeRO-3 partitions (model.quantization: int8 keeps bitsandbytes, ZeRO-0..2 only)",
            )
        else:
            conversion.skip("quantization_bit", f"{bits}: ZeRO-Pipe stores a quantized base for LoRA only: 4 (QLoRA) or 8 (fp8) with finetuning_type: lora")
    for key, value in (("double_quantization", double), ("quantization_type", quant_type)):
        if value is not None and bits is None:
            conversion.skip(key, f"{value!r}: applies to quantization_bit, which is not set")
    if prequantized == "fp8":
        if method == "lora":
            # Said last: the file's own storage wins over a quantization_bit that would quantize it again.
            conversion.entries.pop("model.quantization.load_in_4bit", None)
            conversion.entries.pop("model.quantization.double_quant", None)
            conversion.entries.pop("model.quantization.quant_type", None)
            conversion.set("model.quantization.format", "fp8", "the base is a fine-grained FP8 checkpoint: its fp8 weights and block scales (weight_scale_inv) are read as stored")
        else:
            conversion.blocking.append(
                "model_name_or_path is a fine-grained FP8 checkpoint: a full fine-tune cannot update weights stored in fp8; "
                "use finetuning_type: lora (LoRA on the fp8 base as stored), or the bf16 release of the model"
            )


def _prequantized(conversion: Conversion, key: str) -> str | None:
    """A base already quantized by AWQ, GPTQ, AQLM...: LoRA on it is not something ZeRO-Pipe can load or shard.

    Returns "fp8" for transformers' fine-grained FP8 (Qwen3-*-FP8, DeepSeek-V3), which the fp8 base reads as stored.
    """
    name = str(conversion.entries["model.path"].value)
    method = None
    config_file = Path(name) / "config.json"
    if config_file.is_file():
        try:
            method = (json.loads(config_file.read_text()).get("quantization_config") or {}).get("quant_method")
        except (json.JSONDecodeError, AttributeError):
            method = None
    else:
        method = next((kind for kind in PREQUANTIZED if kind in re.split(r"[-_./]", name.lower())), None)
    if str(method).lower() == "fp8":
        return "fp8"
    if method and str(method).lower() != "bitsandbytes":
        conversion.blocking.append(
            f"{key} {name!r} is a pre-quantized {str(method).upper()} checkpoint: ZeRO-Pipe trains LoRA on a base in deepspeed.precision or "
            "4-bit bitsandbytes (QLoRA) or fp8, and cannot load or shard these kernels: use the unquantized base, with quantization_bit: 4 for QLoRA"
        )
    return None


# LLaMA-Factory's templates of vision-language models (src/llamafactory/data/template.py: qwen2_vl, qwen3_vl_nothink, llava, gemma3, mllama,
# intern_vl, glm4v, moss_vl, paligemma, pixtral...).
VLM_TEMPLATE = re.compile(r"(^|_)(vl|llava|gemma3n?|mllama|intern_?vl|glm4v|paligemma|pixtral|minicpm_v|idefics|kimi_vl|mistral_small)(_|$)")


def _vision(conversion: Conversion, rest: dict[str, Any], looks_like_vlm: bool = False) -> None:
    """LLaMA-Factory's freeze_* switches for multimodal models become model.trainable."""
    keys = ("freeze_vision_tower", "freeze_multi_modal_projector", "freeze_language_model")
    given = {key: rest.pop(key) for key in keys if key in rest}
    path = conversion.entries.get("model.path")
    config_file = Path(str(path.value)) / "config.json" if path else None
    is_vlm = False
    if config_file is not None and config_file.is_file():
        try:
            is_vlm = "vision_config" in json.loads(config_file.read_text())
        except json.JSONDecodeError:
            is_vlm = False
    if not is_vlm:
        why = ("the model is not a vision-language model (no vision_config in its config.json)" if config_file is not None and config_file.is_file()
               else "the model's config.json could not be read (model.path is not a local folder yet), so whether it is a vision-language model is not known: "
                    "convert again once it is downloaded, or set model.trainable")
        for key in given:
            conversion.skip(key, why)
        if looks_like_vlm and not given and not (config_file is not None and config_file.is_file()):
            # The recipe is a vision-language one (its template), but the model is not here to tell: its default freezing is said, not guessed.
            conversion.skip(
                "freeze_vision_tower",
                f"not set: LLaMA-Factory's default trains the language model only ({PEER_DEFAULTS['freeze_vision_tower'].source}), and ZeRO-Pipe's "
                "the projector too; model.path is not a local folder yet, so whether this is a vision-language model is not known: "
                "set model.trainable: [language_model] (or convert again once it is downloaded)",
            )
        return
    # LLaMA-Factory's defaults: tower and projector frozen, language model trained.
    frozen = {"vision_tower": given.get("freeze_vision_tower", True), "projector": given.get("freeze_multi_modal_projector", True), "language_model": given.get("freeze_language_model", False)}
    trainable = [part for part, is_frozen in frozen.items() if not is_frozen]
    if given:
        conversion.set("model.trainable", trainable, f"from {', '.join(given)} (LLaMA-Factory's defaults for the others: {PEER_DEFAULTS['freeze_vision_tower'].source})")
    else:
        conversion.default(PEER_DEFAULTS["freeze_vision_tower"], trainable)


def _preference(conversion: Conversion, stage: str, rest: dict[str, Any]) -> None:
    """stage: dpo / kto / rm as the preference: section (LLaMA-Factory's pref_* and kto_* keys)."""
    beta_given = "pref_beta" in rest
    beta = to_float(rest.pop("pref_beta", 0.1), "pref_beta")
    beta_why = "from pref_beta" if beta_given else "LLaMA-Factory's default pref_beta"
    ftx = to_float(rest.pop("pref_ftx", 0.0), "pref_ftx")
    smoothing = to_float(rest.pop("dpo_label_smoothing", 0.0), "dpo_label_smoothing")
    loss = str(rest.pop("pref_loss", "sigmoid"))
    gamma = rest.pop("simpo_gamma", None)
    for key in ("ref_model", "ref_model_adapters", "ref_model_quantization_bit", "ld_alpha", "pref_bco_weight"):
        value = rest.pop(key, None)
        if not is_unset(value):
            conversion.skip(key, f"{value!r}: the reference is the starting model (LoRA: the base with the adapters off; full: its log-probs computed once): remove it")
    if stage == "rm":
        for key, value in (("pref_beta", beta_given), ("pref_loss", loss != "sigmoid"), ("pref_ftx", ftx)):
            if value:
                conversion.skip(key, "a reward model has no preference loss settings: remove it")
        conversion.set("preference.method", "reward", "from stage: rm (a scalar-head reward model, pairwise loss, exported for AutoModelForSequenceClassification)")
        return
    if stage == "kto":
        conversion.set("preference.method", "kto", "from stage: kto")
        conversion.set("preference.beta", beta, beta_why)
        for source, target in (("kto_chosen_weight", "desirable_weight"), ("kto_rejected_weight", "undesirable_weight")):
            if source in rest:
                conversion.set(f"preference.{target}", to_float(rest.pop(source), source), f"from {source}")
        if ftx:
            conversion.skip("pref_ftx", f"{ftx}: KTO's SFT mix is not supported: remove it")
        return
    for key in ("kto_chosen_weight", "kto_rejected_weight"):
        if key in rest:
            conversion.skip(key, f"{rest.pop(key)!r}: KTO's weights do not apply to stage: {stage}")
    if loss not in PREF_LOSSES:
        conversion.blocking.append(f"pref_loss: {loss} is not one ZeRO-Pipe trains (it has {', '.join(PREF_LOSSES)}): set pref_loss to one of them")
        return
    method, losses = PREF_LOSSES[loss]
    conversion.set("preference.method", method, f"from stage: dpo and pref_loss: {loss}")
    conversion.set("preference.beta", beta, beta_why)
    if losses is not None:
        if ftx:
            # LLaMA-Factory adds pref_ftx x the chosen answers' NLL: TRL's sft loss, weighted.
            conversion.set("preference.loss_type", [*losses, "sft"], f"from pref_loss: {loss} and pref_ftx: {ftx}")
            conversion.set("preference.loss_weights", [1.0, ftx], "from pref_ftx (the NLL is averaged over the batch's chosen tokens, as TRL does)")
        else:
            conversion.set("preference.loss_type", losses, f"from pref_loss: {loss}")
        if smoothing:
            conversion.set("preference.loss_type", ["robust", *(["sft"] if ftx else [])], "from dpo_label_smoothing (TRL's robust DPO)")
            conversion.set("preference.label_smoothing", smoothing, "from dpo_label_smoothing")
    elif method == "simpo":
        conversion.set("preference.simpo_gamma", to_float(gamma if gamma is not None else 0.5, "simpo_gamma"), "from simpo_gamma" if gamma is not None else "LLaMA-Factory's default simpo_gamma")
        conversion.set("preference.cpo_alpha", ftx, "from pref_ftx (the chosen answers' NLL in SimPO's loss)")
    elif ftx:
        conversion.skip("pref_ftx", f"{ftx}: ORPO always adds the chosen answers' NLL with weight 1")


def _preference_source(conversion: Conversion, key: str, entry: dict[str, Any], data_file: Path, file_name: str) -> tuple[str, Path, str] | None:
    """A ranking (or KTO) dataset: read as it is, its columns under ZeRO-Pipe's preference names (data/preference.py)."""
    columns = dict(entry.get("columns") or {})
    formatting = entry.get("formatting", "alpaca")
    ours = {"messages": "conversations" if formatting == "sharegpt" else None, "prompt": "instruction", "query": "input", "kto_tag": "label"}
    renames = {ours.get(name) or name: column for name, column in columns.items() if column != (ours.get(name) or name)}
    if renames:
        conversion.set("data.columns", renames, f"from {key}'s columns")
    tags = dict(entry.get("tags") or {})
    if tags.get("role_tag", "from") not in ("from", "role"):
        conversion.skip(f"{key} tags", f"{tags}: turns are read as from/value or role/content: rename them in {data_file.name}")
        return None
    return (f"{key} (file_name {file_name})", data_file, "auto")


def _datasets(conversion: Conversion, rest: dict[str, Any], path: Path, forced_format: str | None, vision: bool = False) -> None:
    names = rest.pop("dataset", None)
    if is_unset(names):
        conversion.skip("dataset", "no dataset: set data.path to a local .jsonl/.json file")
        return
    names = [name.strip() for name in (names.split(",") if isinstance(names, str) else names) if str(name).strip()]
    folder_name = str(rest.pop("dataset_dir", "data"))
    if folder_name.startswith("REMOTE:"):
        raise ConversionError(
            f"{path}: dataset_dir: {folder_name} is a dataset folder on the Hub; ZeRO-Pipe downloads nothing: "
            f"`huggingface-cli download --repo-type dataset {folder_name[len('REMOTE:'):]} --local-dir DIR`, then set dataset_dir: DIR"
        )
    # Every base is tried for the file itself: a data/ folder without dataset_info.json in the first one does not hide the second.
    info_file = find_path(str(Path(folder_name) / "dataset_info.json"), Path.cwd(), path.parent)
    if info_file is None or not info_file.is_file():
        raise ConversionError(
            f"{path}: dataset: {', '.join(names)} is described in dataset_dir/dataset_info.json, but {folder_name}/dataset_info.json "
            f"was not found (looked relative to {Path.cwd()} and {path.parent}): set dataset_dir to the folder that holds it"
        )
    try:
        info = json.loads(info_file.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{info_file} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}): fix it") from None
    if not isinstance(info, dict):
        raise ConversionError(f"{info_file} must hold a JSON object of dataset descriptions")
    # A vision-language recipe (an images column, or a VLM's freeze_* switches) reads one data.path: ZeRO-Pipe's
    # vision-language runs do not draw mixtures (data.mixture is for causal language models).
    with_images = [name for name in names if isinstance(info.get(name), dict) and "images" in (info[name].get("columns") or {})]
    if len(names) > 1 and (with_images or vision):
        imaged = f" ({', '.join(with_images)} with images)" if with_images else ""
        conversion.blocking.append(
            f"dataset: {', '.join(names)} is several datasets for a vision-language model{imaged}; "
            "ZeRO-Pipe's vision-language runs read one data.path ({messages, images} JSONL): join the records into one file and set data.path to it"
        )
    sources: list[tuple[str, Path, str]] = []
    for name in names:
        entry = info.get(name)
        key = f"dataset {name}"
        if not isinstance(entry, dict):
            close = ", ".join(sorted(info)[:8])
            conversion.skip(key, f"not described in {info_file} (it describes {close}{', ...' if len(info) > 8 else ''})")
            continue
        source = _source(conversion, key, dict(entry), info_file.parent, forced_format)
        if source is not None:
            sources.append(source)
    if sources:
        map_sources(conversion, sources, "from dataset_info.json's formatting and columns")


def _source(conversion: Conversion, key: str, entry: dict[str, Any], folder: Path, forced_format: str | None) -> tuple[str, Path, str] | None:
    for remote in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name"):
        if entry.get(remote):
            conversion.skip(
                key,
                f"{remote}: {entry[remote]}: ZeRO-Pipe reads local files and downloads nothing: download it, add a .jsonl/.json file "
                "and point data.path at it",
            )
            return None
    file_name = entry.get("file_name")
    data_file = folder / str(file_name) if file_name else None
    if data_file is None or not data_file.exists():
        conversion.skip(key, f"file_name {file_name!r} not found in {folder}")
        return None
    if forced_format == "preference":
        return _preference_source(conversion, key, entry, data_file, str(file_name))
    if entry.get("ranking"):
        conversion.skip(key, "a preference dataset (ranking: true) is for the rm/dpo stages: set stage: dpo (or rm) to train on it")
        return None
    formatting = entry.get("formatting", "alpaca")
    columns = dict(entry.get("columns") or {})
    tags = dict(entry.get("tags") or {})
    for column in ("system", "tools", "history", "videos", "audios", "kto_tag"):
        if columns.pop(column, None):
            conversion.skip(f"{key} columns.{column}", f"the {column} column is not read: records train on their {'instruction/input/output' if formatting == 'alpaca' else 'messages'}")
    if columns.pop("images", None) not in (None, "images"):
        conversion.skip(f"{key} columns.images", "images are read from an 'images' key: rename the column in the file")
    if forced_format == "text":
        prompt = columns.get("prompt", "text")
        if prompt != "text":
            conversion.skip(f"{key} columns.prompt", f"{prompt!r}: plain-text records are read from a 'text' key: rename the key in the file")
            return None
        return (f"{key} (file_name {file_name})", data_file, "text")
    if formatting == "alpaca":
        wanted = {name: columns.get(name, default) for name, default in ALPACA_COLUMNS.items()}
        if wanted != ALPACA_COLUMNS:
            conversion.skip(
                f"{key} columns",
                f"{wanted}: ZeRO-Pipe reads alpaca records from instruction/input/output: rename the keys in {data_file.name}",
            )
            return None
        return (f"{key} (file_name {file_name})", data_file, "alpaca")
    if formatting == "sharegpt":
        messages = columns.get("messages", "conversations")
        merged = {**SHAREGPT_TAGS, **tags}
        relevant = ("role_tag", "content_tag", "user_tag", "assistant_tag")
        if messages == "conversations" and all(merged[t] == SHAREGPT_TAGS[t] for t in relevant):
            return (f"{key} (file_name {file_name})", data_file, "sharegpt")
        if messages == "messages" and all(merged[t] == OPENAI_TAGS[t] for t in relevant):
            return (f"{key} (file_name {file_name})", data_file, "chat")
        conversion.skip(
            f"{key} columns/tags",
            f"messages in {messages!r} with {merged['role_tag']}/{merged['content_tag']} and speakers {merged['user_tag']}/{merged['assistant_tag']}: "
            "ZeRO-Pipe reads conversations with from/value and human/gpt (sharegpt) or messages with role/content and user/assistant "
            f"(chat): rename them in {data_file.name}",
        )
        return None
    conversion.skip(f"{key} formatting", f"{formatting!r}: ZeRO-Pipe reads alpaca and sharegpt formatting")
    return None
