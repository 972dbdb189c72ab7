"""Model families as plug-ins: the registry, and the commands that ask the run's family.

A family (causal LM, vision-language, diffusion) is one package here (``causal_lm/``,
``vlm/``: its data preparation, rank task, model building, export, generation and model spec)
whose ``FAMILY`` fills in :class:`~zeropipe.families.base.Family`; the registry holds them in
detection order. Families never import each other (an import-linter contract in pyproject.toml).
Everything that depends on the family — config problems, data preparation, the rank's
training logic, the planner's model spec, export, generation — goes through
:func:`family_named` / :func:`family_of` and the family's methods. Adding a family is a
module or package plus a line in :data:`BUILTIN`; a family outside this package is a module that calls
:func:`register` when imported, named in ``ZEROPIPE_PLUGINS`` (comma-separated module names)
or in the ``zeropipe.plugins`` entry-point group of an installed package, so that the
launcher and every rank load it. See docs/architecture.md.
"""

from __future__ import annotations

import importlib
import os
import threading
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zeropipe.config.pipeline_index import is_pipeline_folder
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.export.generate import check_sampling, pair_images, pick_device, pick_dtype
from zeropipe.export.generate import resolve_source as locate
from zeropipe.export.hf import export_job
from zeropipe.families.base import Family
from zeropipe.rundir import RunDir, note_plugin

if TYPE_CHECKING:
    from zeropipe.config.schema import ModelSection, RunConfig
    from zeropipe.export.generate import Generation, LoadedModel, ModelSource
    from zeropipe.plan.model_spec import ModelSpec

# Built-in families in detection order: the first whose detect() says yes is the family of a
# model.family: auto config; the last one (causal LM) takes whatever the others do not.
BUILTIN = ("diffusion", "vlm", "causal_lm")

_REGISTRY: dict[str, Family] = {}
_loaded = False
_loading_now = False
# The web UI serves requests on several threads: a second one asking while the first imports
# the built-ins must wait for them, not find a half-filled registry ("no model family
# recognises this model"). Re-entrant: plug-ins register from inside the loading.
_loading = threading.RLock()


def register(family: Family, first: bool = False) -> Family:
    """Add a family to the registry (detected before the built-ins with ``first``)."""
    _load_builtin()
    if first:
        items = [(family.name, family), *((name, f) for name, f in _REGISTRY.items() if name != family.name)]
        _REGISTRY.clear()
        _REGISTRY.update(items)
    else:
        _REGISTRY[family.name] = family
    return family


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def _load_builtin() -> None:
    global _loaded, _loading_now
    if _loaded:
        return
    with _loading:
        if _loaded or _loading_now:
            return  # loaded by another thread meanwhile, or a plug-in registering from inside this loading
        _loading_now = True
        try:
            for module in BUILTIN:
                family = importlib.import_module(f"{__name__}.{module}").FAMILY
                _REGISTRY[family.name] = family
            load_plugins()
        finally:
            _loading_now = False
            _loaded = True  # even when a plug-in failed: its error was raised once, as before


def load_plugins() -> list[str]:
    """Import the plug-in modules (``ZEROPIPE_PLUGINS`` and the ``zeropipe.plugins`` entry points); they register on import.

    Raises:
        ConfigError: a plug-in module that cannot be imported, named with the error.
    """
    named = [name.strip() for name in os.environ.get("ZEROPIPE_PLUGINS", "").split(",") if name.strip()]
    names = named + [entry.value for entry in entry_points(group="zeropipe.plugins")]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - whatever a plug-in raises, the user needs its name
            raise ConfigError([("ZEROPIPE_PLUGINS", f"plug-in module {name!r} cannot be imported ({type(err).__name__}: {err}): fix it or remove it")]) from None
    for name in named:
        note_plugin(name)  # recorded in the runs this process prepares (entry points load in every process anyway)
    return names


def families() -> dict[str, Family]:
    _load_builtin()
    return dict(_REGISTRY)


def family_named(name: str) -> Family:
    _load_builtin()
    if name not in _REGISTRY:
        raise ConfigError([("model.family", f"unknown model family {name!r}: use auto or one of {', '.join(_REGISTRY)}")])
    return _REGISTRY[name]


def family_of(section: "ModelSection") -> Family:
    """model.family, or the family model.path / model.config shows."""
    if section.family != "auto":
        return family_named(section.family)
    _load_builtin()
    for family in _REGISTRY.values():
        if family.detect(section):
            return family
    raise ConfigError([("model.family", "no model family recognises this model: set model.family")])


def family_of_dir(path: Path) -> Family:
    """The family of an exported or downloaded model directory."""
    _load_builtin()
    for family in _REGISTRY.values():
        if family.detect_dir(path):
            return family
    raise ZeroPipeError(f"{path} holds no model ZeRO-Pipe knows (no config.json or model_index.json it recognises)")


# ------------------------------------------------------------------ the commands that dispatch
def model_spec(config: "RunConfig") -> "ModelSpec":
    """The planner's description of a run config's model."""
    from dataclasses import replace

    # The optimizer's state and the EMA are the same for every family: counted from train.* here, once.
    return replace(family_of(config.model).model_spec(config), optimizer=config.train.optimizer, ema=config.train.ema is not None)


def export_run(source: str | Path, out: str | Path, merge: bool = False, dtype: str | None = None, force: bool = False, ema: bool = False) -> Path:
    """Write a run's checkpoint as its family's libraries load it (a transformers or diffusers directory, an adapter).

    Args:
        source: run directory, or one of its checkpoint directories.
        merge: for LoRA runs, merge the adapter into the base instead of saving it alone.
        dtype: bf16, fp16 or fp32; default: the run's training precision.
        ema: export the checkpoint's EMA weights (train.ema) instead of the trained ones.

    Raises:
        CheckpointError: no complete checkpoint, or it does not match the run's model.
    """

    job = export_job(source, out, merge, dtype, force, ema)
    return family_of(job.config.model).export(job)


def resolve_source(path: str | Path, checkpoint: str | None = None) -> "ModelSource":
    """Where the weights of a run, export or adapter are, and their family."""

    source = locate(path, checkpoint)
    if source.kind == "run":
        source.family = family_of(RunDir(source.path).read_config().model).name
    else:
        source.family = family_of_dir(source.base if source.kind == "adapter" else source.path).name
    return source


def load_model(path: str | Path, checkpoint: str | None = None, device: str | None = None, dtype: str | None = None) -> "LoadedModel":
    """Load the model of a run, an export or an adapter for generation.

    Raises:
        ZeroPipeError: an unusable source, a family that cannot generate text, or a
            checkpoint that does not match its run.
    """

    source = resolve_source(path, checkpoint)
    torch_device = pick_device(device)
    return family_named(source.family).load_for_generate(source, torch_device, pick_dtype(dtype, torch_device))


def generate(
    loaded: "LoadedModel",
    prompts: list[str | list[dict[str, str]]],
    images: list[str] | None = None,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    raw: bool = False,
    streamer: Any = None,
) -> list["Generation"]:
    """Answer each prompt; greedy unless ``temperature`` > 0.

    Args:
        prompts: each one user turn's text, or a conversation (a list of system / user / assistant
            messages ending with a user turn: the UI's Chat page sends the whole history each turn).
        images: vision-language models: one image for every prompt, or one per prompt (with a
            conversation, the image goes with its first user turn).
        raw: continue the prompt text as it is instead of rendering it as a user turn.
        streamer: text models: a transformers streamer given each answer's tokens as they are made.

    Raises:
        ZeroPipeError: images for a text-only model, or bad sampling settings.
    """

    check_sampling(prompts, temperature, top_p)
    tokens = max_new_tokens or loaded.default_max_new_tokens
    family = family_named(loaded.source.family)
    return family.generate(loaded, prompts, pair_images(prompts, images), tokens, temperature, top_p, seed, raw, streamer)


def load_drawing(path: str | Path, checkpoint: str | None = None, device: str | None = None) -> "LoadedModel":
    """Load the pipeline of a run's checkpoint, an export or a LoRA export for drawing (the UI's Draw page).

    Raises:
        ZeroPipeError: an unusable source, or a family that writes text rather than pictures.
    """
    path = Path(path).expanduser()
    if (path / "zeropipe_export.json").is_file() and not is_pipeline_folder(path) and not (path / "adapter_config.json").is_file():
        # A diffusion LoRA export: the LoRA file, and its base named beside it.
        from zeropipe.export.generate import ModelSource

        source = ModelSource("adapter", path, family="diffusion")  # only the diffusion family's export writes this
    else:
        source = resolve_source(path, checkpoint)
    family = family_named(source.family)
    if not getattr(family, "draws_images", False):
        raise ZeroPipeError(f"{source.describe()} is a {source.family} model: it writes text, it does not draw; talk to it on the Chat page")
    torch_device = pick_device(device)
    return family.load_for_drawing(source, torch_device, pick_dtype(None, torch_device))


def draw(loaded: "LoadedModel", out_dir: str | Path, prompt: str, negative_prompt: str = "", width: int = 512, height: int = 512,
         steps: int = 20, guidance: float = 5.0, seed: int = 0, frames: int | None = None, on_step: Any = None) -> list[dict[str, Any]]:  # fmt: skip
    """Draw one picture (or clip, for a video model) with a loaded pipeline into ``out_dir``; returns what was written.

    ``on_step(step, steps)`` is called after each denoising step (the UI's progress; raising there stops the drawing).
    """
    return family_named(loaded.source.family).draw(loaded, Path(out_dir), prompt, negative_prompt, width, height, steps, guidance, seed, frames, on_step=on_step)


__all__ = [
    "Family",
    "draw",
    "export_run",
    "families",
    "family_named",
    "family_of",
    "family_of_dir",
    "generate",
    "load_drawing",
    "load_model",
    "model_spec",
    "register",
    "resolve_source",
    "unregister",
]
