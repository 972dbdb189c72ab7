"""Read a run config from YAML plus ``key=value`` overrides and validate all of it at once."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from zeropipe.config import stages as stages_module
from zeropipe.config.pipeline_index import is_pipeline_folder
from zeropipe.config.schema import TEXT_TASKS, RunConfig
from zeropipe.errors import ConfigError


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load, override and validate a run config.

    Raises:
        ConfigError: listing every problem found, each with its dotted key and the fix.
    """
    raw: dict[str, Any] = {}
    source = str(path) if path else "command line"
    if path is not None:
        raw = read_yaml(Path(path))
    problems: list[tuple[str, str]] = []
    for item in overrides:
        try:
            apply_override(raw, item)
        except ConfigError as err:
            problems += err.problems
    # The run is named after its YAML file unless run.name says otherwise.
    if path is not None and isinstance(raw.setdefault("run", {}), dict):
        raw["run"].setdefault("name", Path(path).stem)
    return validate_config(raw, source=source, extra_problems=problems)


def load_saved_config(path: str | Path, learned: dict[str, Any] | None = None) -> RunConfig:
    """A config a prepared run saved (its config.yaml): typed, without re-running the checks it passed then.

    Its data may have moved since, and it holds what the launcher resolved (family, precision,
    the auto knobs); only the types are checked again.

    Args:
        learned: what the run's data preparation learned (learned.json: dotted key -> value,
            e.g. ``model.config.vocab_size`` from the tokenizer), set on top: together they are
            the config the run ran with.

    Raises:
        ConfigError: when the file was edited into something the schema refuses.
    """
    raw = read_yaml(Path(path))
    for key, value in (learned or {}).items():
        set_dotted(raw, key, value)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(dedupe([describe_error(error) for error in err.errors()]), source=str(path)) from None


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError([("", f"config file {path} does not exist: check the path")], source=str(path))
    return parse_yaml(path.read_text(), str(path))


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    """A run config's sections from YAML text (a file's, or one submitted to the UI).

    Raises:
        ConfigError: not YAML (with the line and column), or not a mapping of sections.
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError([("", f"not valid YAML{where}: {problem}; fix the syntax (indentation, a missing ':' or quote)")], source=source) from None
    except ValueError as err:
        # Python refuses to read an integer of more than 4300 digits (a denial-of-service guard);
        # no config value is that long.
        reason = "a number has more digits than Python reads (4300)" if "digits" in str(err) else str(err)[:200]
        raise ConfigError([("", f"the YAML cannot be read: {reason}; no setting needs a number that long, shorten it")], source=source) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError([("", f"the top level must be a mapping of sections (model:, data:, train:, ...), not {type(raw).__name__}")], source=source)
    return raw


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``dotted.key=value`` override; the value is parsed as YAML (so 2e-5 is a number)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError([(item, "an override must look like section.key=value, e.g. train.lr=2e-5")])
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except (yaml.YAMLError, ValueError):  # ValueError: an integer longer than Python reads
        value = text
    # YAML 1.1 reads on/off/yes/no as booleans: on the command line only true/false mean one
    # (run.name=on names the run "on").
    if isinstance(value, bool) and text.strip().lower() not in ("true", "false"):
        value = text.strip()
    # YAML reads 2e-5 as a string (no dot): numbers written that way are meant as floats.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in "eE.") else value
        except ValueError:
            pass
    node: Any = raw
    # `stages[1].train.lr` (the form problems are reported in) and `stages.1.train.lr` both index a list.
    parts = key.strip().replace("[", ".").replace("]", "").split(".")
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                where = ".".join(parts[:depth])
                raise ConfigError([(key, f"{where} has items 0 to {len(node) - 1}: {part} is not one of them")])
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
            continue
        if last:
            node[part] = value
        else:
            if not isinstance(node.get(part), (dict, list)):
                node[part] = {}
            node = node[part]


def validate_config(raw: dict[str, Any], source: str | None = None, extra_problems: list[tuple[str, str]] | None = None) -> RunConfig:
    problems = list(extra_problems or [])
    config = None
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as err:
        problems += describe_errors(err.errors())
    if raw.get("stages") is not None:
        # Every stage is validated as the config it will run with; problems are prefixed stages[N].
        problems = curriculum_problems(raw, problems)
    else:
        problems += semantic_problems(raw)
    if problems:
        raise ConfigError(dedupe(problems), source=source)
    assert config is not None
    return config


def dedupe(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    seen: set[tuple[str, str]] = set()
    return [p for p in problems if not (p in seen or seen.add(p))]


# Names users bring from HF Trainer, axolotl and LLaMA-Factory configs.
ALIASES = {
    "learning_rate": "lr",
    "per_device_train_batch_size": "micro_batch_size",
    "micro_batch": "micro_batch_size",
    "batch_size": "micro_batch_size",
    "num_train_epochs": "epochs",
    "num_epochs": "epochs",
    "max_grad_norm": "grad_clip",
    "gradient_clipping": "grad_clip",
    "stage": "zero_stage",
    "zero": "zero_stage",
    "lr_scheduler_type": "schedule",
    "warmup": "warmup_steps",
    "save_steps": "save_every",
    "logging_steps": "log_every",
    "save_total_limit": "keep_last",
    "model_name_or_path": "path",
    "base_model": "path",
    "dataset": "path",
    "sequence_len": "max_seq_len",
    "cutoff_len": "max_seq_len",
    "lora_r": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "num_gpus": "gpus",
}


# What pydantic's type errors expect, in the user's words.
EXPECTED = {
    "int_parsing": "a whole number",
    "int_type": "a whole number",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "text",
    "list_type": "a list",
    "dict_type": "a mapping (key: value lines)",
    "model_type": "a mapping (key: value lines)",
    "model_attributes_type": "a mapping (key: value lines)",
}
# pydantic names the member of a union that failed in the location ("constrained-int",
# "literal['auto']", "function-after[...]"): internal names, never a key the user wrote.
UNION_MEMBER = re.compile(r"^(constrained-\w+|[\w-]+\[.*\]|int|str|float|bool|none)$")


def describe_errors(errors: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """One (dotted key, message) per key: a value that fits no member of a union is one problem, not one per member."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for error in errors:
        by_key.setdefault(dotted_key(user_loc(error)), []).append(error)
    problems = []
    for key, group in by_key.items():
        expected = [expectation(error) or bound(error) for error in group]
        if len(group) > 1 and all(expected):
            alternatives = list(dict.fromkeys(e for e in expected if e))
            shown = ", ".join(alternatives[:-1]) + f" or {alternatives[-1]}" if len(alternatives) > 1 else alternatives[0]
            problems.append((key, f"must be {shown} (you gave {shown_input(group[0].get('input'))})"))
        else:
            problems += [describe_error(error) for error in group]
    return problems


def shown_input(value: Any, limit: int = 80) -> str:
    """The value a message quotes, cut short: a 5000-digit number or a pasted file is not repeated whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"


def user_loc(error: dict[str, Any]) -> list[str]:
    return [str(part) for part in error["loc"] if not UNION_MEMBER.match(str(part))]


def bound(error: dict[str, Any]) -> str | None:
    """A limit a value breaks ('greater than 0'), in pydantic's words without its 'Input should be'."""
    if error["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return error["msg"].removeprefix("Input should be ")
    return None


def expectation(error: dict[str, Any]) -> str | None:
    """What a type error asks for ('a whole number', "'auto'"), or None for other errors."""
    if error["type"] == "literal_error":
        return str(error.get("ctx", {}).get("expected") or error["msg"].replace("Input should be ", ""))
    return EXPECTED.get(error["type"])


def describe_error(error: dict[str, Any]) -> tuple[str, str]:
    """Turn one pydantic error into (dotted key, message with the fix)."""
    loc = user_loc(error)
    key = dotted_key(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        known = known_keys(loc[:-1])
        close = [ALIASES[loc[-1]]] if ALIASES.get(loc[-1]) in known else difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys here: {', '.join(sorted(known))}"
        return key, f"unknown key; {hint}"
    if kind == "literal_error":
        return key, f"{error['msg'].replace('Input should be', 'must be')} (you gave {shown_input(error.get('input'))})"
    if kind in EXPECTED:
        return key, f"must be {EXPECTED[kind]} (you gave {shown_input(error.get('input'))})"
    message = error["msg"].replace("Input should be", "must be")
    if "input" in error and kind not in {"missing"}:
        message += f" (you gave {shown_input(error['input'])})"
    return key, message


def dotted_key(loc: list[str]) -> str:
    """``["stages", "1", "train"]`` -> ``stages[1].train``: list items by their index, as in YAML paths."""
    key = ""
    for part in loc:
        key += f"[{part}]" if part.isdigit() else (f".{part}" if key else part)
    return key


def known_keys(loc: list[str]) -> list[str]:
    model: type[BaseModel] = RunConfig
    for part in loc:
        if part.isdigit():
            continue  # an item of a list of sections (stages, data.mixture)
        field = model.model_fields.get(part)
        if field is None:
            return []
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        candidates += [item for candidate in candidates for item in getattr(candidate, "__args__", ())]  # list[Section] | None
        sub = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if sub is None:
            return []
        model = sub
    return list(model.model_fields)


def section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name)
    return value if isinstance(value, dict) else {}


def offload_problems(stage: Any, offload_param: Any, offload_optimizer: Any) -> list[tuple[str, str]]:
    """Offload that DeepSpeed refuses at this ZeRO stage; checked on the YAML here and on the resolved run by rule ZP002."""
    problems = []
    if offload_param == "cpu" and stage not in (3, "auto"):
        problems.append(("deepspeed.offload_param", f"needs zero_stage 3 (you set {stage}): set deepspeed.zero_stage: 3 or offload_param: none"))
    if offload_optimizer == "cpu" and stage == 0:
        problems.append(("deepspeed.offload_optimizer", "needs zero_stage 1, 2 or 3 (you set 0): raise deepspeed.zero_stage or set offload_optimizer: none"))
    return problems


def semantic_problems(raw: dict[str, Any]) -> list[tuple[str, str]]:
    """Checks across fields, run on the raw dict so they are reported with the type errors."""
    problems: list[tuple[str, str]] = []
    model, data, ds = (section(raw, n) for n in ("model", "data", "deepspeed"))

    if model.get("path") and model.get("config"):
        problems.append(("model", "set model.path or model.config, not both"))
    elif not model.get("path") and not model.get("config"):
        problems.append(("model", "no model: set model.path to a local Hugging Face directory, or model.config to an inline config"))
    if isinstance(model.get("path"), str):
        path = Path(model["path"]).expanduser()
        if not (path / "config.json").is_file() and not is_pipeline_folder(path):
            problems.append(
                ("model.path", f"{path} is neither a Hugging Face model directory (config.json) nor a diffusers pipeline (model_index.json): fix the path")
            )
    if isinstance(model.get("config"), dict) and "model_type" not in model["config"] and "pipeline" not in model["config"]:
        problems.append(("model.config.model_type", "missing: name the architecture, e.g. model_type: llama (or pipeline: tiny-sdxl for a diffusion model)"))
    if isinstance(model.get("tokenizer"), str) and not Path(model["tokenizer"]).expanduser().is_dir():
        problems.append(("model.tokenizer", f"{model['tokenizer']} is not a directory: fix the path or remove the key"))

    given = {"path": bool(data.get("path")), "synthetic": data.get("synthetic") is not None, "mixture": data.get("mixture") is not None}
    sources = [f"data.{key}" for key, present in given.items() if present]
    if len(sources) > 1:
        problems.append(("data", f"set one of data.path, data.synthetic or data.mixture, not {' and '.join(sources)}"))
    elif not sources:
        problems.append(("data", "no training data: set data.path to a .jsonl/.json/.txt file, data.synthetic: {task: mixed}, or data.mixture"))
    if isinstance(data.get("mixture"), list):
        problems += mixture_problems(data)
    if isinstance(data.get("path"), str) and not Path(data["path"]).expanduser().exists():
        problems.append(("data.path", f"{data['path']} does not exist: fix the path"))
    if data.get("packing") is True and data.get("group_by_length") is True:
        problems.append(("data.group_by_length", "packing already removes the padding that length grouping reduces: set data.packing or data.group_by_length, not both"))
    if data.get("eval_path") and data.get("eval_fraction"):
        problems.append(("data.eval_fraction", "set data.eval_path (a held-out file) or data.eval_fraction (a share of data.path), not both"))
    if isinstance(data.get("eval_path"), str) and not Path(data["eval_path"]).expanduser().exists():
        problems.append(("data.eval_path", f"{data['eval_path']} does not exist: fix the path"))
    if section(raw, "train").get("eval_every") and not (data.get("eval_path") or data.get("eval_fraction")):
        problems.append(("train.eval_every", "there is no held-out data to evaluate on: set data.eval_path or data.eval_fraction (e.g. 0.05)"))

    images, caches = section(data, "images"), section(data, "cache")
    if images.get("crop") == "random" and caches.get("latents", True) is not False:
        problems.append(("data.images.crop", "random crops cannot come from cached latents (each image is encoded once): set crop: center, or data.cache.latents: false"))

    stage = ds.get("zero_stage", 2)
    problems += offload_problems(stage, ds.get("offload_param", "none"), ds.get("offload_optimizer", "none"))
    if isinstance(ds.get("config_file"), str) and not Path(ds["config_file"]).expanduser().is_file():
        problems.append(("deepspeed.config_file", f"{ds['config_file']} does not exist: fix the path"))

    return problems


def curriculum_problems(raw: dict[str, Any], problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Every problem of a curriculum config: the schema's (``problems``), the top level's and each stage's.

    The top level must be valid as such (its sections are every stage's defaults), but its
    data or model may be left for the stages to give: a top-level semantic problem counts
    only if a stage still has it.
    """
    reported = list(problems)
    stages = raw.get("stages")
    if not isinstance(stages, list):
        return reported  # the schema says what is wrong with it
    if not stages:
        return reported + [("stages", "is an empty list: add at least one stage ({name: ..., train: {...}}), or remove stages:")]
    top = {key: value for key, value in raw.items() if key != "stages"}
    per_stage: list[list[tuple[str, str]]] = []
    seen_names: dict[str, int] = {}
    for index, stage in enumerate(stages):
        found: list[tuple[str, str]] = []
        if not isinstance(stage, dict):
            per_stage.append(found)
            continue
        name = stage.get("name")
        if isinstance(name, str):
            if name in seen_names:
                found.append(("name", f"'{name}' is also the name of stages[{seen_names[name]}]: give each stage its own name"))
            seen_names.setdefault(name, index)
        model = stage.get("model") if isinstance(stage.get("model"), dict) else {}
        for key in stages_module.TOP_LEVEL_MODEL_KEYS:
            if key in model:
                found.append(
                    (
                        f"model.{key}",
                        "the model is set once, at the top level: each stage starts from the weights the stage before it ended with. "
                        f"Move model.{key} to the top-level model: section",
                    )
                )
        merged = stages_module.merge_stage(top, stage)
        try:
            RunConfig.model_validate(merged)
        except ValidationError as err:
            found += [describe_error(error) for error in err.errors()]
        found += semantic_problems(merged)
        per_stage.append(found)
    # A top-level problem that every stage has is the top level's: said once, without a prefix.
    shared = [problem for problem in semantic_problems(top) if all(problem in found for found in per_stage)]
    reported += shared
    for index, found in enumerate(per_stage):
        reported += [(stages_module.stage_key(index, key), message) for key, message in found if (key, message) not in reported]
    return dedupe(reported)


def mixture_problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Problems of a raw data section's mixture (types are pydantic's job), each with the fix."""
    mixture = data.get("mixture")
    problems: list[tuple[str, str]] = []
    if not mixture:
        return [("data.mixture", "is empty: list at least one source, e.g. [{path: a.jsonl, weight: 0.7}, {synthetic: {task: mixed}, weight: 0.3}]")]
    if data.get("format", "auto") != "auto":
        problems.append(("data.format", "applies to data.path; with data.mixture give each source its own format (data.mixture[N].format)"))
    for index, source in enumerate(mixture):
        if not isinstance(source, dict):
            continue  # reported by the schema
        key = f"data.mixture[{index}]"
        has_path, has_synthetic = bool(source.get("path")), source.get("synthetic") is not None
        if has_path == has_synthetic:
            problems.append((key, "set path (a data file) or synthetic (a generated task), exactly one of them"))
        if isinstance(source.get("path"), str) and not Path(source["path"]).expanduser().exists():
            problems.append((f"{key}.path", f"{source['path']} does not exist: fix the path"))
        synthetic = source.get("synthetic")
        if isinstance(synthetic, dict) and synthetic.get("task", "mixed") not in TEXT_TASKS:
            problems.append((f"{key}.synthetic.task", f"a mixture holds text; use one of {', '.join(TEXT_TASKS)}"))
    return problems


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set ``a.b.c`` in nested dicts, making the dicts on the way."""
    *path, last = key.split(".")
    node = raw
    for part in path:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def config_changes(before: RunConfig, after: RunConfig) -> dict[str, Any]:
    """The fields ``after`` sets differently from ``before``, as dotted key -> new value (leaves of nested sections and dicts)."""
    changes: dict[str, Any] = {}

    def walk(old: Any, new: Any, key: str) -> None:
        if isinstance(old, dict) and isinstance(new, dict):
            for name in new:
                walk(old.get(name), new[name], f"{key}.{name}" if key else name)
        elif old != new:
            changes[key] = new

    walk(before.model_dump(mode="json"), after.model_dump(mode="json"), "")
    return changes


def dump_config(config: RunConfig) -> str:
    """The fully resolved config as YAML, with every default written out."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
