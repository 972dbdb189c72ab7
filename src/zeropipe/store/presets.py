"""Configs to start a new run from: the shipped examples, saved presets, and any past run's config.

A preset is YAML text for the New-run page, not a run: it is validated only when checked or
launched. Saved presets live in the store's folder (``RUNS/.zeropipe/presets/NAME.yaml``),
beside the database, so they move with the runs. Loading one gives a config ready to edit:
the run gets a fresh name and no ``output_dir`` (the UI writes runs into its runs folder),
and a past run's fully resolved config loses the keys that only repeat a default.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from zeropipe.config.yaml_text import parse_yaml_text
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.store.sandbox import check_name, confined

MAX_PRESET_BYTES = 200_000


class PresetNotFound(ZeroPipeError):
    """No preset of that kind and name."""


def examples_dirs() -> list[Path]:
    """Where the shipped examples are: a source checkout's examples/ (an installed wheel has none)."""
    import zeropipe

    package = Path(zeropipe.__file__).resolve().parent
    return [folder for folder in (package / "examples", package.parents[1] / "examples") if folder.is_dir()]


def description_of(text: str) -> str:
    """The first lines of an example's opening comment that say what it trains (after the `Run it:` lines)."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line.lstrip("#").strip()
        if not body or body.startswith(("Run it:", "Resume:", "zeropipe ")):
            if lines:
                break
            continue
        lines.append(body)
    return " ".join(lines)[:300]


def without_defaults(raw: Any, defaults: Any) -> Any:
    """``raw`` less the values equal to their default (what a fully resolved config.yaml writes out)."""
    if isinstance(raw, dict) and isinstance(defaults, dict):
        out = {}
        for key, value in raw.items():
            if key in defaults and value == defaults[key]:
                continue
            out[key] = without_defaults(value, defaults[key]) if key in defaults else value
            if out[key] == {} and isinstance(value, dict) and value:
                del out[key]  # a section of nothing but defaults
        return out
    return raw


class Presets:
    def __init__(self, store):
        self.store = store
        self.saved_dir = store.db_path.parent / "presets"

    # ------------------------------------------------------------ listing
    def list(self) -> list[dict[str, Any]]:
        out = []
        for folder in examples_dirs():
            for path in sorted(folder.glob("*.yaml")):
                out.append(
                    {
                        "id": f"example:{path.stem}",
                        "kind": "example",
                        "name": path.stem,
                        "description": description_of(path.read_text(errors="replace")),
                    }
                )
        if self.saved_dir.is_dir():
            for path in sorted(self.saved_dir.glob("*.yaml")):
                if confined(path, self.saved_dir) and not check_name(path.stem):
                    out.append(
                        {
                            "id": f"saved:{path.stem}",
                            "kind": "saved",
                            "name": path.stem,
                            "description": f"saved {time.strftime('%Y-%m-%d %H:%M', time.localtime(path.stat().st_mtime))}",
                        }
                    )
        for run in self.store.runs():
            if run["state"] in ("completed", "failed", "stopped", "lost", "running"):
                steps = f"{run['step']}/{run['total_steps']}" if run.get("total_steps") else f"{run['step']}"
                out.append({"id": f"run:{run['id']}", "kind": "run", "name": run["name"], "description": f"{run['state']}, {steps} steps"})
        return out

    # ------------------------------------------------------------ loading
    def load(self, kind: str, name: str) -> dict[str, Any]:
        """{"yaml": text ready to edit, "name": the run name it proposes}.

        Raises:
            PresetNotFound: no such example, saved preset or run.
        """
        if kind == "example":
            path = next((folder / f"{name}.yaml" for folder in examples_dirs() if not check_name(name) and (folder / f"{name}.yaml").is_file()), None)
            if path is None:
                raise PresetNotFound(
                    f"no example {name!r}: the examples are {', '.join(p['name'] for p in self.list() if p['kind'] == 'example') or 'not shipped with this installation'}"
                )
            return self.ready(path.read_text(errors="replace"), name, keep_comments=True)
        if kind == "saved":
            path = self.saved_path(name)
            if not path.is_file():
                raise PresetNotFound(f"no saved preset {name!r}")
            return self.ready(path.read_text(errors="replace"), name, keep_comments=True)
        if kind == "run":
            try:
                run = self.store.run(name)
            except self.store.RunNotFound:  # the store's own class: presets sit below store.py (no import circle)
                raise PresetNotFound(f"no run {name!r} to start from") from None
            text = self.store.config_text(run)
            if text is None:
                raise PresetNotFound(f"run {run['name']} has no config.yaml yet")
            return self.ready(text, run["name"], keep_comments=False)
        raise PresetNotFound(f"no preset kind {kind!r}: presets are example, saved or run")

    def ready(self, text: str, base_name: str, keep_comments: bool) -> dict[str, Any]:
        from zeropipe.config.schema import RunConfig
        raw = parse_yaml_text(text, source=f"preset {base_name}")
        name = self.free_name(str((raw.get("run") or {}).get("name") or base_name))
        if keep_comments:
            # Keep the example's comments (they explain it): only the run section is rewritten.
            lines = strip_run_section(text).splitlines(keepends=True)
            opening = 0
            while opening < len(lines) and lines[opening].startswith("#"):
                opening += 1
            run = {k: v for k, v in (raw.get("run") or {}).items() if k not in ("output_dir", "name")}
            header = yaml.safe_dump({"run": {"name": name, **run}}, sort_keys=False)
            return {"yaml": "".join(lines[:opening]) + header + "".join(lines[opening:]), "name": name}
        pruned = without_defaults(raw, RunConfig().model_dump(mode="json"))
        pruned.setdefault("run", {})
        pruned["run"] = {"name": name, **{k: v for k, v in pruned["run"].items() if k not in ("output_dir", "name")}}
        ordered = {"run": pruned.pop("run"), **pruned}
        return {"yaml": yaml.safe_dump(ordered, sort_keys=False), "name": name}

    def free_name(self, wanted: str) -> str:
        """``wanted`` if no run has it, else wanted-2, wanted-3, ..."""
        if check_name(wanted):
            wanted = "run"
        taken = {run["name"] for run in self.store.runs()}
        taken |= {p.name for root in self.store.roots.runs if root.is_dir() for p in root.iterdir()}
        stem = wanted
        for suffix in range(2, 10_000):
            if wanted not in taken:
                return wanted
            wanted = f"{stem}-{suffix}"
        return f"{stem}-{int(time.time())}"

    # ------------------------------------------------------------- saving
    def saved_path(self, name: str) -> Path:
        problems = check_name(name, "name")
        if problems:
            raise ConfigError(problems, source="the preset")
        path = self.saved_dir / f"{name}.yaml"
        if confined(path, self.saved_dir) is None:
            raise ConfigError([("name", f"{name!r} leads out of the presets folder")], source="the preset")
        return path

    def save(self, name: str, text: str, overwrite: bool = False) -> dict[str, Any]:
        """Store ``text`` as the preset NAME.

        Raises:
            ConfigError: a bad name, text that is not a YAML mapping, or NAME taken (without overwrite).
        """
        if len(text.encode()) > MAX_PRESET_BYTES:
            raise ConfigError([("yaml", f"a preset holds at most {MAX_PRESET_BYTES // 1000} kB of YAML")], source="the preset")
        parse_yaml_text(text, source="the preset")  # a mapping of sections, not too deep
        path = self.saved_path(name)
        if path.exists() and not overwrite:
            raise ConfigError([("name", f"a preset named {name!r} exists: choose another name, or replace it")], source="the preset")
        self.saved_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".yaml.partial")
        partial.write_text(text)
        partial.replace(path)
        return {"id": f"saved:{name}", "kind": "saved", "name": name}

    def delete(self, name: str) -> None:
        path = self.saved_path(name)
        if not path.is_file():
            raise PresetNotFound(f"no saved preset {name!r}")
        path.unlink()


def strip_run_section(text: str) -> str:
    """The YAML text less its top-level ``run:`` block (the comments above other sections stay)."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        top_level = line[:1] not in (" ", "\t", "\n", "#", "") and not line.startswith("-")
        if top_level:
            skipping = line.split(":", 1)[0].strip() == "run"
        elif skipping and line.startswith("#"):
            skipping = False
        if not skipping:
            out.append(line)
    return "".join(out)
