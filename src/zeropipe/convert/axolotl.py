"""axolotl (github.com/axolotl-ai-cloud/axolotl) YAML configs: supervised fine-tuning, LoRA and QLoRA."""

from __future__ import annotations

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

# axolotl's defaults that differ from ZeRO-Pipe's, where its source sets them (github.com/axolotl-ai-cloud/axolotl at 067b021):
# a file that leaves the key out trains with these there, so the conversion writes them.
PEER_DEFAULTS = {
    # lr_scheduler: "cosine" (training.py:144) with cosine_min_lr_ratio unset (line 152): Hugging Face's cosine, to 0; ZeRO-Pipe's ends at 10%.
    "lr_scheduler": PeerDefault("lr_scheduler", "cosine", "train.min_lr_ratio", "src/axolotl/utils/schemas/training.py:144, decaying to 0 "
                                "as cosine_min_lr_ratio is unset, line 152", "unless cosine_min_lr_ratio", written=0.0),
    "lora_dropout": PeerDefault("lora_dropout", 0.0, "model.lora.dropout", "src/axolotl/utils/schemas/peft.py:80", "lora"),
}

# Keys that only steer axolotl's own machinery, and why ZeRO-Pipe needs no counterpart.
NOT_MAPPED = {
    "model_type": "the model class is read from config.json",
    "tokenizer_type": "the tokenizer class is read from the tokenizer's files",
    "base_model_config": "the config is read from model.path",
    "chat_template": "ZeRO-Pipe renders conversations with the tokenizer's own chat template (a plain role-tagged layout when it has none)",
    "special_tokens": "the tokenizer's own special tokens are used; add tokens to the tokenizer folder itself",
    "tokens": "the tokenizer's own tokens are used; add tokens to the tokenizer folder itself",
    "dataset_prepared_path": "the data is tokenized once into the run's memory-mapped cache (RUN/cache)",
    "eval_sample_packing": "evaluation batches follow data.packing",
    "pad_to_sequence_len": "batches are padded to their longest example (or packed with data.packing)",
    "evals_per_epoch": "ZeRO-Pipe evaluates every N optimizer steps: set train.eval_every",
    "saves_per_epoch": "ZeRO-Pipe saves every N optimizer steps: set train.save_every (a final checkpoint is always saved)",
    "eval_table_size": "no generation table during evaluation; generate.prompts are answered at the end",
    "eval_max_new_tokens": "see generate.max_new_tokens",
    "loss_watchdog_threshold": "no loss watchdog; the run stops on a non-finite loss",
    "loss_watchdog_patience": "no loss watchdog",
    "tf32": "TF32 matmuls follow PyTorch's defaults on the GPU",
    "strict": "unknown keys are always errors in ZeRO-Pipe configs",
    "resume_from_checkpoint": "resume with `zeropipe train FILE --resume [PATH]`",
    "auto_resume_from_checkpoints": "resume with `zeropipe train FILE --resume`",
    "hub_model_id": "nothing is uploaded; export with `zeropipe export RUN --out DIR`",
    "hub_strategy": "nothing is uploaded",
    "push_dataset_to_hub": "nothing is uploaded",
    "early_stopping_patience": "no early stopping; watch eval loss in metrics.jsonl or `zeropipe ui`",
    "lora_modules_to_save": "only LoRA adapters train in a LoRA run",
    "lora_fan_in_fan_out": "peft detects the layout",
    "gradient_checkpointing_kwargs": "ZeRO-Pipe picks the checkpointing implementation",
    "load_in_8bit": "an 8-bit base trains adapters only (model.quantization: fp8 with adapter: lora); without an adapter the base is held in deepspeed.precision",
    "fsdp": "ZeRO-Pipe uses DeepSpeed ZeRO, not FSDP: FSDP's full_shard is ZeRO-3 (deepspeed.zero_stage: 3)",
    "fsdp_config": "ZeRO-Pipe uses DeepSpeed ZeRO, not FSDP: FSDP's full_shard is ZeRO-3 (deepspeed.zero_stage: 3), cpu offload is deepspeed.offload_param: cpu",
    "xformers_attention": "attention runs on PyTorch's sdpa kernels",
    "s2_attention": "not supported",
    "sdp_attention": "attention runs on PyTorch's sdpa kernels (the default)",
    "debug": "see logs/rank*.log",
    "local_rank": "ranks are started by ZeRO-Pipe",
    "wandb_entity": "set WANDB_ENTITY in the environment",
    "wandb_name": "the W&B run is named after run.name",
    "wandb_watch": "not supported",
    "wandb_log_model": "models are not uploaded",
    "train_on_inputs": "loss is on the responses only: training on prompts is not supported",
}
# rl: values ZeRO-Pipe trains, as (preference.method, DPO's loss_type).
RL_METHODS = {"dpo": ("dpo", None), "ipo": ("dpo", ["ipo"]), "orpo": ("orpo", None), "simpo": ("simpo", None), "kto": ("kto", None)}
RL_NAMES = {"dpo": "DPO", "ipo": "IPO", "kto": "KTO", "orpo": "ORPO", "simpo": "SimPO", "grpo": "GRPO", "gdpo": "GDPO", "ppo": "PPO"}
ATTENTION_KEYS = ("flash_attention", "attn_implementation")
# Words in a LoRA target expression that name a vision-language model's parts (transformers' module names: Qwen2.5-VL's visual and
# merger, LLaVA's vision_tower and multi_modal_projector, Mllama's vision_model).
VLM_PART_WORDS = (("vision_tower", ("vision_tower", "visual.", "vision_model")), ("projector", ("multi_modal_projector", "merger")),
                  ("language_model", ("language_model",)))


def convert(path: Path, raw: dict[str, Any]) -> Conversion:
    conversion = Conversion("axolotl", path)
    rest = dict(raw)
    bases = (Path.cwd(), path.parent)
    rl = rest.pop("rl", None)
    if str(rl).lower() == "grpo":
        _grpo(conversion, rest)
        rl = None
    preference = rl not in (None, "", False) or bool(rest.get("reward_model"))
    if rl not in (None, "", False):
        name = RL_NAMES.get(str(rl).lower(), str(rl))
        if str(rl).lower() not in RL_METHODS:
            raise ConversionError(
                f"{path}: rl: {rl} asks for {name} training, which ZeRO-Pipe does not do (it trains dpo, ipo, orpo, simpo and kto "
                "preference tuning, grpo, reward models and supervised fine-tunes): convert the SFT stage of your recipe instead"
            )
        _preference(conversion, str(rl).lower(), rest)
    if rest.get("process_reward_model"):
        raise ConversionError(f"{path}: process reward models (per-step rewards) are not supported by ZeRO-Pipe: train an outcome reward model (reward_model: true)")
    if rest.pop("reward_model", None):
        conversion.set("preference.method", "reward", "from reward_model: true (a scalar-head reward model, pairwise loss, exported for AutoModelForSequenceClassification)")

    local_model(conversion, "base_model", str(rest.pop("base_model", "")), bases)
    tokenizer = rest.pop("tokenizer_config", None)
    if not is_unset(tokenizer):
        found = find_path(str(tokenizer), *bases)
        if found is not None and found.is_dir():
            conversion.set("model.tokenizer", str(found), "from tokenizer_config")
        else:
            conversion.skip("tokenizer_config", f"{tokenizer!r} is not a local folder: the tokenizer is read from model.path")
    remote = rest.pop("trust_remote_code", None)
    if remote:
        conversion.set("model.load_kwargs", {"trust_remote_code": True}, "from trust_remote_code")
    elif remote is False:
        conversion.already.append("trust_remote_code: false")
    checkpointing = rest.pop("gradient_checkpointing", None)
    if checkpointing is True:
        conversion.set("model.gradient_checkpointing", True, "from gradient_checkpointing")
    elif checkpointing is False:
        conversion.set("model.gradient_checkpointing", False, "from gradient_checkpointing: false")
    elif checkpointing == "offload":
        # axolotl's "offload" keeps the checkpointed activations in host RAM; ZeRO-Pipe recomputes them on the GPU.
        conversion.set("model.gradient_checkpointing", True, "from gradient_checkpointing: offload, as plain checkpointing (see the list above)")
        conversion.skip("gradient_checkpointing", "'offload': activations are checkpointed but kept on the GPU, not offloaded to host RAM: `zeropipe plan` shows whether that fits")
    elif not is_unset(checkpointing):
        conversion.skip("gradient_checkpointing", f"{checkpointing!r}: true, false or offload")
    for key in ATTENTION_KEYS:
        value = rest.pop(key, None)
        if value in (None, "", False):
            if value is False:
                conversion.already.append(f"{key}: false (attention runs on PyTorch's sdpa kernels)")
            continue
        conversion.set("model.attn_implementation", "sdpa", f"from {key}: {value} (PyTorch's sdpa uses flash kernels where it can)")

    lora_model_dir = rest.pop("lora_model_dir", None)
    _adapter(conversion, rest)
    if "model.lora.r" in conversion.entries:
        map_adapter_init(conversion, "lora_model_dir", lora_model_dir)
    elif not is_unset(lora_model_dir):
        conversion.skip("lora_model_dir", f"{lora_model_dir!r}: without adapter: lora/qlora this is a full fine-tune, which starts from the base; merge the adapter into it first and set model.path to the merged folder")
    _datasets(conversion, rest, bases, preference)

    _test_datasets(conversion, rest, bases, preference)
    if "sequence_len" in rest:
        conversion.set("data.max_seq_len", to_int(rest.pop("sequence_len"), "sequence_len"), "from sequence_len")
    packing = rest.pop("sample_packing", None)
    if packing is True:
        conversion.set("data.packing", True, "from sample_packing (examples never attend to each other, as axolotl's multipack)")
    elif packing is False:
        conversion.already.append("sample_packing: false (no packing)")
    val = as_number(rest.pop("val_set_size", None))
    if val == 0:
        conversion.already.append("val_set_size: 0 (no held-out data)")
    elif val and preference:
        conversion.skip("val_set_size", f"{val}: {HELD_OUT_PAIRS}")
    elif val:
        if val < 1:
            conversion.set("data.eval_fraction", to_float(val, "val_set_size"), "from val_set_size")
        else:
            conversion.skip("val_set_size", f"{val}: a count of records; ZeRO-Pipe holds out a fraction: set data.eval_fraction")
    eval_steps = as_number(rest.pop("eval_steps", None))
    if eval_steps:
        if "data.eval_fraction" in conversion.entries or "data.eval_path" in conversion.entries:
            conversion.set("train.eval_every", to_int(eval_steps, "eval_steps"), "from eval_steps")
        else:
            conversion.skip("eval_steps", "no held-out data (val_set_size) to evaluate on")
    if "micro_batch_size" in rest:
        conversion.set("train.micro_batch_size", to_int(rest.pop("micro_batch_size"), "micro_batch_size"), "from micro_batch_size")
    if "num_epochs" in rest:
        conversion.set("train.epochs", to_float(rest.pop("num_epochs"), "num_epochs"), "from num_epochs")
    map_trainer_keys(conversion, rest, {"cosine_min_lr_ratio": ("train.min_lr_ratio", float)})
    if is_unset(rest.get("lr_scheduler")):
        rest.pop("lr_scheduler", None)
        if "train.min_lr_ratio" not in conversion.entries:  # cosine_min_lr_ratio, mapped above, is where it ends then
            conversion.default(PEER_DEFAULTS["lr_scheduler"])
    else:
        map_schedule(conversion, "lr_scheduler", rest.pop("lr_scheduler"))
    map_optimizer(conversion, "optimizer", rest.pop("optimizer", None))
    map_warmup_ratio(conversion, "warmup_ratio", rest.pop("warmup_ratio", None))
    map_precision(conversion, rest, "axolotl")
    map_deepspeed(conversion, "deepspeed", rest.pop("deepspeed", None), bases)
    map_sequence_parallel(conversion, rest, ("sequence_parallel_degree", "context_parallel_size"), "axolotl splits with ring-flash-attn's ring attention",
                          ("heads_k_stride", "ring_attn_func"))
    map_output_dir(conversion, rest.pop("output_dir", None))
    project = rest.pop("wandb_project", None)
    if not is_unset(project):
        conversion.set("logging.wandb", True, "from wandb_project")
        conversion.set("logging.wandb_project", str(project), "from wandb_project")
    if rest.get("train_on_inputs") is False:
        rest.pop("train_on_inputs")
        conversion.already.append("train_on_inputs: false (loss on responses only)")

    map_moe_keys(conversion, rest)
    list_rest(conversion, rest, NOT_MAPPED)
    return conversion


def _preference(conversion: Conversion, rl: str, rest: dict[str, Any]) -> None:
    """rl: and its keys (rl_beta, orpo_alpha, simpo_gamma, cpo_alpha, rpo_alpha, dpo_label_smoothing, kto_*) as the preference: section."""
    method, losses = RL_METHODS[rl]
    conversion.set("preference.method", method, f"from rl: {rl}")
    if losses:
        conversion.set("preference.loss_type", losses, f"from rl: {rl}")
    beta = rest.pop("rl_beta", None)
    # dpo_beta: rl_beta's former name. axolotl at 067b021 only warns that it is deprecated (src/axolotl/utils/schemas/deprecated.py:52-56) and
    # hands TRL rl_beta (core/builders/rl.py:124): the file's beta is what its author meant, so it is written, and said.
    old_beta = rest.pop("dpo_beta", None)
    beta_from = "from rl_beta"
    if is_unset(beta) and not is_unset(old_beta):
        beta, beta_from = old_beta, ("from dpo_beta, rl_beta's former name (axolotl now only warns that dpo_beta is deprecated and trains TRL's "
                                     "beta 0.1: rename it rl_beta there to train the same)")
    elif not is_unset(old_beta):
        conversion.skip("dpo_beta", f"{old_beta!r}: rl_beta ({beta!r}) is set too and wins, as in axolotl")
    if method == "orpo" and "orpo_alpha" in rest:
        # axolotl hands orpo_alpha to TRL's ORPOConfig as beta (the weight of the odds-ratio term).
        conversion.set("preference.beta", to_float(rest.pop("orpo_alpha"), "orpo_alpha"), "from orpo_alpha (ORPO's lambda, TRL's beta)")
    elif not is_unset(beta):
        conversion.set("preference.beta", to_float(beta, "rl_beta"), beta_from)
    for source, target in (("simpo_gamma", "simpo_gamma"), ("cpo_alpha", "cpo_alpha"), ("kto_desirable_weight", "desirable_weight"), ("kto_undesirable_weight", "undesirable_weight")):
        if not is_unset(rest.get(source)):
            conversion.set(f"preference.{target}", to_float(rest.pop(source), source), f"from {source}")
    smoothing = rest.pop("dpo_label_smoothing", None)
    rpo = rest.pop("rpo_alpha", None)
    if method == "dpo":
        base = losses or (["robust"] if not is_unset(smoothing) and float(smoothing) else ["sigmoid"])
        if not is_unset(smoothing) and float(smoothing):
            conversion.set("preference.label_smoothing", to_float(smoothing, "dpo_label_smoothing"), "from dpo_label_smoothing (TRL's robust DPO)")
        if not is_unset(rpo):
            conversion.set("preference.loss_type", [*base, "sft"], "from rpo_alpha (TRL's RPO: the chosen answers' NLL added)")
            conversion.set("preference.loss_weights", [1.0, to_float(rpo, "rpo_alpha")], "from rpo_alpha")
        elif base != ["sigmoid"]:
            conversion.set("preference.loss_type", base, "from dpo_label_smoothing")
    else:
        for key, value in (("dpo_label_smoothing", smoothing), ("rpo_alpha", rpo)):
            if not is_unset(value):
                conversion.skip(key, f"{value!r}: applies to rl: dpo only")
    for key in ("dpo_use_weighting", "dpo_use_logits_to_keep", "dpo_padding_free", "dpo_norm_loss", "precompute_ref_log_probs", "ref_model"):
        value = rest.pop(key, None)
        if not is_unset(value) and value is not False:
            conversion.skip(key, f"{value!r}: not supported; the reference is the starting model (LoRA: adapters off; full: log-probs computed once before training)")


# axolotl's trl: keys of an rl: grpo recipe that the grpo: section has under the same name (TRL's GRPOConfig's).
GRPO_KEYS = {"beta": float, "num_generations": int, "max_completion_length": int, "epsilon": float, "epsilon_high": float, "delta": float,
             "temperature": float, "top_p": float, "top_k": int, "loss_type": str, "scale_rewards": str, "importance_sampling_level": str,
             "mask_truncated_completions": bool, "num_iterations": int}


def _grpo(conversion: Conversion, rest: dict[str, Any]) -> None:
    """rl: grpo and its trl: block as the grpo: section; reward_funcs become function rewards, a dataset's Python transform is dropped."""
    trl = rest.pop("trl", None) or {}
    conversion.set("grpo.loss_type", str(trl.pop("loss_type", "dapo")), "from rl: grpo (trl.loss_type; TRL's default dapo)")
    for key, kind in GRPO_KEYS.items():
        value = trl.pop(key, None)
        if is_unset(value) or key == "loss_type":
            continue
        if kind is str and key == "scale_rewards" and isinstance(value, bool):
            value = "group" if value else "none"  # TRL < 0.22 took a boolean
        converted = to_float(value, f"trl.{key}") if kind is float else to_int(value, f"trl.{key}") if kind is int else kind(value)
        conversion.set(f"grpo.{key}", converted, f"from trl.{key}")
    # TRL's per_device_train_batch_size (axolotl's micro_batch_size) counts completions; ZeRO-Pipe's micro-batch counts prompts.
    generations = conversion.entries["grpo.num_generations"].value if "grpo.num_generations" in conversion.entries else 8
    micro = rest.pop("micro_batch_size", None)
    if not is_unset(micro):
        prompts = max(1, to_int(micro, "micro_batch_size") // generations)
        conversion.set("train.micro_batch_size", prompts, f"from micro_batch_size {micro}: completions per device in TRL, prompts per rank here, "
                       f"each answered num_generations ({generations}) times: {prompts} x {generations} completions per rank")
    functions = trl.pop("reward_funcs", None) or []
    weights = trl.pop("reward_weights", None) or [1.0] * len(functions)
    rewards = []
    for function, weight in zip(functions, weights, strict=False):
        module, _, name = str(function).rpartition(".")
        rewards.append({"kind": "function", "function": f"{module}:{name}", "weight": to_float(weight, "trl.reward_weights")})
    if rewards:
        conversion.set("grpo.rewards", rewards, "from trl.reward_funcs (module.function -> module:function) and trl.reward_weights; importable on PYTHONPATH")
    for dataset in rest.get("datasets") or []:
        kind = dataset.get("type") if isinstance(dataset, dict) else None
        if isinstance(kind, str) and "." in kind and ":" not in kind:
            dataset.pop("type")
            conversion.skip("datasets.type", f"{kind!r}: a Python transform ZeRO-Pipe does not run; give records in TRL's prompt layout ({{prompt, answer}}) or a supervised format")
    for key, value in trl.items():
        if not is_unset(value) and value is not False:
            why = "generation runs in the training ranks, with the weights gathered once per round (docs/rl.md)" if "vllm" in key else "not supported (docs/rl.md lists the grpo keys)"
            conversion.skip(f"trl.{key}", f"{value!r}: {why}")


def _adapter(conversion: Conversion, rest: dict[str, Any]) -> None:
    adapter = rest.pop("adapter", None)
    four_bit_value = rest.pop("load_in_4bit", None)
    four_bit = bool(four_bit_value)
    if four_bit_value is False:
        conversion.already.append("load_in_4bit: false (the base is held in deepspeed.precision)")
    if adapter in (None, "", False):
        if four_bit:
            conversion.skip("load_in_4bit", "a 4-bit base can only train adapters: set adapter: qlora")
        for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_linear"):
            if not is_unset(rest.get(key)):
                conversion.skip(key, "no adapter: set, so this is a full fine-tune and LoRA settings do not apply")
            rest.pop(key, None)
        return
    if adapter not in ("lora", "qlora"):
        conversion.skip("adapter", f"{adapter!r}: ZeRO-Pipe trains LoRA and QLoRA adapters; converted as LoRA")
    conversion.set("model.lora.r", to_int(rest.pop("lora_r", 8) or 8, "lora_r"), f"from lora_r (adapter: {adapter})")
    alpha = rest.pop("lora_alpha", None)
    if alpha is not None:
        conversion.set("model.lora.alpha", to_float(alpha, "lora_alpha"), "from lora_alpha")
    dropout = rest.pop("lora_dropout", None)
    if dropout is not None:
        conversion.set("model.lora.dropout", to_float(dropout, "lora_dropout"), "from lora_dropout")
    else:
        conversion.default(PEER_DEFAULTS["lora_dropout"])
    dora = rest.pop("peft_use_dora", None)
    if dora:
        conversion.set("model.lora.kind", "dora", "from peft_use_dora: true (peft's DoRA, as axolotl trains it)")
    elif dora is False:
        conversion.already.append("peft_use_dora: false (model.lora.kind: lora)")
    modules = rest.pop("lora_target_modules", None)
    linear = rest.pop("lora_target_linear", None)
    if linear is False:
        conversion.already.append("lora_target_linear: false (the modules adapted are lora_target_modules, or auto)")
    if linear:
        conversion.set("model.lora.target_modules", "all-linear", "from lora_target_linear: true")
        if not is_unset(modules):
            conversion.skip("lora_target_modules", "lora_target_linear: true already adapts every linear layer")
    elif isinstance(modules, str) and re.search(r"[\\\[\]()|*+?^$]", modules):
        # peft reads a string as a regular expression over whole module names (axolotl's vision recipes adapt the language
        # model's layers only): ZeRO-Pipe passes it on as such, where a one-name list would match nothing.
        conversion.set("model.lora.target_modules", modules, "from lora_target_modules: a regular expression matched against whole module names, as peft reads it")
        # A vision-language recipe's expression names the parts it adapts (model.language_model.layers...): axolotl adapts only those, the rest
        # stays frozen. ZeRO-Pipe adapts model.trainable's parts (default: projector and language model), so it is written: a part the
        # expression matches nothing in would be refused before the first step.
        parts = [part for part, words in VLM_PART_WORDS if any(word in modules for word in words)]
        if parts:
            conversion.set("model.trainable", parts, f"from lora_target_modules: the expression names the {' and '.join(parts)} only, which axolotl adapts; the rest stays frozen")
    elif not is_unset(modules):
        conversion.set("model.lora.target_modules", [modules] if isinstance(modules, str) else list(modules), "from lora_target_modules")
    if adapter == "qlora" or four_bit:
        said = " and ".join(name for name, given in (("adapter: qlora", adapter == "qlora"), ("load_in_4bit: true", four_bit)) if given)
        conversion.set("model.quantization.load_in_4bit", True, f"from {said} (nf4 with double quantization, as axolotl's default)")
    elif rest.get("load_in_8bit"):
        rest.pop("load_in_8bit")
        conversion.set(
            "model.quantization.format", "fp8",
            "from load_in_8bit: true: the base stored in 8 bits; axolotl's is bitsandbytes' int8, ZeRO-Pipe's 8-bit base is fp8 (e4m3, a scale per "
            "output channel), which ZeRO-3 partitions (model.quantization: int8 keeps bitsandbytes, ZeRO-0..2 only)",
        )


def _datasets(conversion: Conversion, rest: dict[str, Any], bases: tuple[Path, ...], preference: bool = False) -> None:
    datasets = rest.pop("datasets", None)
    if is_unset(datasets):
        conversion.skip("datasets", "no datasets: set data.path to a local .jsonl/.json file")
        return
    if not isinstance(datasets, list):
        datasets = [datasets]
    sources: list[tuple[str, Path, str]] = []
    for number, dataset in enumerate(datasets):
        key = f"datasets[{number}]"
        if not isinstance(dataset, dict):
            conversion.skip(key, f"{dataset!r} is not a mapping with path: and type:")
            continue
        source = _dataset(conversion, key, dict(dataset), bases, preference)
        if source is not None:
            sources.append(source)
    if sources:
        map_sources(conversion, sources, "from the datasets' type")


def _test_datasets(conversion: Conversion, rest: dict[str, Any], bases: tuple[Path, ...], preference: bool) -> None:
    """test_datasets (axolotl's held-out data, src/axolotl/utils/schemas/config.py:358) as data.eval_path: one file, read as the training data."""
    datasets = rest.pop("test_datasets", None)
    if is_unset(datasets):
        return
    datasets = datasets if isinstance(datasets, list) else [datasets]
    if preference:
        conversion.skip("test_datasets", HELD_OUT_PAIRS)
        return
    if len(datasets) > 1 or not isinstance(datasets[0], dict):
        conversion.skip("test_datasets", f"{len(datasets)} datasets: data.eval_path is one file: join them into one and set data.eval_path to it")
        return
    found = _dataset(conversion, "test_datasets[0]", dict(datasets[0]), bases, preference)
    if found is None:
        return
    _, path, fmt = found
    data_format = conversion.entries.get("data.format")
    if data_format is not None and data_format.value != fmt:
        conversion.skip("test_datasets[0].type", f"{fmt} records, where the training data is {data_format.value}: data.eval_path is read in data.format; make them alike")
        return
    conversion.set("data.eval_path", str(path), "from test_datasets[0] (held-out data, evaluated every train.eval_every steps)")


def _dataset(conversion: Conversion, key: str, dataset: dict[str, Any], bases: tuple[Path, ...], preference: bool = False) -> tuple[str, Path, str] | None:
    name = dataset.pop("path", None)
    files = dataset.pop("data_files", None)
    if isinstance(files, list):
        files = files[0] if len(files) == 1 else files
    local = find_path(str(files if isinstance(files, str) else name or ""), *bases) if (files or name) else None
    kind = str(dataset.pop("type", "alpaca"))
    if isinstance(kind, str) and ":" in kind:
        base, _, style = kind.partition(":")
        conversion.skip(f"{key}.type", f"{kind!r}: read as {base}; the prompt style {style!r} is replaced by the tokenizer's chat template")
        kind = base
    fmt = _preference_format(conversion, key, kind, dataset) if preference else _format(conversion, key, kind, dataset)
    dataset_type = dataset.get("ds_type")
    for option in ("ds_type", "split", "shards", "name", "train_on_split"):
        value = dataset.pop(option, None)
        if option == "split" and value in (None, "train"):
            continue
        if option == "ds_type" and value in (None, "json"):
            continue
        if value is not None:
            conversion.skip(f"{key}.{option}", f"{value!r}: the local file is read whole")
    for option, value in dataset.items():
        if not is_unset(value):
            conversion.skip(f"{key}.{option}", f"{value!r}: not supported for {kind} data")
    given = files if isinstance(files, str) else name
    if local is None and given is not None and looks_like_a_file(str(given), dataset_type):
        # A file of the user's that is not on this machine yet: written as given (relative to the config, as axolotl reads it from
        # where it runs), and listed, so that `zeropipe check` says so until it is copied.
        written = Path(str(given)).expanduser()
        local = written if written.is_absolute() else bases[-1] / written
        conversion.skip(f"{key}.{'data_files' if given is files else 'path'}", f"{given!r} is not on this machine (looked relative to "
                        f"{', '.join(map(str, bases))}): written as {local}; copy the file there before `zeropipe check`")
    elif local is None and is_unset(given):
        conversion.skip(key, "no path: or data_files: names the data: set data.path to a local .jsonl/.json file")
        return None
    elif local is None:
        conversion.skip(
            key,
            f"{name!r} is not a local file or folder; ZeRO-Pipe reads local .jsonl/.json files and downloads nothing: "
            f"`huggingface-cli download --repo-type dataset {name} --local-dir DIR`, then point data.path at its .jsonl/.json file",
        )
        return None
    if fmt is None:
        return None
    return (f"{key}.path", local, fmt)


DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".arrow")


def looks_like_a_file(name: str, dataset_type: Any) -> bool:
    """A path of the user's (./data/x.jsonl, /data/x.json, or anything with ds_type: json), not a Hub dataset id (org/name)."""
    return (name.startswith(("./", "../", "/", "~")) or Path(name).suffix.lower() in DATA_SUFFIXES
            or dataset_type in ("json", "parquet", "csv", "text", "arrow"))


# axolotl's preference dataset types whose records data/preference.py reads as they are.
PREFERENCE_TYPES = ("chatml.intel", "chatml.argilla", "chatml.ultra", "llama3.intel", "llama3.argilla", "llama3.ultra", "chat_template.default",
                    "chat_template.argilla", "bradley_terry.chat_template", "chatml.prompt_pairs", "llama3.prompt_pairs", "user_defined.default")


def _preference_format(conversion: Conversion, key: str, kind: str, dataset: dict[str, Any]) -> str | None:
    """A preference dataset type: its records are read by layout (TRL, axolotl's intel/argilla/ultra), field names mapped to data.columns."""
    if kind not in PREFERENCE_TYPES and not kind.startswith(("chatml.", "llama3.", "chat_template.")):
        conversion.skip(f"{key}.type", f"{kind!r}: ZeRO-Pipe reads preference records as TRL (prompt/chosen/rejected), axolotl's intel, argilla and ultra layouts")
        return None
    columns = {}
    # chat_template.* records hold the prompt turns in field_messages (axolotl's default: messages), the answers as one turn each.
    messages = dataset.pop("field_messages", None)
    if kind == "chat_template.default" or not is_unset(messages):
        messages = "messages" if is_unset(messages) else str(messages)
        if messages != "conversations":
            columns["conversations"] = messages
    for option, ours in (("field_chosen", "chosen"), ("field_rejected", "rejected"), ("field_prompt", "prompt"), ("field_system", "system")):
        value = dataset.pop(option, None)
        if not is_unset(value) and value != ours:
            columns[ours] = str(value)
    for option in ("message_property_mappings", "roles", "message_field_role", "message_field_content"):
        value = dataset.pop(option, None)
        if not is_unset(value) and option in ("roles", "message_property_mappings") and value and option == "message_property_mappings" and value == {"role": "role", "content": "content"}:
            continue
        if not is_unset(value) and option == "roles":
            names = {str(a) for aliases in dict(value).values() for a in (aliases if isinstance(aliases, list) else [aliases])}
            if names <= {"user", "assistant", "system", "human", "gpt"}:
                continue
        if not is_unset(value):
            conversion.skip(f"{key}.{option}", f"{value!r}: turns are read as role/content (or from/value) with user/assistant/system speakers")
    if columns:
        conversion.set("data.columns", columns, f"from {key}'s field_* options")
    return "auto"


def _format(conversion: Conversion, key: str, kind: str, dataset: dict[str, Any]) -> str | None:
    """ZeRO-Pipe's data.format for an axolotl dataset type and its field options, or None (listed)."""
    if kind in ("alpaca", "alpaca_chat", "alpaca_w_system"):
        return "alpaca"
    if kind in ("completion", "pretrain"):
        field = dataset.pop("field", "text") or "text"
        if field != "text":
            conversion.skip(f"{key}.field", f"{field!r}: plain-text records are read from a 'text' key: rename the key in the file")
            return None
        return "text"
    if kind == "sharegpt":
        return "sharegpt"
    if kind == "chat_template":
        field = dataset.pop("field_messages", "messages") or "messages"
        mappings = dict(dataset.pop("message_property_mappings", None) or {})
        role = dataset.pop("message_field_role", None) or mappings.pop("role", "role")
        content = dataset.pop("message_field_content", None) or mappings.pop("content", "content")
        roles = dataset.pop("roles", None) or {}
        for option in ("roles_to_train", "train_on_eos", "chat_template", "drop_system_message"):
            value = dataset.pop(option, None)
            if value is not None and not (option == "roles_to_train" and value == ["assistant"]):
                conversion.skip(f"{key}.{option}", f"{value!r}: loss is on every assistant turn; the tokenizer's chat template is used")
        known = {"user", "assistant", "system", "human", "gpt"}
        names = {str(alias) for aliases in roles.values() for alias in (aliases if isinstance(aliases, list) else [aliases])}
        if names - known:
            conversion.skip(f"{key}.roles", f"{roles}: speaker names other than {', '.join(sorted(known))} are not read: rename them in the file")
            return None
        if (field, role, content) == ("messages", "role", "content"):
            return "chat"
        if (field, role, content) == ("conversations", "from", "value"):
            return "sharegpt"
        conversion.skip(
            f"{key}.field_messages",
            f"messages in {field!r} with keys {role!r}/{content!r}: ZeRO-Pipe reads messages/role/content (chat) or conversations/from/value "
            "(ShareGPT): rename the keys in the file",
        )
        return None
    conversion.skip(f"{key}.type", f"{kind!r}: ZeRO-Pipe reads alpaca, chat_template, sharegpt and completion data")
    return None
