"""A diffusers pipeline folder, read one way: ``model_index.json`` (or a modular pipeline's ``modular_model_index.json``) and its components' config files.

Every part of ZeRO-Pipe that needs to know what a pipeline folder holds (which pipeline class,
which components and their classes, the pipeline's own settings such as Wan 2.2's
``boundary_ratio``, a component's ``config.json``) reads it through :func:`read_pipeline_index`
and the :class:`PipelineIndex` it returns, so that a missing or damaged file is reported once,
the same way, naming the file and the fix. Nothing else in the package opens ``model_index.json``
(``tests/unit/config/test_pipeline_index.py`` holds that).

This is the bottom layer (``zeropipe.config``) so that the planner, the diffusion code, the
families, the exporters and the converters can all import it. ``families.diffusion.pipelines.PipelineFolder``
(what an architecture's parts load components through) carries one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from zeropipe.errors import ConfigError

INDEX_FILE = "model_index.json"
# A modular pipeline's index (diffusers' ModularPipeline.save_pretrained): each component is [library, class, loading spec]
# ({"subfolder", "pretrained_model_name_or_path", "type_hint", ...}); a component the pipeline expects but was not saved
# with is [null, null, spec]; the blocks' config values (canvas_short_edge...) are plain values; _blocks_class_name names the blocks.
MODULAR_INDEX_FILE = "modular_model_index.json"
SCHEDULER_CONFIG_FILE = "scheduler_config.json"  # what diffusers saves a scheduler's config as (SchedulerMixin.config_name)


def is_pipeline_folder(path: str | Path) -> bool:
    """Whether a folder is a diffusers pipeline (it has a model_index.json, or a modular pipeline's modular_model_index.json); nothing is read."""
    folder = Path(path).expanduser()
    return (folder / INDEX_FILE).is_file() or (folder / MODULAR_INDEX_FILE).is_file()


@dataclass(frozen=True)
class PipelineIndex:
    """A diffusers pipeline folder and its ``model_index.json``, read and checked once.

    Attributes:
        path: the folder (``~`` expanded).
        index: ``model_index.json`` as read, read-only: ``{"_class_name": ..., "unet": ["diffusers", "UNet2DConditionModel"], ...}``.
        key: the config key the folder came from (``model.path``), named by the errors of later reads.
    """

    path: Path
    index: Mapping[str, Any]
    key: str | None = "model.path"
    modular: bool = False  # read from modular_model_index.json (a ModularPipeline's folder)

    @property
    def index_file(self) -> Path:
        return self.path / (MODULAR_INDEX_FILE if self.modular else INDEX_FILE)

    @property
    def class_name(self) -> str | None:
        """The pipeline class (``_class_name``: ``StableDiffusionXLPipeline``), None when the file does not say."""
        name = self.index.get("_class_name")
        return name if isinstance(name, str) else None

    def component(self, name: str) -> tuple[str | None, str | None]:
        """(library, class) of a component (``("diffusers", "AutoencoderKL")``); (None, None) when the index has none by that name."""
        value = self.index.get(name)
        if isinstance(value, list) and len(value) == 2:
            return value[0], value[1]
        if self.modular and isinstance(value, list) and len(value) == 3:
            return value[0], value[1]  # [null, null, spec]: expected by the blocks, not saved with the folder
        return None, None

    def component_folder(self, name: str) -> Path:
        """Where a component's files are: its own subfolder (a modular index's loading spec names it; a modular folder copied
        from the Hub names the repo it came from, whose files diffusers also reads from the local copy when they are there).

        Raises:
            ConfigError: a modular index points the component at files outside the folder that are not in it.
        """
        value = self.index.get(name)
        if not (self.modular and isinstance(value, list) and len(value) == 3 and isinstance(value[2], dict)):
            return self.path / name
        folder = self.path / (value[2].get("subfolder") or "")
        if folder == self.path or not folder.is_dir():
            raise ConfigError([(self.key, f"{self.index_file} loads {name} from {value[2].get('pretrained_model_name_or_path')!r} "
                                          f"(subfolder {value[2].get('subfolder')!r}), which is not inside {self.path}: download the whole repository into the folder")])
        return folder

    def required_component(self, name: str) -> tuple[str, str]:
        """(library, class) of a component the caller needs.

        Raises:
            ConfigError: the index names no such component; the message names the file and the fix.
        """
        if not self.has_component(name):
            raise ConfigError([(self.key, f"{self.index_file} names no {name} component, which this {self.class_name or 'pipeline'} needs: download or copy the whole pipeline folder")])
        return self.component(name)  # type: ignore[return-value]

    def has_component(self, name: str) -> bool:
        """Whether the index names a component (a library and a class, not the ``[null, null]`` of an optional one left out)."""
        library, cls = self.component(name)
        return library is not None and cls is not None

    def components(self) -> dict[str, tuple[str, str]]:
        """Every component the index names, {name: (library, class)}, in the file's order."""
        return {name: self.component(name) for name in self.index if not name.startswith("_") and self.has_component(name)}  # type: ignore[misc]

    @property
    def blocks_class_name(self) -> str | None:
        """A modular pipeline's blocks class (``_blocks_class_name``: ``MiniMaxH3Blocks``); None for a DiffusionPipeline's folder."""
        name = self.index.get("_blocks_class_name") if self.modular else None
        return name if isinstance(name, str) else None

    def setting(self, name: str, default: Any = None) -> Any:
        """One of the pipeline's own settings saved in the index (``boundary_ratio``, ``is_distilled``): values that are not components."""
        value = self.index.get(name, default)
        return default if isinstance(value, list) else value

    def settings(self, names: Any) -> dict[str, Any]:
        """The pipeline's settings among ``names`` that the index holds, as ``from_pretrained`` passes them to the pipeline's constructor."""
        return {name: self.index[name] for name in names if name in self.index and not isinstance(self.index[name], list)}

    def component_config(self, name: str, file: str = "config.json") -> dict[str, Any]:
        """A component's config (``vae/config.json``; a scheduler's is ``scheduler_config.json``: see :meth:`scheduler_config`).

        Raises:
            ConfigError: the file is missing or is not a JSON object; the message names it and the fix.
        """
        return _read_json_object(self.component_folder(name) / file, self.key, what=f"the pipeline's {name} config")

    def has_component_config(self, name: str, file: str = "config.json") -> bool:
        """Whether a component's folder holds its config file (tokenizers and schedulers have none by that name)."""
        try:
            return (self.component_folder(name) / file).is_file()
        except ConfigError:
            return False

    def scheduler_config(self) -> dict[str, Any]:
        """``scheduler/scheduler_config.json``."""
        return self.component_config("scheduler", SCHEDULER_CONFIG_FILE)

    def has_scheduler_config(self) -> bool:
        """Whether ``scheduler/scheduler_config.json`` is there."""
        return self.has_component_config("scheduler", SCHEDULER_CONFIG_FILE)


def read_pipeline_index(path: str | Path, key: str | None = "model.path") -> PipelineIndex:
    """Read and check a diffusers pipeline folder's ``model_index.json``.

    Args:
        path: the pipeline folder (``~`` is expanded).
        key: the config key that named the folder, for the error (None where it came from elsewhere: ``--model PATH``).

    A folder without ``model_index.json`` that holds a ``modular_model_index.json`` is a modular pipeline's
    (MiniMax-H3, FLUX.3: diffusers ships them only as ``ModularPipeline``): its index is read the same way and
    the returned ``PipelineIndex`` says ``modular``.

    Raises:
        ConfigError: the folder has no model_index.json, or it is not a JSON object; the message names the file and the fix.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError([(key, f"{folder} is not a folder: point it at a diffusers pipeline folder (one with a {INDEX_FILE})")])
    modular = not (folder / INDEX_FILE).is_file() and (folder / MODULAR_INDEX_FILE).is_file()
    file = folder / (MODULAR_INDEX_FILE if modular else INDEX_FILE)
    try:
        stat = file.stat()
        seen = (str(file.resolve()), stat.st_mtime_ns, stat.st_size, stat.st_ino)
    except OSError:
        seen = None  # missing or unreadable: _read_json_object names it
    index = _PARSED.get(seen) if seen is not None else None
    if index is None:
        index = MappingProxyType(_read_json_object(file, key, what="a diffusers modular pipeline's index" if modular else "a diffusers pipeline's index"))
        if seen is not None:
            _PARSED[seen] = index
    return PipelineIndex(folder, index, key, modular)


# Each model_index.json parsed once per process (a command, the node's setup, a rank), by its path and what
# stat says of it: the family's detection, the model spec, the entry's choice, the data step, the pipeline's
# components all ask for the same folder. A file rewritten since (a run's tiny pipeline saved again) is parsed again.
_PARSED: dict[tuple[str, int, int, int], Mapping[str, Any]] = {}


def _read_json_object(file: Path, key: str | None, what: str) -> dict[str, Any]:
    if not file.is_file():
        fix = (
            "point it at a diffusers pipeline folder (saved by save_pretrained or downloaded whole from the Hub), which has one"
            if file.name == INDEX_FILE
            else "the folder is incomplete: download or copy the pipeline again"
        )
        raise ConfigError([(key, f"{file} is missing ({what}): {fix}")])
    try:
        value = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError([(key, f"{file} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}): fix or replace the file ({what})")]) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError([(key, f"{file} cannot be read ({err}): check its permissions, or copy the pipeline again")]) from None
    if not isinstance(value, dict):
        raise ConfigError([(key, f"{file} holds a JSON {type(value).__name__}, not an object ({what}): fix or replace the file")])
    return value


__all__ = ["INDEX_FILE", "MODULAR_INDEX_FILE", "PipelineIndex", "is_pipeline_folder", "read_pipeline_index"]
