"""Diffusion architectures: one module each, and the registry that finds them.

An entry (``core.Architecture``) is a declared record (which diffusers pipeline class it is, which
component is trained, its objective, parts, LoRA targets and tiny preset) and roles for the code that
differs (how the denoiser is called, how prompts are encoded, how samples are drawn, the original LoRA
layout). Everything else (caches, buckets, training loop, export) is shared and asks the entry.
Adding one is a module here plus a line in :data:`BUILTIN`; see docs/architecture.md. A plug-in registers
an ``Architecture`` too; anything else is refused with the way to write one.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zeropipe.config.pipeline_index import read_pipeline_index
from zeropipe.errors import ConfigError
from zeropipe.families.diffusion.core import Architecture, PredictContext, Record

# The modules that hold the built-in architectures, each defining ARCHITECTURE.
BUILTIN = (
    "sdxl", "sd15", "sd3", "flux", "wan", "wan_i2v", "hunyuan_video", "ltx_video", "chroma", "qwen_image", "z_image",
    "flux2", "flux2_klein", "qwen_image_edit", "flux_kontext",
    "lumina2", "hidream", "auraflow", "hunyuan_image",
    "wan_ti2v", "wan_ti2v_i2v", "hunyuan_video15", "hunyuan_video15_i2v", "skyreels_v2", "skyreels_v2_i2v",
    "kandinsky5_t2i", "kandinsky5_t2v", "kandinsky5_i2v", "krea2", "ernie_image",
    "qwen_image_edit_plus",
    "ltx2",
    "ideogram4",
    "cosmos_predict2", "cosmos_predict2_video2world",
    "qwen_image21",
    "z_image_omni",
    "flux3",
    "flux3_distilled",
    "qwen_image_layered",
    "wan_vace",
    "minimax_h3",
    "minimax_h3_i2v",
    "ltx25",
    "kandinsky6",
    "kandinsky6_i2v",
    "wan_animate2", "wan_animate2_distilled",
    "cosmos3",
)

_REGISTRY: dict[str, Architecture] = {}
_loaded = False


def register(architecture: Architecture) -> Architecture:
    """Make an architecture known by its name, its pipeline class and its preset.

    Architectures outside this package register from a plug-in module (see zeropipe.families).
    """
    _load_builtin()
    architecture = as_entry(architecture)
    _REGISTRY[architecture.record.name] = architecture
    return architecture


def as_entry(architecture) -> Architecture:
    """The entry as it is registered: an ``Architecture`` (a record and its roles); anything else is refused with the way to write one.

    Raises:
        ConfigError: a plug-in's object is not an ``Architecture`` (an entry in the retired old shape, a class with constant methods).
    """
    if isinstance(architecture, Architecture):
        return architecture
    raise ConfigError([(
        "plugins",
        f"{type(architecture).__name__} is not a diffusion entry: register Architecture(record=Record(...), call=..., prompts=...) "
        "(docs/architecture.md, \"A diffusion architecture\"; the old shape, one class with constant methods, was retired when every "
        "built-in entry moved to the record: its recipe there converts a plug-in written that way)",
    )])


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN:
            arch = as_entry(importlib.import_module(f"{__name__}.{module}").ARCHITECTURE)
            _REGISTRY.setdefault(arch.record.name, arch)


def architectures() -> dict[str, Architecture]:
    _load_builtin()
    return dict(_REGISTRY)


def architecture_named(name: str) -> Architecture:
    _load_builtin()
    if name not in _REGISTRY:
        raise ConfigError([("model.path", f"unknown diffusion architecture {name!r}: ZeRO-Pipe trains {', '.join(_REGISTRY)}")])
    return _REGISTRY[name]


def architecture_for_pipeline(class_name: str | None, index: Mapping[str, Any] | None = None, task: str = "auto") -> Architecture | None:
    """The architecture a diffusers pipeline class name (``model_index.json``'s ``_class_name``) belongs to.

    The latest registered entry wins, so a plug-in can replace a built-in for its pipeline class.
    ``index`` (``model_index.json`` as read) is matched against an entry's ``pipeline_settings``:
    Wan 2.2 TI2V-5B is a ``WanPipeline`` saved with ``expand_timesteps: true``; without it, an
    entry that names settings is passed over. ``task`` (``model.diffusion.task``) other than auto is the setting
    ``zeropipe_task`` the folder did not write: Kandinsky 6's one checkpoint trains as text- or image-to-video.
    """
    _load_builtin()
    settings = {**(index or {}), **({TASK_SETTING: task} if task != "auto" else {})}
    for arch in reversed(list(_REGISTRY.values())):
        named = class_name == arch.record.pipeline_class or class_name in arch.record.related_pipelines
        if named and all(settings.get(key) == value for key, value in arch.record.pipeline_settings):
            return arch
    return None


TASK_SETTING = "zeropipe_task"  # the pipeline setting an entry that shares its folder with another names its task by


def task_problem(arch: Architecture, class_name: str | None, task: str) -> str | None:
    """Why ``model.diffusion.task`` does not apply to the folder's entry (None: it does, or it is auto)."""
    if task == "auto" or dict(arch.record.pipeline_settings).get(TASK_SETTING) == task:
        return None
    offered = sorted({entry.record.pipeline_class for entry in architectures().values() if dict(entry.record.pipeline_settings).get(TASK_SETTING) == task})
    return (f"{task}: a {class_name} has no {task} entry that trains from the same folder (the pipelines that have one: {', '.join(offered) or 'none'}); "
            "an image-to-video model with its own checkpoint (Wan 2.1 I2V, HunyuanVideo 1.5 I2V) is told by its folder: remove the key")


def architecture_for_denoiser(class_name: str) -> Architecture | None:
    """The architecture whose trained component is this diffusers class (the planner asks it for its trace inputs).

    The first registered: the plain entry of a denoiser class, as the variants that share it
    (Qwen-Image-Edit, Flux Kontext, Wan 2.1 I2V) register after it and are named where meant
    (a catalog entry's ``architecture``, a pipeline's ``model_index.json``). A plug-in that
    replaces a built-in under its name keeps the built-in's place.
    """
    _load_builtin()
    return next((arch for arch in _REGISTRY.values() if arch.record.denoiser_class == class_name), None)


def architecture_for_preset(preset: str) -> Architecture | None:
    _load_builtin()
    return next((arch for arch in _REGISTRY.values() if arch.record.preset_name == preset), None)


def presets() -> dict[str, Architecture]:
    _load_builtin()
    return {arch.record.preset_name: arch for arch in _REGISTRY.values() if arch.record.preset_name}


def architecture_of(pipeline_dir: Path, task: str = "auto") -> Architecture:
    """The architecture of a diffusers pipeline directory, from its model_index.json (read by ``read_pipeline_index``),
    and the run's ``model.diffusion.task`` where its one checkpoint has two entries.

    Raises:
        ConfigError: the folder is no pipeline ZeRO-Pipe trains, lacks its denoiser, or has no entry for the task asked.
    """
    folder = read_pipeline_index(pipeline_dir)
    name = folder.class_name
    arch = architecture_for_pipeline(name, folder.index, task)
    if arch is None:
        known = ", ".join(sorted(a.record.pipeline_class for a in architectures().values()))
        raise ConfigError([("model.path", f"{folder.index_file} holds a {name}, which ZeRO-Pipe does not train yet (it trains {known})")])
    problem = task_problem(arch, name, task)
    if problem:
        raise ConfigError([("model.diffusion.task", problem)])
    if not (Path(pipeline_dir) / arch.record.denoiser).is_dir():
        raise ConfigError([("model.path", f"{pipeline_dir} has no {arch.record.denoiser}/ folder, which a {name} needs")])
    return arch


__all__ = [
    "Architecture",
    "PredictContext",
    "architecture_for_denoiser",
    "architecture_for_pipeline",
    "architecture_for_preset",
    "architecture_named",
    "architecture_of",
    "architectures",
    "presets",
    "register",
    "unregister",
]
