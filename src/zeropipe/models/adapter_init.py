"""Continuing from an existing adapter (``model.lora.init_from``): reading the LoRA layouts users have onto the run's peft modules.

A run with ``model.lora.init_from: PATH`` starts its adapters from that file (or folder) instead of
peft's initialisation. The layouts read (each by its real key naming):

- **peft** (``adapter_model.safetensors`` + ``adapter_config.json``; ZeRO-Pipe's causal-LM and VLM
  exports, LLaMA-Factory's and axolotl's adapters): ``base_model.model.<module>.lora_A.weight``;
- **diffusers** (``pytorch_lora_weights.safetensors``, ZeRO-Pipe's diffusion export, ai-toolkit's
  transformer LoRAs): ``transformer.<module>.lora_A.weight`` (``unet.<module>.lora.down.weight`` for
  UNets), the adapter's config in the file's ``lora_adapter_metadata``; no alpha: alpha = rank;
- **ComfyUI / ZeRO-Pipe's original layout** (``lora_comfyui.safetensors``; musubi-tuner's converted
  files; ai-toolkit's FLUX.2 files): ``diffusion_model.<original module>.lora_A.weight`` and ``.alpha``;
  the original names are found by running the entry's own exporter (``original_lora_layout``) on the
  run's modules, so any entry whose layout renames modules one to one reads back; layers an entry
  fuses (FLUX.2's qkv) are refused by name;
- **kohya / musubi-tuner / ai-toolkit's non-peft** (``lora_unet_<module_with_underscores>.lora_down.weight``,
  ``lora_up.weight``, ``.alpha``; ``lora_transformer_...``): the module's name with its dots as
  underscores, diffusers' or the original one.

Every key must land on a module the run adapts, with the run's rank: a key that maps nowhere, a rank
or target mismatch, is one ``ConfigError`` naming the config key and the adapter's values. The
adapter's strength is kept exactly: its scaling (``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA)
against the run's is folded into ``lora_B``.

Only safetensors files are read as they are; a ``.bin``/``.pt`` adapter goes through the safe loader
(``checkpoint.safeload``: tensors only, no code unpickled) or is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from zeropipe.errors import ConfigError

KEY = "model.lora.init_from"
# What a folder's adapter file is called, in the order one is chosen (ZeRO-Pipe's diffusion export writes the first and lora_comfyui).
FOLDER_FILES = ("adapter_model.safetensors", "pytorch_lora_weights.safetensors", "lora_comfyui.safetensors", "adapter_model.bin", "pytorch_lora_weights.bin")
SAFE_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# Prefixes the layouts put before a module's dotted name.
DOTTED_PREFIXES = ("base_model.model.", "transformer.", "unet.", "diffusion_model.", "model.diffusion_model.")
# Prefixes kohya-style layouts put before a module's name with its dots as underscores.
UNDERSCORE_PREFIXES = ("lora_unet_", "lora_transformer_")
# The suffix of each LoRA weight, in every layout, and what it is.
PART_SUFFIXES = (
    (".lora_A.default.weight", "A"), (".lora_B.default.weight", "B"), (".lora_A.weight", "A"), (".lora_B.weight", "B"),
    (".lora_down.weight", "A"), (".lora_up.weight", "B"), (".lora.down.weight", "A"), (".lora.up.weight", "B"),
    (".lora_linear_layer.down.weight", "A"), (".lora_linear_layer.up.weight", "B"),
    (".lora_magnitude_vector.default.weight", "magnitude"), (".lora_magnitude_vector.weight", "magnitude"), (".lora_magnitude_vector", "magnitude"),
    (".alpha", "alpha"),
)  # fmt: skip


@dataclass
class AdapterFile:
    """An adapter as read: its file, its tensors and what its config says (peft's adapter_config.json or diffusers' metadata)."""

    path: Path
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        with open(self.path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()


def adapter_file(path: str | Path) -> Path:
    """The adapter file ``init_from`` names: the file itself, or the adapter file a folder holds.

    Raises:
        ConfigError: nothing there, or a folder without a known adapter file.
    """
    location = Path(path).expanduser()
    if location.is_file():
        return location
    if not location.is_dir():
        raise ConfigError([(KEY, f"{location} does not exist: name an adapter file (.safetensors) or the folder an adapter was saved to")])
    for name in FOLDER_FILES:
        if (location / name).is_file():
            return location / name
    found = sorted(p.name for p in location.glob("*.safetensors"))
    if len(found) == 1:
        return location / found[0]
    raise ConfigError([(KEY, f"{location} holds no adapter file ({', '.join(FOLDER_FILES[:3])}{'; it has ' + ', '.join(found[:5]) if found else ''}): name the file itself")])


def read_adapter(path: str | Path) -> AdapterFile:
    """The adapter's tensors and config, read without running code from the file.

    Raises:
        ConfigError: not an adapter file ZeRO-Pipe reads (the suffix), or a pickle needing anything but tensors.
    """
    from zeropipe.confine import require_usable

    file = require_usable(adapter_file(path), KEY)
    config: dict[str, Any] = {}
    if file.suffix in SAFE_SUFFIXES:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
            metadata = handle.metadata() or {}
        if "lora_adapter_metadata" in metadata:  # diffusers' save_lora_weights: the adapter's LoraConfig, keys prefixed with the component
            raw = json.loads(metadata["lora_adapter_metadata"])
            config = {key.split(".", 1)[1] if key.startswith(("transformer.", "unet.")) else key: value for key, value in raw.items()}
    elif file.suffix in PICKLE_SUFFIXES:
        from zeropipe.checkpoint.safeload import UnsafeCheckpoint, load

        try:
            tensors = load(str(file), map_location="cpu")
        except UnsafeCheckpoint as err:
            raise ConfigError([(KEY, str(err))]) from None
        if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
            raise ConfigError([(KEY, f"{file} is not a mapping of tensor names to tensors, as an adapter file is")])
    else:
        raise ConfigError([(KEY, f"{file}: adapters are read from .safetensors files (or a .bin/.pt through the safe loader); {file.suffix or 'no suffix'} is not one")])
    peft_config = file.parent / "adapter_config.json"
    if peft_config.is_file() and file.name.startswith("adapter_model"):
        config = json.loads(peft_config.read_text())
    if not tensors:
        raise ConfigError([(KEY, f"{file} holds no tensors")])
    return AdapterFile(file, tensors, config)


def describe(path: str | Path) -> dict[str, Any]:
    """What run.json records of the adapter a run starts from: the file, its digest, its layout and its rank."""
    adapter = read_adapter(path)
    modules = split_parts(adapter.tensors)
    ranks = sorted({int(parts["A"].shape[0]) for parts in modules.values() if "A" in parts})
    return {"path": str(adapter.path.resolve()), "sha256": adapter.sha256, "layout": layout_name(adapter), "modules": len(modules), "rank": ranks}


def layout_name(adapter: AdapterFile) -> str:
    """The layout's name for people: peft, diffusers, comfyui, kohya."""
    keys = list(adapter.tensors)
    if any(key.startswith(UNDERSCORE_PREFIXES) for key in keys):
        return "kohya"
    if any(key.startswith("diffusion_model.") for key in keys):
        return "comfyui"
    if any(key.startswith("base_model.model.") for key in keys):
        return "peft"
    return "diffusers"


def split_parts(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The file's tensors by module stem (the key before the LoRA suffix) and part (A, B, alpha, magnitude); a key with no known suffix under the stem ''+key, part '?'."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        for suffix, part in PART_SUFFIXES:
            if key.endswith(suffix):
                modules.setdefault(key[: -len(suffix)], {})[part] = tensor
                break
        else:
            modules.setdefault(key, {})["?"] = tensor
    return modules


def underscored(name: str) -> str:
    return name.replace(".", "_")


def original_names(layout: Callable[[dict[str, torch.Tensor], float], dict[str, torch.Tensor] | None], modules: dict[str, tuple[int, int]], rank: int) -> tuple[dict[str, str], set[str]]:
    """Each adapted module's name in the entry's original (ComfyUI) layout, found by running the entry's own exporter.

    Every module gets an A and a B filled with its own number; an output key whose tensor holds one
    number only is that module's under another name; a key holding several (a fused qkv) is returned
    in the second set, so that a file using it is refused by name.
    """
    layers: dict[str, torch.Tensor] = {}
    numbers: dict[float, str] = {}
    for index, (name, (inputs, outputs)) in enumerate(sorted(modules.items())):
        a, b = float(2 * index + 1), float(2 * index + 2)
        layers[f"{name}.lora_A.weight"] = torch.full((rank, inputs), a, dtype=torch.float64)
        layers[f"{name}.lora_B.weight"] = torch.full((outputs, rank), b, dtype=torch.float64)
        numbers[a], numbers[b] = name, name
    try:
        written = layout(layers, float(rank))  # alpha = rank: a layout that folds the strength into B leaves it as it is
    except ValueError:
        return {}, set()
    originals: dict[str, str] = {}
    fused: set[str] = set()
    for key, tensor in (written or {}).items():
        stem, part = next(((key[: -len(s)], p) for s, p in PART_SUFFIXES if key.endswith(s)), (key, "?"))
        if part not in ("A", "B"):
            continue
        values = torch.unique(tensor.to(torch.float64))
        if len(values) == 1 and float(values[0]) in numbers:
            originals[numbers[float(values[0])]] = stem[len("diffusion_model.") :] if stem.startswith("diffusion_model.") else stem
        else:
            fused.add(stem)
    return originals, fused


@dataclass
class ModuleSlot:
    name: str  # the module's name in the model, without peft's base_model.model.
    layer: Any | None  # peft's LoRA layer, or None: a linear layer the run does not adapt


def model_slots(model: torch.nn.Module) -> dict[str, ModuleSlot]:
    """The run's adapted modules and its other linear layers, by canonical name (peft's wrapper prefix dropped)."""
    from peft.tuners.lora import LoraLayer

    slots: dict[str, ModuleSlot] = {}
    for name, module in model.named_modules():
        canonical = name[len("base_model.model.") :] if name.startswith("base_model.model.") else name
        if isinstance(module, LoraLayer):
            slots[canonical] = ModuleSlot(canonical, module)
        elif isinstance(module, torch.nn.Linear) and not name.endswith(".base_layer") and ".lora_" not in name and canonical not in slots:
            slots[canonical] = ModuleSlot(canonical, None)
    return slots


def _first(items: list[str], count: int = 5) -> str:
    items = sorted(items)
    return ", ".join(items[:count]) + (f" (and {len(items) - count} more)" if len(items) > count else "") + f" [{len(items)} in all]"


def adapter_scaling(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def load_initial_adapter(model: torch.nn.Module, init_from: str | Path, original_layout: Callable | None = None) -> dict[str, Any]:
    """Copy the adapter at ``init_from`` into ``model``'s peft LoRA weights (ZeRO-3 partitions included); returns what run.json notes.

    Args:
        original_layout: the diffusion entry's ``original_lora_layout``, to read the ComfyUI/musubi-tuner names of its modules.

    Raises:
        ConfigError: a key that maps onto no module, a module the run adapts that the adapter lacks, a rank, kind or shape mismatch.
    """
    adapter = read_adapter(init_from)
    slots = model_slots(model)
    adapted = {name: slot for name, slot in slots.items() if slot.layer is not None}
    if not adapted:
        raise ConfigError([(KEY, "the model has no LoRA layers to load the adapter into: set model.lora")])
    first_layer = next(iter(adapted.values())).layer
    run_rank = int(first_layer.r["default"])

    # Every name a layout may give each module: diffusers' / transformers' own and, for diffusion entries, the original one.
    lookup: dict[str, str] = {}
    fused: set[str] = set()
    if original_layout is not None:
        shapes = {name: (slot.layer.in_features, slot.layer.out_features) for name, slot in adapted.items()}
        originals, fused = original_names(original_layout, shapes, run_rank)
    else:
        originals = {}
    for name in slots:
        for alias in (name, originals.get(name)):
            if alias:
                lookup.setdefault(alias, name)
                lookup.setdefault(underscored(alias), name)

    def module_of(stem: str) -> str | None:
        if stem in lookup:
            return lookup[stem]
        for prefix in DOTTED_PREFIXES:
            if stem.startswith(prefix) and stem[len(prefix) :] in lookup:
                return lookup[stem[len(prefix) :]]
        for prefix in UNDERSCORE_PREFIXES:
            if stem.startswith(prefix) and stem[len(prefix) :] in lookup:
                return lookup[stem[len(prefix) :]]
        return None

    found: dict[str, dict[str, torch.Tensor]] = {}
    unmatched: list[str] = []
    fused_keys: list[str] = []
    for stem, parts in split_parts(adapter.tensors).items():
        module = module_of(stem) if "?" not in parts else None
        if module is None:
            keys = [k for k in adapter.tensors if k == stem or k.startswith(stem + ".")]
            (fused_keys if stem[len("diffusion_model.") :] in fused or stem in fused else unmatched).extend(keys or [stem])
            continue
        found.setdefault(module, {}).update(parts)

    problems: list[tuple[str, str]] = []
    if fused_keys:
        problems.append((KEY, f"{adapter.path.name}: these keys are layers the architecture's original layout fuses, which are not read back: {_first(fused_keys)}; continue from the run's diffusers file (pytorch_lora_weights.safetensors) instead"))
    if unmatched:
        problems.append((KEY, f"{adapter.path.name} ({layout_name(adapter)} layout): keys that map onto no module of this model: {_first(unmatched)}. Is it an adapter of this base model?"))
    not_targeted = sorted(name for name in found if slots[name].layer is None)
    if not_targeted:
        problems.append(("model.lora.target_modules", f"the adapter adapts modules the run does not ({_first(not_targeted)}): add them to target_modules (the adapter's modules end in {', '.join(sorted({n.rsplit('.', 1)[-1] for n in found}))})"))
    missing = sorted(name for name in adapted if name not in found)
    if missing and not unmatched and not fused_keys:
        problems.append(("model.lora.target_modules", f"the run adapts modules the adapter has no weights for ({_first(missing)}): set target_modules to the adapter's ({', '.join(sorted({n.rsplit('.', 1)[-1] for n in found}))})"))
    ranks = sorted({int(parts["A"].shape[0]) for parts in found.values() if "A" in parts})
    if ranks and ranks != [run_rank]:
        problems.append(("model.lora.r", f"the adapter's rank is {', '.join(map(str, ranks))} and the run's is {run_rank}: set model.lora.r: {ranks[0]}" if len(ranks) == 1 else f"the adapter's modules have ranks {ranks}; the run has one rank, {run_rank}"))
    has_magnitude = any("magnitude" in parts for parts in found.values())
    dora = bool(first_layer.use_dora.get("default")) if hasattr(first_layer, "use_dora") else False
    if has_magnitude != dora:
        problems.append(("model.lora.kind", f"the adapter is {'a DoRA' if has_magnitude else 'a plain LoRA'} and the run trains {'DoRA' if dora else 'LoRA'}: set kind: {'dora' if has_magnitude else 'lora'}"))
    peft_type = str(adapter.config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        problems.append(("model.lora.kind", f"the adapter is peft's {peft_type}; model.lora.init_from reads LoRA and DoRA adapters"))
    for name, parts in found.items():
        if "A" not in parts or "B" not in parts:
            problems.append((KEY, f"{name}: the adapter has {'lora_A' if 'A' in parts else 'lora_B'} without {'lora_B' if 'A' in parts else 'lora_A'}"))
        elif slots[name].layer is not None and ranks == [run_rank]:
            layer = slots[name].layer
            if tuple(parts["A"].shape) != (run_rank, layer.in_features) or tuple(parts["B"].shape) != (layer.out_features, run_rank):
                problems.append((KEY, f"{name}: the adapter's weights are {tuple(parts['B'].shape)} x {tuple(parts['A'].shape)}, this model's layer is {layer.out_features} x {layer.in_features}: an adapter of another base model"))
    if problems:
        raise ConfigError(problems)

    # The adapter's strength, exactly: its scaling over the run's folded into B.
    config_alpha = adapter.config.get("lora_alpha")
    alpha_pattern = adapter.config.get("alpha_pattern") or {}
    rslora = bool(adapter.config.get("use_rslora", False))
    values: dict[torch.Tensor, torch.Tensor] = {}
    ratios: set[float] = set()
    for name, parts in found.items():
        layer = slots[name].layer
        if "alpha" in parts:
            alpha = float(parts["alpha"].float().reshape(-1)[0])
        else:
            pattern = next((value for key, value in alpha_pattern.items() if re.search(rf"(^|\.){key}$", name)), None)
            alpha = float(pattern if pattern is not None else config_alpha if config_alpha is not None else run_rank)  # no alpha anywhere: alpha = rank (kohya's and diffusers' reading)
        ratio = adapter_scaling(alpha, run_rank, rslora) / float(layer.scaling["default"])
        ratios.add(round(ratio, 12))
        values[layer.lora_A["default"].weight] = parts["A"]
        values[layer.lora_B["default"].weight] = parts["B"].to(torch.float64) * ratio
        if "magnitude" in parts:
            values[layer.lora_magnitude_vector["default"].weight] = parts["magnitude"]
    copy_into(values)
    return {"path": str(adapter.path.resolve()), "layout": layout_name(adapter), "modules": len(found), "rank": run_rank, "strength_folded_into_lora_B": sorted(ratios)}


def copy_into(values: dict[torch.Tensor, torch.Tensor]) -> None:
    """Copy each value into its parameter: a ZeRO-3 partitioned one gets this rank's slice of its partition (as ``models.loading`` fills the base), no collective."""
    from zeropipe.models.checkpoint_index import partition_range
    from zeropipe.models.tensor_copy import is_zero3_param

    with torch.no_grad():
        for param, value in values.items():
            if is_zero3_param(param):
                import deepspeed.comm as dist

                flat = value.reshape(-1).to(param.ds_tensor.dtype)
                partition = param.ds_tensor
                start, stop = partition_range(param.ds_numel, partition.ds_numel, dist.get_rank(group=param.ds_process_group))
                partition.narrow(0, 0, stop - start).copy_(flat[start:stop])
                if param.numel() == param.ds_numel:
                    param.data.view(-1).copy_(flat)
            else:
                param.data.copy_(value.reshape(param.shape).to(param.dtype))
