"""The first frame's image embeddings: image-to-video pipelines that also embed the first frame with an image encoder (Wan 2.1 I2V's CLIP).

Active where the pipeline folder has the image encoder and its processor (Wan 2.2 I2V has
none). The embeddings are computed by the pipeline's own ``encode_image`` while caching, cached
with the clip's latents (so the cache key holds the encoder's fingerprint), and reach ``predict``
as ``condition["image_embeds"]``; the sampling pipeline gets the encoder and embeds its first frame itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zeropipe.data.images import first_frame_image
from zeropipe.families.diffusion.parts.base import Condition, Encoding, Inputs, Planning, Sampling
from zeropipe.errors import ConfigError


@dataclass(frozen=True)
class FirstFrameEmbeddings(Condition):
    """Attributes: components: (image encoder, its processor), as the pipeline names them."""

    components: tuple[str, str] = ("image_encoder", "image_processor")

    entry = "image_embeds"
    key_suffix = "-image-embeds"

    def active(self, folder) -> bool:
        return all(folder.has(name) for name in self.components)

    def attach(self, planning: Planning) -> None:
        if not planning.config.data.cache.latents:
            raise ConfigError([("data.cache.latents", f"this {planning.arch.record.name} pipeline's first-frame image embeddings ({self.components[0]}) come from the latent cache: set data.cache.latents: true")])

    def fingerprints(self, planning: Planning) -> tuple[str, ...]:
        return tuple(planning.folder.fingerprint(name) for name in self.components)

    def loaded(self, folder, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        """The image encoder and its processor, as pipeline components."""
        encoder, processor = self.components
        return {encoder: folder.component(encoder, dtype, device), processor: folder.processor(processor)}

    def encoder(self, folder, dtype, device):
        """The pipeline holding only the image encoder: its ``encode_image`` is the reference."""
        return folder.pipeline(self.loaded(folder, dtype, device))

    def embed(self, pipeline, images: list, device: torch.device) -> torch.Tensor:
        """Image embeddings of first frames (PIL images), by the pipeline's own image encoding."""
        return pipeline.encode_image(images, device)

    def encode(self, encoding: Encoding) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(self.embed(encoding.encoder, [first_frame_image(p) for p in encoding.pixels], encoding.device).float().cpu())

    def inputs(self, values: list[torch.Tensor], batch: Inputs) -> dict[str, torch.Tensor]:
        return {"image_embeds": torch.stack(values).to(batch.device, batch.dtype)}

    def sample_components(self, sampling: Sampling) -> dict[str, Any]:
        return self.loaded(sampling.folder, torch.float32, sampling.device)
