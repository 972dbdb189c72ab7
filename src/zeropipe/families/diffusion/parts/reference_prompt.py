"""The prompt part of an entry whose text encoder sees all of a target's reference images (Qwen-Image-Edit-Plus gives them to Qwen2.5-VL).

As :class:`PromptWithControlImage`, but the text cache holds one entry per (caption, every
reference image, bucket): a changed reference re-encodes that target's captions only. Encoding
goes through the entry's ``encode_prompts_with_images`` with, per prompt, the list of its
references (taken at the target's bucket and crop, unflipped; the entry resizes them as its
pipeline does).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeropipe.families.diffusion import cache
from zeropipe.data.images import first_frame_image, load_image_for_bucket
from zeropipe.families.diffusion.parts.base import Planning
from zeropipe.families.diffusion.parts.control_image import sample_control_item
from zeropipe.families.diffusion.parts.control_prompt import PromptWithControlImage
from zeropipe.families.diffusion.parts.text import TEXT_BATCH


def references_text_key(text: str, text_fingerprint: str, references: list[str], bucket: tuple[int, ...]) -> str:
    """The key of a caption's conditioning computed with these reference images, in this order, at a bucket."""
    return cache._digest("text", text, text_fingerprint, "references", *[cache.file_identity(Path(path)) for path in references], list(bucket))


@dataclass(frozen=True)
class PromptWithReferenceImages(PromptWithControlImage):
    """A prompt encoded with its item's reference images (the items carry ``references``: the reference images part attaches them)."""

    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        """Per item and per sample prompt, the keys of (caption, its references) and ("", its references); the pairs to encode."""
        items, images = planning.items, planning.config.data.images
        text_fp = self.fingerprint(planning)
        item_text_keys, sample_text_keys, texts = [], [], []
        sample_bucket = (images.resolution, images.resolution)
        for index, (item, bucket) in enumerate(zip(items, planning.buckets)):
            item_text_keys.append([references_text_key(text, text_fp, item["references"], bucket) for text in (item["caption"], "")])
            texts += [[key, text, index, list(bucket)] for key, text in zip(item_text_keys[-1], (item["caption"], ""))]
        for number, prompt in enumerate(planning.prompts):
            index = sample_control_item(items, prompt, number)
            sample_text_keys.append([references_text_key(text, text_fp, items[index]["references"], sample_bucket) for text in (prompt, "")])
            texts += [[key, text, index, list(sample_bucket)] for key, text in zip(sample_text_keys[-1], (prompt, ""))]
        texts = list({entry[0]: entry for entry in texts}.values())
        missing = [entry for entry in texts if not cache.has_entry(planning.cache_dir, "text", entry[0])]
        planning.notes.append(f"text cache: {len(texts) - len(missing)} of {len(texts)} (caption, reference images) pair(s) cached already, {len(missing)} to encode")
        return {"text_keys": {}, "missing_texts": [], "item_text_keys": item_text_keys, "sample_text_keys": sample_text_keys, "missing_control_texts": missing}

    def fill_cache(self, plan, arch, encoders, device, cache_dir):
        """Each caption encoded with all its item's references, at the bucket it trains (or samples) at."""
        if not plan.missing_control_texts:
            return 0
        pipeline = encoders()
        for start in range(0, len(plan.missing_control_texts), TEXT_BATCH):
            entries = plan.missing_control_texts[start : start + TEXT_BATCH]
            references = [
                [first_frame_image(load_image_for_bucket(Path(path), tuple(bucket), crop="center", flip=False).pixels) for path in plan.items[index]["references"]]
                for _, _, index, bucket in entries
            ]
            for (key, _, _, _), tensors in zip(entries, self.encode(arch, pipeline, [text for _, text, _, _ in entries], device, images=references)):
                cache.save_entry(cache_dir, "text", key, tensors)
        return len(plan.missing_control_texts)
