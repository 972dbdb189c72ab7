"""What every converter shares: the result it builds, path lookup, and the YAML it writes.

A converter reads another tool's config and fills a :class:`Conversion`: each ZeRO-Pipe key it
sets comes with the source key(s) it came from and why, and each source key it cannot carry
over is listed with the reason. Nothing is dropped silently: a key is either mapped or listed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from zeropipe.data.records import Record, iter_records
from zeropipe.errors import DataError, ZeroPipeError

# What a preference recipe's held-out share (axolotl's val_set_size, LLaMA-Factory's val_size) becomes: the
# preference task trains on every pair of data.path (check refuses data.eval_fraction there).
HELD_OUT_PAIRS = (
    "preference tuning trains on every pair of data.path and holds none out: put the held-out pairs in a file of their own "
    "and measure them with `zeropipe eval RUN --data FILE` (preference accuracy and margin)"
)
SECTION_ORDER = ("convert", "run", "model", "data", "train", "preference", "deepspeed", "hardware", "generate", "logging")


@dataclass(frozen=True)
class PeerDefault:
    """A default of the other tool that differs from ZeRO-Pipe's: what a file that leaves ``key`` out trains with there.

    Each converter lists these (``PEER_DEFAULTS``) with where the peer's source sets them; the converter writes ``target``
    when the file leaves ``key`` out (the contract test, tests/unit/convert/test_convert_issue45.py, holds every converter
    to it on every peer config). ``applies``: when the default matters at all ("lora": a LoRA run, "flow": a flow-matching
    model, "video": a video model, "vlm": a vision-language model, "unless KEY": the file does not set KEY, "" always).
    """

    key: str
    value: Any
    target: str
    source: str  # the peer's file and line (at the commit SOURCES.md names)
    applies: str = ""
    owner: str = ""
    written: Any = None  # the ZeRO-Pipe value it becomes, where not ``value`` itself (disable_gradient_checkpointing: false -> true)  # whose default it is, where not the tool's own (LLaMA-Factory trains with Hugging Face's TrainingArguments)

    def comment(self, tool: str) -> str:
        return f"{self.owner or tool}'s default {self.key} is {self.value!r} ({self.source})"


class ConversionError(ZeroPipeError):
    """A file that cannot be converted (unreadable, or asking for training ZeRO-Pipe does not do)."""


@dataclass
class Entry:
    value: Any
    comment: str


@dataclass
class Conversion:
    """A converted config: ZeRO-Pipe keys with the reason for each, and what could not be mapped."""

    tool: str  # "diffusion-pipe", "axolotl", "llama-factory"
    source: Path
    entries: dict[str, Entry] = field(default_factory=dict)  # dotted ZeRO-Pipe key -> value and why
    unmapped: list[tuple[str, str]] = field(default_factory=list)  # (source key, why not mapped)
    # Folder name -> target folder: a kohya-layout folder of links the caller creates (diffusion-pipe
    # [[directory]] entries with repeats); see :func:`write_links`.
    links: dict[str, Path] = field(default_factory=dict)
    links_dir: Path | None = None
    # Why the converted config cannot train yet (an architecture ZeRO-Pipe does not have): `zeropipe
    # train` refuses with these; `zeropipe convert` still writes the file, for when support lands.
    blocking: list[str] = field(default_factory=list)
    # Source keys whose value is already what ZeRO-Pipe does (train_on_inputs: false): no key to write.
    already: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any, comment: str) -> None:
        self.entries[key] = Entry(value, comment)

    def default(self, peer: "PeerDefault", value: Any | None = None) -> None:
        """Write the peer's default (a file that leaves ``peer.key`` out), with where the peer sets it."""
        self.set(peer.target, value if value is not None else peer.written if peer.written is not None else peer.value, peer.comment(self.tool))

    def skip(self, key: str, why: str) -> None:
        self.unmapped.append((key, why))

    def verdict(self) -> dict[str, Entry]:
        """The blocking reasons as the convert: section, so that `zeropipe check` and `train` refuse what convert refused (ZP030)."""
        if not self.blocking:
            return {}
        return {
            "convert.tool": Entry(self.tool, "the tool the source config was written for"),
            "convert.source": Entry(str(self.source), "the config this file was converted from"),
            "convert.cannot_train": Entry(list(self.blocking), "check and train refuse this config until every line is fixed and removed (ZP030)"),
        }

    def ordered(self) -> list[tuple[str, Entry]]:
        """Entries in the order of the schema's sections (run, model, data, train, ...), as the examples read."""
        rank = {name: index for index, name in enumerate(SECTION_ORDER)}
        return sorted({**self.entries, **self.verdict()}.items(), key=lambda item: rank.get(item[0].split(".")[0], len(rank)))

    def raw(self) -> dict[str, Any]:
        """The converted config as the nested dict the schema validates."""
        tree: dict[str, Any] = {}
        for dotted, entry in self.ordered():
            node = tree
            *parents, last = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = entry.value
        return tree

    def to_yaml(self, command_path: str | None = None) -> str:
        """ZeRO-Pipe YAML with a comment on every key and the unmapped keys listed at the top."""
        lines = [f"# Converted by `zeropipe convert` from the {self.tool} config {self.source}."]
        if self.blocking:
            lines.append("# It cannot train yet: `zeropipe check` and `zeropipe train` refuse it while convert.cannot_train below is not empty.")
        else:
            lines.append(f"# Run it:  zeropipe train {command_path or 'THIS_FILE.yaml'}")
        for reason in self.blocking:
            lines.append(f"# CANNOT TRAIN YET: {reason}")
        if self.links:
            lines.append(f"# data.path is a folder of links in the kohya layout (<repeats>_<name>) made by the conversion: {self.links_dir}")
        if self.already:
            lines.append(f"# Already ZeRO-Pipe's behaviour, nothing to set: {', '.join(self.already)}")
        if self.unmapped:
            lines.append("#")
            lines.append(f"# Not mapped ({len(self.unmapped)}):")
            for key, why in self.unmapped:
                lines.append(f"#   - {key}: {why}")
        lines.append("")
        tree: dict[str, Any] = {}
        for dotted, entry in self.ordered():
            node = tree
            *parents, last = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = entry
        _emit(tree, 0, lines)
        return "\n".join(lines) + "\n"


def _emit(node: dict[str, Any], depth: int, lines: list[str]) -> None:
    indent = "  " * depth
    for key, value in node.items():
        if isinstance(value, Entry):
            lines.append(f"{indent}{key}: {_flow(value.value)}  # {value.comment}")
        else:
            lines.append(f"{indent}{key}:")
            _emit(value, depth + 1, lines)


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, allow_unicode=True).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


def find_path(name: str, *bases: Path) -> Path | None:
    """``name`` as an existing path: absolute, or relative to one of ``bases`` (first match), else None."""
    path = Path(name).expanduser()
    if path.is_absolute():
        return path if path.exists() else None
    for base in bases:
        candidate = (base / path).resolve()
        if candidate.exists():
            return candidate
    return None


def local_model(conversion: Conversion, key: str, name: str, bases: tuple[Path, ...]) -> None:
    """Map a model named by path or Hub id onto model.path; a Hub id is listed with how to fetch it."""
    found = find_path(name, *bases)
    if found is not None and found.is_dir():
        conversion.set("model.path", str(found), f"from {key}")
        return
    conversion.set("model.path", name, f"from {key}: not a local folder, see the list above")
    conversion.skip(
        key,
        f"{name!r} is not a local folder; ZeRO-Pipe loads local folders and downloads nothing: "
        f"`huggingface-cli download {name} --local-dir DIR`, then set model.path: DIR",
    )


def as_number(value: Any) -> float | None:
    """YAML 1.1 reads 1e-4 (no dot) as a string; configs written for these tools are full of them."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def write_links(conversion: Conversion) -> list[str]:
    """Create the kohya-layout folder of links a diffusion-pipe conversion asks for; return what was made.

    Raises:
        ConversionError: the folder cannot be written, or a name there is already something else.
    """
    if not conversion.links:
        return []
    assert conversion.links_dir is not None
    made = []
    try:
        conversion.links_dir.mkdir(parents=True, exist_ok=True)
        for name, target in conversion.links.items():
            link = conversion.links_dir / name
            if link.is_symlink():
                if link.resolve() == target.resolve():
                    continue
                link.unlink()
            elif link.exists():
                raise ConversionError(f"{link} exists and is not a link made by zeropipe convert: move it away or remove it")
            link.symlink_to(target, target_is_directory=True)
            made.append(f"{link} -> {target}")
    except OSError as err:
        raise ConversionError(f"cannot create the image folder links in {conversion.links_dir} ({err}): make that folder writable") from None
    # A link left over from an earlier conversion of a dataset that has since lost a directory.
    for stale in conversion.links_dir.iterdir():
        if stale.is_symlink() and stale.name not in conversion.links:
            stale.unlink()
    return made


# ------------------------------------------------------------------ keys HF Trainer tools share
# axolotl and LLaMA-Factory both pass most training keys to Hugging Face's Trainer, so these
# mean the same in both: source key -> (ZeRO-Pipe key, type).
TRAINER_KEYS: dict[str, tuple[str, type]] = {
    "learning_rate": ("train.lr", float),
    "weight_decay": ("train.weight_decay", float),
    "max_grad_norm": ("train.grad_clip", float),
    "adam_beta1": ("train.adam_beta1", float),
    "adam_beta2": ("train.adam_beta2", float),
    "adam_epsilon": ("train.adam_eps", float),
    "warmup_steps": ("train.warmup_steps", int),
    "max_steps": ("train.max_steps", int),
    "gradient_accumulation_steps": ("train.gradient_accumulation_steps", int),
    "logging_steps": ("train.log_every", int),
    "save_steps": ("train.save_every", int),
    "save_total_limit": ("train.keep_last", int),
    "seed": ("run.seed", int),
    "group_by_length": ("data.group_by_length", bool),
}
SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant", "cosine_with_min_lr": "cosine"}
ADAMW_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adamw_apex_fused", "adamw")


def is_unset(value: Any) -> bool:
    """Keys left empty (``wandb_project:``) are simply not set, in every tool.

    ``false`` is a value: it can turn off what the tool (or ZeRO-Pipe) does by default
    (LLaMA-Factory's ``double_quantization: false``), so it is mapped or listed, never dropped.
    """
    return value is None or value == "" or value == [] or value == {}


def list_rest(conversion: "Conversion", rest: dict[str, Any], reasons: dict[str, str]) -> None:
    """Every source key no mapping took: listed with why (a key set to false too), unless it is empty."""
    for key, value in rest.items():
        if is_unset(value):
            continue
        if value is False:
            if key in reasons:  # a feature ZeRO-Pipe does not have: off is what it does
                conversion.already.append(f"{key}: false")
            else:
                conversion.skip(key, "false: not a key ZeRO-Pipe knows; nothing is turned on for it")
            continue
        conversion.skip(key, reasons.get(key) or f"{value!r}: no ZeRO-Pipe equivalent, left out")


def map_trainer_keys(conversion: Conversion, rest: dict[str, Any], extra: dict[str, tuple[str, type]] | None = None) -> None:
    for key, (target, kind) in {**TRAINER_KEYS, **(extra or {})}.items():
        if key not in rest:
            continue
        value = rest.pop(key)
        if value is None or value == "":
            continue
        number = as_number(value) if kind in (int, float) else value
        if number is None:
            conversion.skip(key, f"{value!r} is not a number: left out")
            continue
        if kind is int and number != int(number):
            conversion.skip(key, f"{value!r} is not a whole number: left out (ZeRO-Pipe's default applies)")
            continue
        conversion.set(target, kind(number), f"from {key}")


def map_output_dir(conversion: Conversion, value: Any, key: str = "output_dir") -> None:
    """``saves/llama3/lora`` is the run folder itself: output_dir saves, run.name lora."""
    if is_unset(value):
        return
    folder = Path(str(value))
    conversion.set("run.output_dir", str(folder.parent) if str(folder.parent) else ".", f"from {key} ({value}: the run is written to output_dir/name)")
    conversion.set("run.name", folder.name, f"from {key}")


def map_schedule(conversion: Conversion, key: str, value: Any) -> None:
    if is_unset(value):
        return
    if value in SCHEDULES:
        conversion.set("train.schedule", SCHEDULES[value], f"from {key}: {value}")
        if SCHEDULES[value] != "constant" and "train.min_lr_ratio" not in conversion.entries:
            conversion.set("train.min_lr_ratio", 0.0, f"Hugging Face's {value} schedule decays to 0")
    else:
        conversion.skip(key, f"{value!r}: ZeRO-Pipe has cosine, linear and constant schedules (after a linear warm-up)")


# Hugging Face's optim names (LLaMA-Factory's optim, axolotl's optimizer) -> train.optimizer, and what of the peer's optimizer is not kept.
OPTIMIZER_NAMES = {
    "adamw_torch": ("adamw", ""), "adamw_torch_fused": ("adamw", "DeepSpeed's fused AdamW"), "adamw_hf": ("adamw", ""), "adamw": ("adamw", ""),
    "adamw_apex_fused": ("adamw", "DeepSpeed's fused AdamW"), "paged_adamw_32bit": ("adamw", "paged states are not used"),
    "adamw_bnb_8bit": ("adamw8bit", ""), "adamw_8bit": ("adamw8bit", ""), "bnb_8bit": ("adamw8bit", ""), "paged_adamw_8bit": ("adamw8bit", "paged states are not used"),
    "adafactor": ("adafactor", ""), "muon": ("muon", ""),
}  # fmt: skip


def map_optimizer(conversion: Conversion, key: str, value: Any) -> None:
    if is_unset(value):
        return
    name = str(value).lower()
    if name not in OPTIMIZER_NAMES:
        conversion.skip(key, f"{value!r}: ZeRO-Pipe's optimizers are adamw, muon, adafactor, adamw8bit and prodigy (train.optimizer); converted as adamw")
        return
    optimizer, lost = OPTIMIZER_NAMES[name]
    if optimizer == "adamw":
        conversion.already.append(f"{key}: {value} (DeepSpeed builds AdamW{'; ' + lost if lost else ''})")
        return
    where = {"adamw8bit": "bitsandbytes' AdamW8bit, ZeRO 0-3 without offload", "adafactor": "torch's Adafactor, ZeRO-0 only", "muon": "DeepSpeed's Muon, no offload"}[optimizer]
    conversion.set("train.optimizer", optimizer, f"from {key}: {value} ({where}{'; ' + lost if lost else ''}; docs/optimizers.md)")


def map_adapter_init(conversion: Conversion, key: str, value: Any) -> None:
    """A peer's adapter to continue from (LLaMA-Factory's adapter_name_or_path, axolotl's lora_model_dir) -> model.lora.init_from."""
    if is_unset(value):
        return
    paths = [part.strip() for part in (value.split(",") if isinstance(value, str) else value) if str(part).strip()]
    if len(paths) != 1:
        conversion.skip(key, f"{value!r}: several adapters; ZeRO-Pipe continues from one: merge the others into the base first (`zeropipe export --merge`, or peft's merge_and_unload), then set model.lora.init_from")
        return
    found = Path(paths[0]).expanduser()
    note = "" if found.exists() else f"; {found} is not on this machine: ZeRO-Pipe downloads nothing, put the adapter there (or set model.lora.init_from to where it is)"
    conversion.set("model.lora.init_from", paths[0], f"from {key}: the LoRA starts from this adapter (its rank and modules must be the run's; docs/adapters.md){note}")


def map_warmup_ratio(conversion: Conversion, key: str, value: Any) -> None:
    ratio = as_number(value)
    if not ratio or "train.warmup_steps" in conversion.entries:
        return
    steps = conversion.entries.get("train.max_steps")
    if steps is not None:
        conversion.set("train.warmup_steps", int(round(ratio * steps.value)), f"from {key} = {ratio} x max_steps {steps.value}")
    else:
        conversion.skip(
            key,
            f"{ratio}: ZeRO-Pipe takes warm-up in steps (train.warmup_steps); the step count is known at launch (`zeropipe train` prints it): "
            f"set warmup_steps to {ratio} x that",
        )


def map_precision(conversion: Conversion, rest: dict[str, Any], tool: str) -> None:
    bf16, fp16 = rest.pop("bf16", None), rest.pop("fp16", None)
    if isinstance(bf16, str) and bf16 not in ("auto", "true", "false") or isinstance(fp16, str) and fp16 not in ("true", "false"):
        conversion.skip("bf16/fp16", f"bf16: {bf16!r}, fp16: {fp16!r}: not true or false")
    also = f" (fp16: {str(fp16).lower()})" if fp16 is not None else ""
    if bf16 in (True, "auto", "true"):
        conversion.set("deepspeed.precision", "bf16", f"from bf16: {str(bf16).lower()}{also}")
    elif fp16 in (True, "true"):
        conversion.set("deepspeed.precision", "fp16", f"from fp16: true (bf16: {str(bf16).lower()})")
    else:
        conversion.set("deepspeed.precision", "fp32", f"neither bf16 nor fp16 is set (bf16: {bf16}, fp16: {fp16}): {tool} trains in fp32 then")


def map_deepspeed(conversion: Conversion, key: str, value: Any, bases: tuple[Path, ...]) -> None:
    """A DeepSpeed JSON named by the config becomes deepspeed.config_file, its ZeRO stage and offload read from it."""
    import json
    import re

    if is_unset(value):
        return
    if isinstance(value, dict):
        conversion.set("deepspeed.overrides", value, f"from {key} (an inline DeepSpeed config, merged over the generated one)")
        return
    found = find_path(str(value), *bases)
    if found is None or not found.is_file():
        match = re.search(r"z(?:ero)?_?(\d)", Path(str(value)).name)
        if match and int(match[1]) in (0, 1, 2, 3):
            conversion.set("deepspeed.zero_stage", int(match[1]), f"from {key}: {value} (the file is not here; its name says ZeRO-{match[1]})")
        conversion.skip(key, f"{value} not found (looked relative to {', '.join(map(str, bases))}): set deepspeed.config_file to it, or keep the generated DeepSpeed config")
        return
    conversion.set("deepspeed.config_file", str(found), f"from {key}: its \"auto\" values are filled from this config")
    try:
        zero = json.loads(found.read_text()).get("zero_optimization", {})
    except (json.JSONDecodeError, AttributeError):
        conversion.skip(key, f"{found} is not a JSON object: fix it before training")
        return
    if isinstance(zero.get("stage"), int):
        conversion.set("deepspeed.zero_stage", zero["stage"], f"read from {found.name}, so that `zeropipe plan` and `check` see the same stage")
    for part in ("optimizer", "param"):
        device = (zero.get(f"offload_{part}") or {}).get("device")
        if device == "cpu":
            conversion.set(f"deepspeed.offload_{part}", "cpu", f"read from {found.name}")
        elif device == "nvme":
            conversion.blocking.append(
                f"{found.name} offloads {part}s to NVMe (zero_optimization.offload_{part}.device: nvme), which ZeRO-Pipe does not plan or run: "
                f"set the device to \"cpu\" in {found} (host RAM), or remove the block"
            )
            conversion.skip(f"{key} offload_{part}", "nvme: not supported by ZeRO-Pipe (see CANNOT TRAIN YET above)")


def count_records(path: Path) -> int | None:

    try:
        return sum(1 for item in iter_records(path) if isinstance(item, Record))  # counted as read, never all held
    except DataError:
        return None


def map_sources(conversion: Conversion, sources: list[tuple[str, Path, str]], why: str) -> None:
    """One dataset -> data.path and data.format; several -> data.mixture weighted by their sizes, as concatenation does."""
    if len(sources) == 1:
        key, path, fmt = sources[0]
        conversion.set("data.path", str(path), f"from {key}")
        conversion.set("data.format", fmt, why)
        return
    mixture = []
    for key, path, fmt in sources:
        mixture.append({"path": str(path), "format": fmt, "weight": float(count_records(path) or 1)})
    names = ", ".join(key for key, _, _ in sources)
    conversion.set("data.mixture", mixture, f"from {names}: weights are the datasets' record counts, so the mixture holds them as concatenated")


def to_int(value: Any, key: str) -> int:
    """``value`` as an int, or a ConversionError naming the source key (never a bare ValueError)."""
    number = as_number(value)
    if number is None or number != int(number):
        raise ConversionError(f"{key} = {value!r} is not a whole number: fix it in the source file")
    return int(number)


def to_float(value: Any, key: str) -> float:
    number = as_number(value)
    if number is None:
        raise ConversionError(f"{key} = {value!r} is not a number: fix it in the source file")
    return float(number)


def map_moe_keys(conversion: "Conversion", rest: dict[str, Any]) -> None:
    """Mixture-of-experts keys of LLaMA-Factory and axolotl (docs/moe.md): the router's auxiliary loss, LoRA on experts, the experts' kernel."""
    coef = rest.pop("moe_aux_loss_coef", None)  # LLaMA-Factory: sets router_aux_loss_coef and output_router_logits
    if coef is not None:
        conversion.set("model.router_aux_loss_coef", to_float(coef, "moe_aux_loss_coef"), "from moe_aux_loss_coef")
    targets = rest.pop("lora_target_parameters", None)  # axolotl: peft's target_parameters on the experts' 3-D weights
    if targets:
        conversion.set("model.lora.target_parameters", list(targets), "from lora_target_parameters (peft's LoRA on the experts' weights; dropout 0)")
        if "model.lora.dropout" in conversion.entries and conversion.entries["model.lora.dropout"].value:
            conversion.set("model.lora.dropout", 0.0, "peft's LoRA on the experts' weights takes no dropout")
    kernel = rest.pop("experts_implementation", None)  # axolotl
    if kernel in ("grouped_mm", "batched_mm", "eager"):
        conversion.set("model.experts_implementation", kernel, "from experts_implementation")
    elif kernel is not None:
        conversion.skip("experts_implementation", f"{kernel}: not in transformers; ZeRO-Pipe uses transformers' grouped_mm (model.experts_implementation: auto)")
    for key in ("expert_parallel_size", "expert_parallel_num_nvl_bytes", "expert_parallel_token_capacity"):
        if rest.get(key) not in (None, 1):
            conversion.skip(key, f"{rest.pop(key)}: expert parallelism (DeepSpeed's AutoEP) fails with transformers 5; ZeRO-3 gathers each MoE block whole instead (docs/moe.md)")
        rest.pop(key, None)


def map_sequence_parallel(conversion: Conversion, rest: dict[str, Any], keys: tuple[str, ...], how: str, ignored: tuple[str, ...] = ()) -> None:
    """A peer's sequence-parallel degree (axolotl's sequence_parallel_degree / context_parallel_size, LLaMA-Factory's
    sequence_parallel_size) -> parallel.sequence_parallel_size; ``how``: how the peer splits, said beside it.

    ``ignored``: the peer's settings of its own splitting (ring-attention strides, its mode), reported as not mapped.
    """
    for key in keys:
        if key not in rest:
            continue
        value = rest.pop(key)
        if is_unset(value):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            conversion.skip(key, f"{value!r}: the number of ranks that share each sample, a whole number (parallel.sequence_parallel_size)")
            continue
        # 1 (no split) is said too: every key of the file is converted, listed or refused.
        conversion.set("parallel.sequence_parallel_size", value, f"from {key}: {value} ({how}; ZeRO-Pipe splits with Ulysses' all-to-all over the "
                       "attention heads: the same losses, other communication; `zeropipe check` says where it runs)" if value > 1 else f"from {key}: 1, no split")
    for key in ignored:
        if key in rest:
            conversion.skip(key, f"{rest.pop(key)!r}: how {conversion.tool} splits a sequence; ZeRO-Pipe's Ulysses split has no such setting")
