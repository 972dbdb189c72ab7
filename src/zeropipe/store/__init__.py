"""The run store: an embedded SQLite index of run directories, and the actions on runs."""

from zeropipe.config.yaml_text import parse_yaml_text
from zeropipe.store.actions import ActionRefused
from zeropipe.store.index import RunNotFound
from zeropipe.store.presets import PresetNotFound
from zeropipe.store.sandbox import OutsideRoots, Roots
from zeropipe.store.store import RunStore

__all__ = ["ActionRefused", "OutsideRoots", "PresetNotFound", "Roots", "RunNotFound", "RunStore", "parse_yaml_text"]
