"""The DeepSpeed JSON of a run: generated from typed fields, or the user's own with "auto" resolved.

DeepSpeed builds the optimizer and the scheduler from this JSON (never a client optimizer:
since DeepSpeed 0.17 a client optimizer with offload fails its validation), and
``train_batch_size`` is always micro-batch x accumulation x world size.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeropipe.config.optimizers import deepspeed_type_to_name, optimizer_kind
from zeropipe.config.schema import RunConfig
from zeropipe.errors import ConfigError


@dataclass
class ResolvedDeepSpeed:
    config: dict[str, Any]
    filled: list[str] = field(default_factory=list)  # "key: value (why)" for every "auto" resolved


def scheduler_block(config: RunConfig, total_steps: int) -> dict[str, Any]:
    train = config.train
    # DeepSpeed's schedulers reject warmup_num_steps == 0 and spend the first two steps of a
    # warm-up at its minimum; with no warm-up asked for, that minimum is the full rate.
    warmup = max(1, min(train.warmup_steps, max(total_steps - 1, 1)))
    start = 0.0 if train.warmup_steps else 1.0
    if train.schedule == "cosine":
        params = {
            "total_num_steps": max(total_steps, warmup + 1),
            "warmup_min_ratio": start,
            "warmup_num_steps": warmup,
            "cos_min_ratio": train.min_lr_ratio,
            "warmup_type": "linear",
        }
        if not train.warmup_steps:
            # WarmupCosineLR sets the rate to 0 before its first step whatever the minimum;
            # starting it at iteration 0 leaves the optimizer's full rate for step 1.
            params["last_batch_iteration"] = 0
        return {"type": "WarmupCosineLR", "params": params}
    if train.schedule == "linear":
        # WarmupDecayLR decays linearly to 0; DeepSpeed has no floor for it.
        return {
            "type": "WarmupDecayLR",
            "params": {
                "total_num_steps": max(total_steps, warmup + 1),
                "warmup_min_lr": start * train.lr,
                "warmup_max_lr": train.lr,
                "warmup_num_steps": warmup,
                "warmup_type": "linear",
            },
        }
    return {"type": "WarmupLR", "params": {"warmup_min_lr": start * train.lr, "warmup_max_lr": train.lr, "warmup_num_steps": warmup, "warmup_type": "linear"}}


def optimizer_block(config: RunConfig) -> dict[str, Any] | None:
    """The JSON's optimizer block, or None for a client optimizer the rank builds (engine.optimizers)."""
    train = config.train
    adam = {"lr": train.lr, "betas": [train.adam_beta1, train.adam_beta2], "eps": train.adam_eps, "weight_decay": train.weight_decay}
    if train.optimizer == "muon":
        # One rate for both halves (the matrices' Muon and the rest's AdamW): DeepSpeed's WarmupLR and
        # WarmupDecayLR set every group to one absolute rate, so per-half rates would not survive them.
        return {"type": "Muon", "params": {**adam, "momentum": train.muon_momentum}}
    if train.optimizer == "adafactor":
        # torch.optim.Adafactor (DeepSpeed builds it through getattr(torch.optim, type)); it has no betas.
        return {"type": "Adafactor", "params": {"lr": train.lr, "weight_decay": train.weight_decay}}
    if optimizer_kind(train.optimizer).deepspeed_type is None:
        return None
    return {"type": "AdamW", "params": adam}


def optimizer_settings(config: RunConfig) -> dict[str, Any]:
    """What the JSON needs beside the optimizer block for the chosen optimizer."""
    kind = optimizer_kind(config.train.optimizer)
    settings: dict[str, Any] = {}
    if kind.name != "adamw" and config.deepspeed.zero_stage:
        # DeepSpeed's ZeRO optimizers run only the optimizers it tested unless told otherwise;
        # check.rules refuses the stages where one of ours would not be the same algorithm.
        settings["zero_allow_untested_optimizer"] = True
    return settings


def zero_block(config: RunConfig, hidden_size: int | None) -> dict[str, Any]:
    ds = config.deepspeed
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage == 0:
        return zero
    zero.update({"overlap_comm": True, "contiguous_gradients": True})
    if hidden_size:
        zero["reduce_bucket_size"] = hidden_size * hidden_size
    if ds.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if ds.zero_stage == 3:
        if hidden_size:
            zero["stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
            zero["stage3_param_persistence_threshold"] = 10 * hidden_size
        # Needed so that save_16bit_model/export can gather full weights from the shards.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        if config.train.optimizer == "muon":
            # ZeRO-3's Muon orthogonalises whole gradients it gathers itself; DeepSpeed refuses it with reduce-scatter.
            zero["reduce_scatter"] = False
        if ds.offload_param == "cpu":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return zero


def precision_block(precision: str) -> dict[str, Any]:
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp16":
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}}
    return {}


def data_parallel_size(config: RunConfig, world_size: int) -> int:
    """Ranks that read different samples: the world over the sequence-parallel degree (groups of N share a sample).

    A world the degree does not divide is kept whole here; `check` refuses it (ZP020).
    """
    sp = config.parallel.sequence_parallel_size
    return world_size // sp if sp > 1 and world_size % sp == 0 else world_size


def build_deepspeed_config(
    config: RunConfig, world_size: int, total_steps: int, hidden_size: int | None = None, user_json: dict[str, Any] | None = None
) -> ResolvedDeepSpeed:
    """The DeepSpeed JSON for this run: the user's file with "auto" resolved, or one generated from the config.

    Args:
        user_json: deepspeed.config_file as the resolved run read it (``ResolvedRun.user_ds_config``), required
            with a config_file: the file is read once per command, by the resolve, never again here.

    Raises:
        TypeError: a config_file without its content (a caller that did not carry the resolved run's).
    """
    # DeepSpeed's train_batch_size counts data-parallel ranks: the world over the sequence-parallel degree.
    world_size = data_parallel_size(config, world_size)
    if config.deepspeed.config_file:
        if user_json is None:
            raise TypeError(f"build_deepspeed_config: deepspeed.config_file {config.deepspeed.config_file} given without its content: pass user_json=resolved.user_ds_config")
        resolved = resolve_user_config(config, Path(config.deepspeed.config_file), user_json, world_size, total_steps, hidden_size)
    else:
        train = config.train
        ds_config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": train.micro_batch_size,
            "gradient_accumulation_steps": train.gradient_accumulation_steps,
            "train_batch_size": train.micro_batch_size * train.gradient_accumulation_steps * world_size,
            "gradient_clipping": train.grad_clip,
            "scheduler": scheduler_block(config, total_steps),
            "zero_optimization": zero_block(config, hidden_size),
            # Our own metrics replace DeepSpeed's periodic prints.
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            **precision_block(config.deepspeed.precision),
        }
        optimizer = optimizer_block(config)
        if optimizer is not None:
            ds_config["optimizer"] = optimizer
        ds_config.update(optimizer_settings(config))
        resolved = ResolvedDeepSpeed(ds_config)
    if config.parallel.sequence_parallel_size > 1:
        resolved.config["sequence_parallel_size"] = config.parallel.sequence_parallel_size
    merge(resolved.config, copy.deepcopy(config.deepspeed.overrides))
    check_batch_size(resolved.config, world_size)
    return resolved


def merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value


def check_batch_size(ds_config: dict[str, Any], world_size: int) -> None:
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    accumulation = ds_config.get("gradient_accumulation_steps")
    total = ds_config.get("train_batch_size")
    if all(isinstance(v, int) for v in (micro, accumulation, total)) and micro * accumulation * world_size != total:
        raise ConfigError(
            [
                (
                    "deepspeed.train_batch_size",
                    f"{total} != micro-batch {micro} x accumulation {accumulation} x {world_size} ranks = {micro * accumulation * world_size}: "
                    'set it to "auto" or to that product',
                )
            ]
        )


def resolve_user_config(
    config: RunConfig, path: Path, user_json: dict[str, Any], world_size: int, total_steps: int, hidden_size: int | None
) -> ResolvedDeepSpeed:
    """Fill every "auto" of a DeepSpeed JSON written for HF Trainer / LLaMA-Factory / axolotl.

    Explicit values in the file win over this config's defaults; the config's train.* fields
    are what the "auto" values become. Every filled value is listed so the user can see it.
    ``user_json`` is the file's content (read once, by :func:`read_user_config`); ``path`` names it in messages.
    """
    user = copy.deepcopy(user_json)
    train = config.train
    precision = config.deepspeed.precision
    micro = user.get("train_micro_batch_size_per_gpu")
    accumulation = user.get("gradient_accumulation_steps")
    values: dict[str, tuple[Any, str]] = {
        "train_micro_batch_size_per_gpu": (train.micro_batch_size, "train.micro_batch_size"),
        "gradient_accumulation_steps": (train.gradient_accumulation_steps, "train.gradient_accumulation_steps"),
        "gradient_clipping": (train.grad_clip, "train.grad_clip"),
        "optimizer.params.lr": (train.lr, "train.lr"),
        "optimizer.params.betas": ([train.adam_beta1, train.adam_beta2], "train.adam_beta1/2"),
        "optimizer.params.eps": (train.adam_eps, "train.adam_eps"),
        "optimizer.params.weight_decay": (train.weight_decay, "train.weight_decay"),
        "scheduler.params.warmup_min_lr": (0.0, "warm-up starts at 0"),
        "scheduler.params.warmup_max_lr": (train.lr, "train.lr"),
        "scheduler.params.warmup_num_steps": (max(1, train.warmup_steps), "train.warmup_steps"),
        "scheduler.params.total_num_steps": (total_steps, "steps of this run"),
        # ZeRO-Pipe's export gathers the 16-bit weights from the ZeRO-3 shards (accelerate fills it so for save_16bit_model).
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": (True, "ZeRO-Pipe's export gathers 16-bit weights"),
        "bf16.enabled": (precision == "bf16", "deepspeed.precision"),
        "fp16.enabled": (precision == "fp16", "deepspeed.precision"),
    }
    if hidden_size:
        values["zero_optimization.reduce_bucket_size"] = (hidden_size * hidden_size, "hidden_size^2")
        values["zero_optimization.stage3_prefetch_bucket_size"] = (int(0.9 * hidden_size * hidden_size), "0.9 x hidden_size^2")
        values["zero_optimization.stage3_param_persistence_threshold"] = (10 * hidden_size, "10 x hidden_size")
    filled: list[str] = []
    unresolved: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key in list(node):
                dotted = f"{prefix}{key}"
                if node[key] == "auto":
                    if dotted == "train_batch_size":
                        continue  # needs the other two resolved first
                    if dotted in values:
                        node[key], why = values[dotted]
                        filled.append(f"{dotted} = {node[key]!r} (from {why})")
                    else:
                        unresolved.append(dotted)
                else:
                    walk(node[key], dotted + ".")

    walk(user, "")
    micro = user.get("train_micro_batch_size_per_gpu", micro)
    accumulation = user.get("gradient_accumulation_steps", accumulation)
    if user.get("train_batch_size") == "auto" or "train_batch_size" not in user:
        micro = micro if isinstance(micro, int) else train.micro_batch_size
        accumulation = accumulation if isinstance(accumulation, int) else train.gradient_accumulation_steps
        user.setdefault("train_micro_batch_size_per_gpu", micro)
        user.setdefault("gradient_accumulation_steps", accumulation)
        user["train_batch_size"] = micro * accumulation * world_size
        filled.append(f"train_batch_size = {user['train_batch_size']} (micro-batch {micro} x accumulation {accumulation} x {world_size} ranks)")
    if unresolved:
        raise ConfigError([("deepspeed.config_file", f'{path}: no rule fills "auto" for {", ".join(unresolved)}: write a value there')])
    # What the file leaves out is not DeepSpeed's default but the config's, written in: config.yaml and
    # ds_config.json then say the same (a missing betas would run DeepSpeed's 0.999 while the YAML says 0.95).
    optimizer = user.get("optimizer")
    if isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        params = optimizer.setdefault("params", {})
        for key, (value, why) in (("lr", (train.lr, "train.lr")), ("betas", ([train.adam_beta1, train.adam_beta2], "train.adam_beta1/2")),
                                  ("eps", (train.adam_eps, "train.adam_eps")), ("weight_decay", (train.weight_decay, "train.weight_decay"))):
            if key not in params:
                params[key] = value
                filled.append(f"optimizer.params.{key} = {value!r} (from {why}; the file had none)")
    scheduler = user.get("scheduler")
    ours = scheduler_block(config, total_steps)
    if isinstance(scheduler, dict) and scheduler.get("type") == ours["type"]:
        params = scheduler.setdefault("params", {})
        for key, value in ours["params"].items():
            if key not in params:
                params[key] = value
                filled.append(f"scheduler.params.{key} = {value!r} (from train.*; the file had none)")
    if "bf16" not in user and "fp16" not in user:
        user.update(precision_block(precision))
        filled.append(f"precision {precision} (from deepspeed.precision; the file has no bf16 or fp16 block)")
    if "zero_optimization" not in user:
        user["zero_optimization"] = zero_block(config, hidden_size)
        filled.append(f"zero_optimization.stage = {config.deepspeed.zero_stage} (from deepspeed.zero_stage; the file has no zero_optimization block)")
    # DeepSpeed must build the optimizer and scheduler; add ours when the file has none.
    if "optimizer" not in user:
        ours = optimizer_block(config)
        if ours is None:
            filled.append(f"no optimizer block: train.optimizer {config.train.optimizer} is built by each rank as a client optimizer")
        else:
            user["optimizer"] = ours
            filled.append(f"optimizer = {ours['type']} (from train.*; the file had none)")
    zero = user.get("zero_optimization")
    if config.train.optimizer == "muon" and isinstance(zero, dict) and zero.get("stage") == 3 and "reduce_scatter" not in zero:
        zero["reduce_scatter"] = False
        filled.append("zero_optimization.reduce_scatter = False (DeepSpeed's ZeRO-3 Muon refuses reduce-scatter)")
    for key, value in optimizer_settings(config).items():
        if key not in user:
            user[key] = value
            filled.append(f"{key} = {value!r} (train.optimizer {config.train.optimizer} under ZeRO)")
    if "scheduler" not in user:
        user["scheduler"] = scheduler_block(config, total_steps)
        filled.append(f"scheduler = {user['scheduler']['type']} (from train.schedule; the file had none)")
    user.setdefault("steps_per_print", 10**9)
    return ResolvedDeepSpeed(user, filled)


def read_user_config(path: Path) -> dict[str, Any]:
    """deepspeed.config_file as a dict: the one reader of a user's DeepSpeed JSON (``~`` expanded).

    A command reads it once, when it resolves the run (``ResolvedRun.user_ds_config``), and
    hands the content to everything that needs it.

    Raises:
        ConfigError: naming the line of a JSON syntax error, or a file that is not an object.
    """
    try:
        user = json.loads(Path(path).expanduser().read_text())
    except OSError as err:
        raise ConfigError([("deepspeed.config_file", f"{path} cannot be read ({err.strerror}): fix the path")]) from None
    except json.JSONDecodeError as err:
        raise ConfigError([("deepspeed.config_file", f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})")]) from None
    if not isinstance(user, dict):
        raise ConfigError([("deepspeed.config_file", f"{path} must hold a JSON object")])
    return user


def _explicit(node: dict[str, Any], *path: str) -> Any:
    """A value of the JSON that is set and not "auto", else None."""
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return None if node == "auto" else node


def fold_user_config(config: RunConfig, world_size: int, user_json: dict[str, Any] | None) -> tuple[RunConfig, list[str], list[tuple[str, str]]]:
    """The config with the explicit choices of its DeepSpeed JSON (and deepspeed.overrides) written into its typed fields.

    DeepSpeed runs what the JSON says, so the JSON's explicit batch shape, ZeRO stage,
    offload and precision become the run's: config.yaml, ds_config.json, the checks, the
    plan and the model's dtype then agree. A batch the JSON gives as train_batch_size with
    only one of micro-batch or accumulation has the other derived for this world size.

    Args:
        user_json: deepspeed.config_file's content (:func:`read_user_config`), None without one.

    Returns:
        (config, notes: what was taken from the JSON, conflicts: (key, message) where the
        YAML set a different value itself).

    Raises:
        ConfigError: a train_batch_size that does not divide over the ranks.
    """
    if not config.deepspeed.config_file and not config.deepspeed.overrides:
        return config, [], []
    user = copy.deepcopy(user_json) if user_json is not None else {}
    merge(user, copy.deepcopy(config.deepspeed.overrides))
    source = f"{config.deepspeed.config_file}" if config.deepspeed.config_file else "deepspeed.overrides"
    taken: dict[tuple[str, str], tuple[Any, str]] = {}  # (section, field) -> (value, JSON key)
    sp = _explicit(user, "sequence_parallel_size")
    if isinstance(sp, int) and not isinstance(sp, bool) and sp >= 1:
        taken[("parallel", "sequence_parallel_size")] = (sp, "sequence_parallel_size")
    else:
        sp = config.parallel.sequence_parallel_size
    if world_size % sp == 0:
        world_size //= sp  # the batch counts data-parallel ranks: groups of sp share a sample

    micro = _explicit(user, "train_micro_batch_size_per_gpu")
    accumulation = _explicit(user, "gradient_accumulation_steps")
    total = _explicit(user, "train_batch_size")
    if isinstance(total, int) and (micro is None) != (accumulation is None):
        known, known_key = (accumulation, "gradient_accumulation_steps") if micro is None else (micro, "train_micro_batch_size_per_gpu")
        if total % (known * world_size):
            raise ConfigError(
                [(
                    "deepspeed.train_batch_size",
                    f"{source}: train_batch_size {total} does not divide into {known_key} {known} x {world_size} ranks: "
                    "set train_micro_batch_size_per_gpu and gradient_accumulation_steps (or \"auto\") for this number of ranks",
                )]
            )
        derived = total // (known * world_size)
        if micro is None:
            micro = derived
            taken[("train", "micro_batch_size")] = (micro, f"train_batch_size {total} / (gradient_accumulation_steps {known} x {world_size} ranks)")
        else:
            accumulation = derived
            taken[("train", "gradient_accumulation_steps")] = (accumulation, f"train_batch_size {total} / (micro-batch {known} x {world_size} ranks)")
    if isinstance(total, int) and micro is None and accumulation is None:
        # train_batch_size alone (DeepSpeedExamples' cifar and Megatron configs): DeepSpeed takes accumulation 1 and the micro-batch
        # train_batch_size / ranks (runtime/config.py, _set_batch_related_parameters); the run feeds and records the same.
        if total % world_size:
            raise ConfigError([("deepspeed.train_batch_size", f"{source}: train_batch_size {total} does not divide over {world_size} ranks: "
                                "set train_micro_batch_size_per_gpu and gradient_accumulation_steps (or \"auto\") for this number of ranks")])
        micro, accumulation = total // world_size, 1
        taken[("train", "micro_batch_size")] = (micro, f"train_batch_size {total} / {world_size} ranks (DeepSpeed's accumulation 1 when only the total is given)")
        taken[("train", "gradient_accumulation_steps")] = (1, f"train_batch_size {total} alone: DeepSpeed accumulates 1 micro-batch")
    if isinstance(micro, int) and ("train", "micro_batch_size") not in taken:
        taken[("train", "micro_batch_size")] = (micro, "train_micro_batch_size_per_gpu")
    if isinstance(accumulation, int) and ("train", "gradient_accumulation_steps") not in taken:
        taken[("train", "gradient_accumulation_steps")] = (accumulation, "gradient_accumulation_steps")
    stage = _explicit(user, "zero_optimization", "stage")
    if isinstance(stage, int):
        taken[("deepspeed", "zero_stage")] = (stage, "zero_optimization.stage")
    for block, field_name in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        device = _explicit(user, "zero_optimization", block, "device")
        # NVMe is not folded as "cpu": `check` refuses it (ZP020), rather than planning host RAM it would not use.
        if device in ("cpu", "none"):
            taken[("deepspeed", field_name)] = (device, f"zero_optimization.{block}.device")
    fp16, bf16 = _explicit(user, "fp16", "enabled"), _explicit(user, "bf16", "enabled")
    left_auto = "auto" in (_enabled(user, "fp16"), _enabled(user, "bf16"))
    if fp16 is True:
        taken[("deepspeed", "precision")] = ("fp16", "fp16.enabled")
    elif bf16 is True:
        taken[("deepspeed", "precision")] = ("bf16", "bf16.enabled")
    elif (fp16 is False or bf16 is False) and not left_auto:
        # Only a JSON that turns both off (or the one it names) asks for fp32: LLaMA-Factory's
        # `"bf16": {"enabled": "auto"}, "fp16": {"enabled": false}` leaves the choice to this config.
        taken[("deepspeed", "precision")] = ("fp32", "bf16.enabled/fp16.enabled false")
    clip = _explicit(user, "gradient_clipping")
    if isinstance(clip, (int, float)):
        taken[("train", "grad_clip")] = (float(clip), "gradient_clipping")
    extra_notes = _fold_optimizer_and_scheduler(user, taken)

    folded = config.model_copy(deep=True)
    notes, conflicts = [], []
    for (section, name), (value, json_key) in sorted(taken.items()):
        part = getattr(folded, section)
        before = getattr(part, name)
        if before == value:
            continue
        if name in part.model_fields_set and before != "auto":
            conflicts.append(
                (f"{section}.{name}", f"the YAML says {before!r} but {source} sets {json_key} = {value!r}, which DeepSpeed would run: the JSON's value is used; remove one of the two")
            )
        setattr(part, name, value)
        notes.append(f"{section}.{name} = {value!r} (from {source}: {json_key})")
    notes += [f"{source}: {note}" for note in extra_notes]
    return folded, notes, conflicts


def _enabled(user: dict[str, Any], block: str) -> Any:
    node = user.get(block)
    return node.get("enabled") if isinstance(node, dict) else None


# DeepSpeed's schedulers as ZeRO-Pipe's train.schedule: (schedule, what min_lr_ratio is when the JSON gives none).
# DeepSpeed's schedulers as ZeRO-Pipe's train.schedule, and the min_lr_ratio a schedule decays to whatever the config says (None: the config's).
SCHEDULERS = {"WarmupLR": ("constant", None), "WarmupDecayLR": ("linear", 0.0), "WarmupCosineLR": ("cosine", None)}
ADAM_TYPES = ("adam", "adamw")


def _fold_optimizer_and_scheduler(user: dict[str, Any], taken: dict[tuple[str, str], tuple[Any, str]]) -> list[str]:
    """The JSON's explicit optimizer and scheduler as train.*: DeepSpeed runs them, so config.yaml must say them.

    An "auto" value, or a key the block leaves out, is filled from the config later
    (:func:`resolve_user_config`), so it is the config's already; an explicit one replaces it
    here. What train.* cannot express (a warm-up that does not start at 0, a log warm-up, a
    fixed schedule length) is returned as notes.

    Raises:
        ConfigError: an optimizer or scheduler type train.* cannot describe (Lamb, OneBitAdam, OneCycle...).
    """
    notes: list[str] = []
    optimizer = user.get("optimizer")
    if isinstance(optimizer, dict):
        kind = optimizer.get("type")
        name = deepspeed_type_to_name(kind) if isinstance(kind, str) else None
        if isinstance(kind, str) and name is None:
            raise ConfigError(
                [("deepspeed.config_file", f"optimizer.type = {kind!r}: ZeRO-Pipe runs and records AdamW, Muon or Adafactor from a DeepSpeed JSON "
                  f"(train.optimizer, train.lr, adam_beta1/2, adam_eps, weight_decay); "
                  f"set \"type\": \"AdamW\" or remove the optimizer block (ZeRO-Pipe then writes its own from train.*)")]
            )
        if name is not None:
            taken[("train", "optimizer")] = (name, "optimizer.type")
        params = optimizer.get("params") if isinstance(optimizer.get("params"), dict) else {}
        momentum = _explicit(params, "momentum")
        if name == "muon" and isinstance(momentum, (int, float)) and not isinstance(momentum, bool):
            taken[("train", "muon_momentum")] = (float(momentum), "optimizer.params.momentum")
        for json_key, name in (("lr", "lr"), ("eps", "adam_eps"), ("weight_decay", "weight_decay")):
            value = _explicit(params, json_key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                taken[("train", name)] = (float(value), f"optimizer.params.{json_key}")
        betas = _explicit(params, "betas")
        if isinstance(betas, list) and len(betas) == 2:
            taken[("train", "adam_beta1")] = (float(betas[0]), "optimizer.params.betas[0]")
            taken[("train", "adam_beta2")] = (float(betas[1]), "optimizer.params.betas[1]")
        if kind == "Adam" and params.get("adam_w_mode") is False:
            notes.append("optimizer Adam with adam_w_mode false: L2-regularised Adam, not AdamW; train.weight_decay is its L2 term")
    scheduler = user.get("scheduler")
    if isinstance(scheduler, dict):
        kind = scheduler.get("type")
        if kind not in SCHEDULERS:
            raise ConfigError(
                [("deepspeed.config_file", f"scheduler.type = {kind!r}: ZeRO-Pipe records its schedule as train.schedule (WarmupLR: constant, "
                  "WarmupDecayLR: linear, WarmupCosineLR: cosine); use one of those, or remove the scheduler block (ZeRO-Pipe then writes its own)")]
            )
        schedule, floor = SCHEDULERS[kind]
        taken[("train", "schedule")] = (schedule, f"scheduler.type {kind}")
        params = scheduler.get("params") if isinstance(scheduler.get("params"), dict) else {}
        warmup = _explicit(params, "warmup_num_steps")
        if isinstance(warmup, int) and not isinstance(warmup, bool):
            taken[("train", "warmup_steps")] = (warmup, "scheduler.params.warmup_num_steps")
        peak = _explicit(params, "warmup_max_lr")
        if isinstance(peak, (int, float)) and not isinstance(peak, bool) and kind != "WarmupCosineLR":
            # WarmupLR and WarmupDecayLR set the rate themselves; WarmupCosineLR scales the optimizer's lr.
            taken[("train", "lr")] = (float(peak), "scheduler.params.warmup_max_lr")
        ratio = _explicit(params, "cos_min_ratio")
        if kind == "WarmupCosineLR" and isinstance(ratio, (int, float)):
            taken[("train", "min_lr_ratio")] = (float(ratio), "scheduler.params.cos_min_ratio")
        elif floor is not None:
            taken[("train", "min_lr_ratio")] = (floor, f"{kind} decays to {floor} x lr")
        start = _explicit(params, "warmup_min_lr" if kind != "WarmupCosineLR" else "warmup_min_ratio")
        if isinstance(start, (int, float)) and start:
            notes.append(f"scheduler.params warm-up starts at {start}, not at 0 as train.warmup_steps describes")
        if params.get("warmup_type") == "log":
            notes.append(f"scheduler {kind} warms up logarithmically (warmup_type 'log'), not linearly as train.warmup_steps describes")
        total = _explicit(params, "total_num_steps")
        if isinstance(total, int):
            notes.append(f"scheduler.params.total_num_steps = {total}: the schedule ends there, whatever the run's length")
    return notes


def effective_batch_shape(ds_config: dict[str, Any]) -> tuple[int, int]:
    """(micro-batch, accumulation) as DeepSpeed will use them."""
    return int(ds_config["train_micro_batch_size_per_gpu"]), int(ds_config["gradient_accumulation_steps"])


def zero_stage_of(ds_config: dict[str, Any]) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))
