"""The control image condition: edit training (Qwen-Image-Edit, Flux Kontext).

Every target image has a control image (``data.control_path``, matched by file name), taken at
the target's bucket, crop and flip, whose VAE latents (the distribution's mean, as the pipeline
encodes its ``image``) are cached with the target's and reach ``predict`` as
``condition["control_latents"]``, normalised as the target's. Samples edit a data control image
(centre-cropped to the sample size): the pipeline is called once per prompt with it as ``image``
(the entry's ``call_pipeline`` says how).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.data.images import first_frame_image, load_image_for_bucket, match_control_images
from zeropipe.families.diffusion.parts.base import Condition, Encoding, Inputs, Planning, SampleInputs, Sampling
from zeropipe.errors import ConfigError, DataError

BAD_SHOWN = 3


def sample_control_item(items: list[dict[str, Any]], prompt: str, number: int) -> int:
    """The item whose control image a sample prompt edits: the first with that caption, else the items in turn."""
    return next((index for index, item in enumerate(items) if item["caption"] == prompt), number % len(items))


def attach_control_images(config: Any, arch: Any, image_dir: Path, items: list[dict[str, Any]], notes: list[str]) -> None:
    """Give each item its control image (``item["control"]``), or refuse the run with every target that has none.

    Raises:
        ConfigError: no control folder (or synthetic data) for an edit model.
        DataError: targets without a usable control image.
    """
    control_path = config.data.control_path
    if control_path is None or config.data.synthetic is not None:
        raise ConfigError([("data.control_path", f"a {arch.record.name} model learns to edit a control image into its target: set data.control_path to a folder with a control image per image of data.path (same file names)")])
    controls, problems = match_control_images([Path(item["path"]) for item in items], image_dir, Path(control_path))
    if problems:
        shown = "; ".join(problems[:BAD_SHOWN])
        raise DataError(
            f"{len(problems)} of {len(items)} target image(s) have no usable control image in {Path(control_path).expanduser()} ({shown}{' ...' if len(problems) > BAD_SHOWN else ''}): "
            "add a control image with the target's file name for each, or remove those targets from data.path"
        )
    for item, control in zip(items, controls):
        item["control"] = str(control)
    notes.append(f"edit training: {len(items)} target image(s), each with its control image from {Path(control_path).expanduser()}")


@dataclass(frozen=True)
class ControlImage(Condition):
    """A control image per target, its latents appended to the denoiser's input by the entry's ``predict``."""

    entry = "control"
    key_suffix = "-control"

    def config_keys(self):
        return ("data.control_path",)

    def problems(self, config, arch):
        data = config.data
        problems = []
        if not data.control_path or data.synthetic is not None:
            problems.append(("data.control_path", f"a {arch.record.name} model learns to edit a control image into its target: set data.path and data.control_path, a folder with a control image per target image (same file names)"))
        elif not Path(data.control_path).expanduser().is_dir():
            problems.append(("data.control_path", f"{data.control_path} is not a folder: point it at the folder of control images (one per target image, same file name)"))
        if not (data.cache.latents and data.cache.text):
            problems.append(("data.cache", "edit training reads the control images' latents (and their text conditioning) from the caches: set data.cache.latents and data.cache.text to true"))
        return problems

    def attach(self, planning: Planning) -> None:
        attach_control_images(planning.config, planning.arch, planning.image_dir, planning.items, planning.notes)

    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        return {"sample_controls": [sample_control_item(planning.items, prompt, number) for number, prompt in enumerate(planning.prompts)]}

    def key_files(self, item):
        return (("control", Path(item["control"])),)

    def load(self, plan, index, bucket, flip):
        # At the target's bucket, crop and flip: the two token grids match.
        return load_image_for_bucket(Path(plan.items[index]["control"]), tuple(bucket), crop="center", flip=flip).pixels

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        # The control image's latents, as the pipeline encodes its image (the mode, the mean).
        return list(encoding.codec.encode(encoding.vae, encoding.codec.vae_pixels(torch.stack(encoding.loaded)))[0])

    def inputs(self, values: list[torch.Tensor], batch: Inputs) -> dict[str, torch.Tensor]:
        return {"control_latents": batch.normalize(torch.stack(values).to(batch.device))}

    def sample_components(self, sampling: Sampling) -> dict[str, Any]:
        return {"vae": sampling.vae()}  # the pipeline encodes the control image

    def sample_inputs(self, sampling: Sampling, kwargs: dict[str, Any]) -> SampleInputs:
        controls = []
        for index in sampling.plan.sample_controls:
            path = sampling.plan.items[index]["control"]
            controls.append((first_frame_image(load_image_for_bucket(Path(path), (sampling.size, sampling.size), crop="center", flip=False).pixels), path))
        # One call per prompt: the pipeline takes one control image per call.
        return SampleInputs(per_prompt=[{"image": image} for image, _ in controls], rows=[{"control": path} for _, path in controls])
