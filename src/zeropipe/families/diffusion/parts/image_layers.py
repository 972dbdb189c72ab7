"""The image layers condition: layer decomposition training (Qwen-Image-Layered), an image and the RGBA layers it is made of.

Every target image (the composite, ``data.path``) has the same number of RGBA layers, found as reference images
are (``reference_images.py``): ``data.control_paths``, one folder per layer in stacking order (bottom first), each
holding a file with the target's name; ``data.control_path``, one folder of ``NAME_0.png``, ``NAME_1.png``, ...; or
``metadata.jsonl`` records with ``control_path_0``, ``control_path_1``, ... keys. Layers keep their alpha channel
(PNG or WebP with transparency); an opaque file is a layer covering the whole canvas.

What ``QwenImageLayeredPipeline`` does with them, and so what the entry is given:

- the composite, as the pipeline takes its ``image`` (RGB made RGBA with an opaque alpha, through the four-channel
  RGBA-VAE, the distribution's mode, normalised per channel), is the condition appended after the noisy tokens
  (``condition["image_latents"]``: (batch, channels, 1, h, w));
- the denoised stack is the composite again (its first frame, the target the codec encodes) then each layer
  (``condition["layer_latents"]``: (batch, layers, channels, 1, h, w), each encoded alone as the pipeline decodes each
  alone); the entry's loss noises them at the composite's noise level.

Both are taken at the target's bucket, centre crop and flip, and cached with the target's latents under one key naming
every layer file. Samples decompose a data item's composite (one call per prompt) and write each drawn layer as an
RGBA PNG beside the sample (``NN_layerK.png``, listed in the sample's index row under ``layers``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.data.images import PreparedImage, decode_image, first_frame_image, fit_to_bucket, load_image_for_bucket
from zeropipe.errors import DataError
from zeropipe.families.diffusion import cache
from zeropipe.families.diffusion.parts.base import Encoding, Inputs, Planning, SampleInputs, Sampling
from zeropipe.families.diffusion.parts.reference_images import METADATA_FILE, ReferenceImages, find_reference_images
from zeropipe.families.diffusion.parts.control_image import sample_control_item

BAD_SHOWN = 3


def load_rgba_for_bucket(path: Path, bucket: tuple[int, int], flip: bool) -> PreparedImage:
    """An RGBA image (4, H, W) in [-1, 1] at a bucket, centre-cropped as ``load_image_for_bucket`` crops; its alpha kept (opaque where it has none).

    Raises:
        DataError: the file cannot be decoded, or lies outside what the run may read.
    """
    image = decode_image(path, lambda opened: opened.convert("RGBA"), "remove or replace the layer file")
    return fit_to_bucket(image, tuple(bucket), crop="center", flip=flip, path=path)


def opaque(pixels: torch.Tensor) -> torch.Tensor:
    """(3, H, W) -> (4, H, W) with alpha 1, as the pipeline's ``convert("RGBA")`` of an RGB image."""
    return torch.cat([pixels, pixels.new_ones(1, *pixels.shape[1:])])


@dataclass(frozen=True)
class ImageLayers(ReferenceImages):
    """An image's RGBA layers: the composite as the denoiser's condition and the layers as what it denoises besides the composite."""

    entry = "layers"
    key_suffix = "-layers"

    def problems(self, config, arch):
        data = config.data
        problems = []
        if data.control_path and data.control_paths:
            problems.append(("data.control_paths", "set either data.control_path (one folder: NAME_0.png, NAME_1.png, ...) or data.control_paths (a folder per layer), not both"))
        named = data.control_path or data.control_paths or (data.path and (Path(data.path).expanduser() / METADATA_FILE).is_file())
        if not named or data.synthetic is not None:
            problems.append((
                "data.control_paths",
                f"a {arch.record.name} model learns to split an image into its RGBA layers: set data.path (the composed images) and data.control_paths "
                "(a folder per layer, bottom layer first, files named as the images) or data.control_path (one folder: NAME_0.png, NAME_1.png, ... per image NAME.png)",
            ))
        for key, folder in [("data.control_path", data.control_path)] + [(f"data.control_paths[{number}]", path) for number, path in enumerate(data.control_paths or [])]:
            if folder and not Path(folder).expanduser().is_dir():
                problems.append((key, f"{folder} is not a folder: point it at a folder of RGBA layer images (same file names as the composed images)"))
        if not (data.cache.latents and data.cache.text):
            problems.append(("data.cache", "layer decomposition training reads the layers' latents from the cache: set data.cache.latents and data.cache.text to true"))
        return problems

    def attach(self, planning: Planning) -> None:
        config, items = planning.config, planning.items
        data = config.data
        found, problems = find_reference_images([Path(item["path"]) for item in items], planning.image_dir, data.control_path, data.control_paths)
        # Told in the layers' words: "reference 2: ... no control image" is layer 1's file missing.
        problems = [
            re.sub(r"^reference (\d+): ", lambda match: f"layer {int(match.group(1)) - 1}: ", problem).replace("no control image", "no layer file").replace("reference image", "layer")
            for problem in problems
        ]
        counts = sorted({len(layers) for layers in found})
        if not problems and counts and counts[0] == 0:
            problems = [f"{item['path']}: no layer image" for item, layers in zip(items, found) if not layers]
        elif not problems and len(counts) > 1:
            common = max(counts, key=lambda count: sum(len(layers) == count for layers in found))
            problems = [f"{item['path']}: {len(layers)} layer(s), the others {common}" for item, layers in zip(items, found) if len(layers) != common]
        where = ", ".join(str(Path(p).expanduser()) for p in (data.control_paths or [data.control_path or planning.image_dir / METADATA_FILE]))
        if problems:
            shown = "; ".join(problems[:BAD_SHOWN])
            raise DataError(
                f"{len(problems)} problem(s) with the layers of {len(items)} image(s) in {where} ({shown}{' ...' if len(problems) > BAD_SHOWN else ''}): "
                "give every image the same number of readable layer files, or remove those images from data.path"
            )
        for item, layers in zip(items, found):
            item["layers"] = [str(layer) for layer in layers]
        planning.notes.append(f"layer decomposition training: {len(items)} image(s), each split into {len(found[0]) if found else 0} RGBA layer(s) from {where}")

    def key_files(self, item):
        # Every layer is part of the image's key: a changed layer re-encodes this image only.
        return tuple((f"layer{number}", Path(path)) for number, path in enumerate(item["layers"]))

    def load(self, plan, index, bucket, flip):
        item = plan.items[index]
        composite = opaque(load_image_for_bucket(Path(item["path"]), tuple(bucket), crop="center", flip=flip).pixels)
        return torch.stack([composite, *(load_rgba_for_bucket(Path(path), tuple(bucket), flip).pixels for path in item["layers"])])

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        # Every image of the chunk alone (one frame each: the pipeline encodes the composite alone and decodes each layer alone).
        counts = [len(images) for images in encoding.loaded]
        means = cache.encode_latent_distribution(encoding.vae, encoding.codec.vae_pixels(torch.cat(encoding.loaded)))[0]
        return [chunk.contiguous() for chunk in means.split(counts)]

    def inputs(self, values: list[torch.Tensor], batch: Inputs) -> dict[str, torch.Tensor]:
        stacked = torch.stack(values).to(batch.device)  # (B, 1 + layers, C, 1, h, w)
        normalized = batch.normalize(stacked.flatten(0, 1)).unflatten(0, stacked.shape[:2])
        return {"image_latents": normalized[:, 0], "layer_latents": normalized[:, 1:]}

    def sample_components(self, sampling: Sampling) -> dict[str, Any]:
        return {"vae": sampling.vae()}  # the composite is encoded and the layers decoded

    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        return {"sample_controls": [sample_control_item(planning.items, prompt, number) for number, prompt in enumerate(planning.prompts)]}

    def sample_inputs(self, sampling: Sampling, kwargs: dict[str, Any]) -> SampleInputs:
        per_prompt, rows = [], []
        for index in sampling.plan.sample_controls:
            item = sampling.plan.items[index]
            composite = opaque(load_image_for_bucket(Path(item["path"]), (sampling.size, sampling.size), crop="center", flip=False).pixels)
            per_prompt.append({"image": first_frame_image(composite), "layers": len(item["layers"])})
            rows.append({"decomposed": item["path"]})
        # One call per prompt: each prompt decomposes its own item's image into as many layers as the data has.
        return SampleInputs(per_prompt=per_prompt, rows=rows)

    def add_to_samples(self, sampling: Sampling, outputs: dict[str, torch.Tensor], written: list[dict[str, Any]], folder: Path) -> None:
        """Each drawn layer (``outputs["layer_latents"]``: (B, C, layers, h, w) as the VAE decodes them) as an RGBA PNG beside its sample."""
        from PIL import Image

        if "layer_latents" not in outputs:
            return
        vae = sampling.vae()
        latents = outputs["layer_latents"].to(sampling.device, torch.float32)
        batch, channels, layers, height, width = latents.shape
        with torch.no_grad():  # each layer alone, as the pipeline decodes them: (B x layers, C, 1, h, w)
            decoded = vae.decode(latents.permute(0, 2, 1, 3, 4).reshape(-1, channels, 1, height, width), return_dict=False)[0][:, :, 0]
        pixels = ((decoded.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).unflatten(0, (batch, layers)).cpu()
        for number, row in enumerate(written):
            names = []
            stem = Path(row["file"]).stem  # the sample's own file (NN.png): its layers are NN_layer0.png, ...
            for layer in range(layers):
                name = f"{stem}_layer{layer}.png"
                Image.fromarray(pixels[number, layer].permute(1, 2, 0).numpy(), mode="RGBA").save(folder / name)
                names.append(f"{folder.name}/{name}")
            row["layers"] = names
