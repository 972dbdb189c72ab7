"""The reference images condition: multi-reference edit training (Qwen-Image-Edit-Plus, FLUX.2 with reference images).

Every target image has the same number of reference images (one or more), found in one of the
layouts the peers use:

- ``data.control_paths``: one folder per reference (diffusion-pipe's ``control_paths``, its PR
  #529), each holding an image with the target's file name (any image type), at the same
  relative path or at the folder's top, as ``data.control_path`` is matched;
- ``data.control_path``: one folder, musubi-tuner's ``control_directory``: ``NAME.*`` (if any),
  then ``NAME_0.*``, ``NAME_1.*``, ... in that order;
- ``data.path/metadata.jsonl`` records with ``control_path`` / ``control_path_0``,
  ``control_path_1``, ... keys (musubi-tuner's JSONL datasets), relative to the data folder or
  absolute; they take precedence over the folders for the targets they list.

Each reference is taken at its target's bucket, crop and flip (as diffusion-pipe resizes its
control images to the target's bucket), its VAE latents (the distribution's mean, as the
pipelines encode their ``image``) cached with the target's under one key that names every
reference file: changing one reference re-encodes that target only. They reach ``predict`` as
``condition["reference_latents"]``, (batch, references, ...) each normalised as the target's.
Samples call the pipeline once per prompt with the data item's references as its ``image`` list.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.confine import OUTSIDE_REASON, require_usable, usable
from zeropipe.families.diffusion import cache
from zeropipe.data.images import IMAGE_SUFFIXES, first_frame_image, load_image_for_bucket, match_control_images
from zeropipe.families.diffusion.parts.base import Condition, Encoding, Inputs, Planning, SampleInputs, Sampling
from zeropipe.families.diffusion.parts.control_image import sample_control_item
from zeropipe.errors import DataError

BAD_SHOWN = 3
METADATA_FILE = "metadata.jsonl"
# musubi-tuner's JSONL keys: control_path is the first reference, control_path_0, control_path_1, ... the rest in order.
METADATA_KEY = re.compile(r"^control_path(?:_(\d+))?$")
# musubi-tuner's control_directory: NAME_0, NAME_1, ... after NAME itself.
NUMBERED_STEM = re.compile(r"^(.+)_(\d+)$")


def metadata_references(data_root: Path) -> dict[Path, list[str]]:
    """Per target listed in ``data_root/metadata.jsonl`` with control_path keys, its reference paths as written (musubi-tuner's order)."""
    metadata = Path(data_root) / METADATA_FILE
    found: dict[Path, list[str]] = {}
    if not metadata.is_file() or not usable(metadata):
        return found
    for line in metadata.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the image scan reports the line
        if not isinstance(record, dict) or not isinstance(record.get("file_name"), str):
            continue
        keyed = []
        for key, value in record.items():
            match = METADATA_KEY.match(key)
            if match and isinstance(value, str):
                keyed.append((-1 if match.group(1) is None else int(match.group(1)), value))
        if keyed:
            found[(Path(data_root) / record["file_name"]).resolve()] = [value for _, value in sorted(keyed)]
    return found


def _suffixed_references(targets: list[Path], data_root: Path, control_root: Path) -> tuple[list[list[Path]], list[str]]:
    """musubi-tuner's control_directory: per target, NAME.* then NAME_0.*, NAME_1.*, ... at its relative path, else at the folder's top."""
    require_usable(control_root, "data.control_path")
    control_root = Path(control_root).expanduser().resolve()
    if not control_root.is_dir():
        raise DataError(f"data.control_path {control_root} is not a folder: point it at the folder of reference images (NAME_0.png, NAME_1.png, ... per target NAME.png)")
    by_stem: dict[Path, list[Path]] = {}
    for path in sorted(control_root.rglob("*")):
        if path.suffix.lower() in IMAGE_SUFFIXES and not any(part.startswith(".") for part in path.relative_to(control_root).parts):
            by_stem.setdefault(path.relative_to(control_root).with_suffix(""), []).append(path)
    # NAME_<n> stems by NAME, indexed once (a dataset has thousands of targets).
    numbered: dict[Path, list[tuple[int, Path]]] = {}
    for stem in by_stem:
        match = NUMBERED_STEM.match(stem.name)
        if match:
            numbered.setdefault(stem.with_name(match.group(1)), []).append((int(match.group(2)), stem))
    found, problems = [], []
    for target in targets:
        relative = Path(target).resolve().relative_to(Path(data_root).resolve()).with_suffix("")
        references: list[Path] = []
        for base in (relative, Path(relative.name)):
            stems = ([base] if base in by_stem else []) + [stem for _, stem in sorted(numbered.get(base, []))]
            if stems:
                for stem in stems:
                    if len(by_stem[stem]) > 1:
                        problems.append(f"{target}: several reference images have the name {stem.name} ({', '.join(p.name for p in by_stem[stem])}): keep one")
                    references.append(by_stem[stem][0])
                break
        if not references:
            problems.append(f"{target}: no reference image {control_root / relative}_0.* (or {control_root / relative.name}_0.*, or NAME.* itself)")
        found.append(references)
    return found, problems


def find_reference_images(targets: list[Path], data_root: Path, control_path: str | None, control_paths: list[str] | None) -> tuple[list[list[Path]], list[str]]:
    """Each target's reference images, in order, and one line per target they cannot be found or used for (naming the file and why).

    Raises:
        DataError: a named folder is not a folder.
    """
    listed = metadata_references(data_root)
    rest = [target for target in targets if Path(target).resolve() not in listed]
    problems: list[str] = []
    if control_paths:
        columns = []
        for number, folder in enumerate(control_paths):
            column, missing = match_control_images(rest, data_root, Path(folder))
            columns.append(column)
            problems += [f"reference {number + 1}: {problem}" for problem in missing]
        from_folders = [[column[row] for column in columns if column[row] is not None] for row in range(len(rest))]
    elif control_path:
        from_folders, problems = _suffixed_references(rest, data_root, Path(control_path))
    else:
        from_folders = [[] for _ in rest]
    # match_control_images decoded what it found already; the rest (musubi's layout, metadata paths) is decoded below, once.
    checked = {path for references in from_folders for path in references} if control_paths else set()
    by_target = dict(zip(rest, from_folders))
    found = [
        [Path(value) if Path(value).is_absolute() else Path(data_root) / value for value in listed[Path(target).resolve()]] if target not in by_target else by_target[target]
        for target in targets
    ]
    for row, (target, references) in enumerate(zip(targets, found)):
        usable_ones = []
        for reference in references:
            if not reference.is_file():
                problems.append(f"{target}: its reference image {reference} does not exist")
            elif not usable(reference):
                problems.append(f"{target}: its reference image {reference} {OUTSIDE_REASON}")
            else:
                reason = None if reference in checked else _unreadable(reference)
                if reason:
                    problems.append(f"{target}: its reference image {reference} cannot be used ({reason})")
                else:
                    usable_ones.append(reference.resolve())
        found[row] = usable_ones if len(usable_ones) == len(references) else []
    return found, problems


def _unreadable(path: Path) -> str | None:
    """Why an image cannot be decoded, or None."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.load()
    except Exception as error:  # Pillow raises many kinds for a corrupt file; each means the same here
        return f"not a readable image: {error}"
    return None


def attach_reference_images(config: Any, arch: Any, image_dir: Path, items: list[dict[str, Any]], notes: list[str]) -> None:
    """Give each item its reference images (``item["references"]``), or refuse the data naming every target that lacks one or has a broken one.

    Raises:
        DataError: targets without usable reference images, or with another number of them than the rest.
    """
    data = config.data
    found, problems = find_reference_images([Path(item["path"]) for item in items], image_dir, data.control_path, data.control_paths)
    where = ", ".join(str(Path(p).expanduser()) for p in (data.control_paths or [data.control_path or image_dir / METADATA_FILE]))
    if not problems:
        counts = sorted({len(references) for references in found})
        if counts and counts[0] == 0:
            problems = [f"{item['path']}: no reference image" for item, references in zip(items, found) if not references]
        elif len(counts) > 1:
            common = max(counts, key=lambda count: sum(len(references) == count for references in found))
            problems = [f"{item['path']}: {len(references)} reference image(s), the others {common}" for item, references in zip(items, found) if len(references) != common]
    if problems:
        shown = "; ".join(problems[:BAD_SHOWN])
        raise DataError(
            f"{len(problems)} problem(s) with the reference images of {len(items)} target image(s) in {where} ({shown}{' ...' if len(problems) > BAD_SHOWN else ''}): "
            "give every target the same number of readable reference images, or remove those targets from data.path"
        )
    for item, references in zip(items, found):
        item["references"] = [str(reference) for reference in references]
    count = len(found[0]) if found else 0
    notes.append(f"multi-reference edit training: {len(items)} target image(s), each with {count} reference image(s) from {where}")


@dataclass(frozen=True)
class ReferenceImages(Condition):
    """Several reference images per target, their latents appended to the denoiser's input by the entry's ``predict``.

    Attributes:
        required: the entry trains only with references (Qwen-Image-Edit-Plus); else (FLUX.2) they are
            used where the settings name them and the entry trains text-to-image otherwise.
        min_size: the smallest side the pipeline takes a reference image at (FLUX.2's image processor
            refuses images under 64 px), which the sample size must reach.
    """

    required: bool = True
    min_size: int = 0
    entry = "references"
    key_suffix = "-references"

    def config_keys(self):
        return ("data.control_path", "data.control_paths")

    def wanted(self, config):
        data = config.data
        return self.required or bool(data.control_path or data.control_paths) or (bool(data.path) and bool(metadata_references(Path(data.path).expanduser())))

    def problems(self, config, arch):
        data = config.data
        problems = []
        if data.control_path and data.control_paths:
            problems.append(("data.control_paths", "set either data.control_path (one folder: NAME_0.png, NAME_1.png, ...) or data.control_paths (a folder per reference), not both"))
        if not self.wanted(config):
            return problems
        named = data.control_path or data.control_paths or (data.path and (Path(data.path).expanduser() / METADATA_FILE).is_file())
        if not named or data.synthetic is not None:
            problems.append((
                "data.control_paths",
                f"a {arch.record.name} model learns to edit reference images into a target: set data.path and data.control_paths (a folder per reference image, "
                "same file names as the targets) or data.control_path (one folder: NAME_0.png, NAME_1.png, ... per target NAME.png)",
            ))
        for key, folder in [("data.control_path", data.control_path)] + [(f"data.control_paths[{number}]", path) for number, path in enumerate(data.control_paths or [])]:
            if folder and not Path(folder).expanduser().is_dir():
                problems.append((key, f"{folder} is not a folder: point it at a folder of reference images (same file names as the targets)"))
        if data.images.resolution < self.min_size:
            problems.append(("data.images.resolution", f"the {arch.record.name} pipeline takes reference images of {self.min_size} px or more (samples give it the references at data.images.resolution, {data.images.resolution}): set it to {self.min_size} or more"))
        if not (data.cache.latents and data.cache.text):
            problems.append(("data.cache", "multi-reference edit training reads the reference images' latents from the cache: set data.cache.latents and data.cache.text to true"))
        return problems

    def attach(self, planning: Planning) -> None:
        attach_reference_images(planning.config, planning.arch, planning.image_dir, planning.items, planning.notes)

    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        return {"sample_controls": [sample_control_item(planning.items, prompt, number) for number, prompt in enumerate(planning.prompts)]}

    def key_files(self, item):
        # Every reference is part of the target's key: a changed second reference re-encodes this target only.
        return tuple((f"reference{number}", Path(path)) for number, path in enumerate(item["references"]))

    def load(self, plan, index, bucket, flip):
        # At the target's bucket, crop and flip: each reference's token grid is the target's.
        return torch.stack([load_image_for_bucket(Path(path), tuple(bucket), crop="center", flip=flip).pixels for path in plan.items[index]["references"]])

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        # All the chunk's references in one VAE call; per item its (references, channels, ...) means, as the pipelines encode their images.
        counts = [len(references) for references in encoding.loaded]
        means = cache.encode_latent_distribution(encoding.vae, encoding.codec.vae_pixels(torch.cat(encoding.loaded)))[0]
        return [chunk.contiguous() for chunk in means.split(counts)]

    def inputs(self, values: list[torch.Tensor], batch: Inputs) -> dict[str, torch.Tensor]:
        stacked = torch.stack(values).to(batch.device)
        normalized = batch.normalize(stacked.flatten(0, 1))
        return {"reference_latents": normalized.unflatten(0, stacked.shape[:2])}

    def sample_components(self, sampling: Sampling) -> dict[str, Any]:
        return {"vae": sampling.vae()}  # the pipeline encodes the reference images

    def sample_inputs(self, sampling: Sampling, kwargs: dict[str, Any]) -> SampleInputs:
        per_prompt, rows = [], []
        for index in sampling.plan.sample_controls:
            paths = sampling.plan.items[index]["references"]
            images = [first_frame_image(load_image_for_bucket(Path(path), (sampling.size, sampling.size), crop="center", flip=False).pixels) for path in paths]
            per_prompt.append({"image": images})
            rows.append({"references": list(paths)})
        # One call per prompt: each prompt edits its own item's references.
        return SampleInputs(per_prompt=per_prompt, rows=rows)
