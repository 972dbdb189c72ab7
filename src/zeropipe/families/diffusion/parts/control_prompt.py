"""The prompt part of an entry whose text encoder also sees the control image (Qwen-Image-Edit gives it to Qwen2.5-VL).

The text conditioning then depends on the image: the text cache holds one entry per (caption,
control image, bucket), the empty caption's too (caption dropout, guidance), and each sample
prompt's with the control image it edits. Encoding goes through the entry's
``encode_prompts_with_images`` (the pipeline's ``encode_prompt`` with ``image=``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.families.diffusion import cache
from zeropipe.data.images import first_frame_image, load_image_for_bucket
from zeropipe.families.diffusion.parts.base import Planning
from zeropipe.families.diffusion.parts.control_image import sample_control_item
from zeropipe.families.diffusion.parts.text import TEXT_BATCH, PromptText, prompt_rows


@dataclass(frozen=True)
class PromptWithControlImage(PromptText):
    """A prompt encoded with its item's control image (the items carry ``control``: the control image part attaches it)."""

    def problems(self, config, arch):
        if config.data.images.flip > 0:
            return [("data.images.flip", f"the {arch.record.name} text encoder sees the control image unflipped, so a flipped pair would not match its instruction ('the left cup'): set flip: 0")]
        return []

    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        """Per item and per sample prompt, the keys of (caption, its control image) and ("", its control image); the pairs to encode."""
        config, items, images = planning.config, planning.items, planning.config.data.images
        text_fp = self.fingerprint(planning)
        item_text_keys, sample_text_keys, control_texts = [], [], []
        sample_bucket = (images.resolution, images.resolution)
        for index, (item, bucket) in enumerate(zip(items, planning.buckets)):
            item_text_keys.append([cache.control_text_key(text, text_fp, Path(item["control"]), bucket) for text in (item["caption"], "")])
            control_texts += [[key, text, index, list(bucket)] for key, text in zip(item_text_keys[-1], (item["caption"], ""))]
        for number, prompt in enumerate(planning.prompts):
            index = sample_control_item(items, prompt, number)
            sample_text_keys.append([cache.control_text_key(text, text_fp, Path(items[index]["control"]), sample_bucket) for text in (prompt, "")])
            control_texts += [[key, text, index, list(sample_bucket)] for key, text in zip(sample_text_keys[-1], (prompt, ""))]
        control_texts = list({entry[0]: entry for entry in control_texts}.values())
        missing = [entry for entry in control_texts if not cache.has_entry(planning.cache_dir, "text", entry[0])]
        if config.data.cache.text:
            planning.notes.append(
                f"text cache: {len(control_texts) - len(missing)} of {len(control_texts)} (caption, control image) pair(s) cached already, {len(missing)} to encode"
            )
        return {"text_keys": {}, "missing_texts": [], "item_text_keys": item_text_keys, "sample_text_keys": sample_text_keys, "missing_control_texts": missing}

    def missing(self, plan):
        return len(plan.missing_control_texts)

    def encode(self, arch, pipeline, prompts, device, images=None):
        with torch.no_grad():
            return prompt_rows(arch.prompts.encode_prompts_with_images(pipeline, prompts, images, device), len(prompts))

    def fill_cache(self, plan, arch, encoders, device, cache_dir):
        """Each caption encoded with its control image, at the bucket it trains (or samples) at."""
        if not plan.missing_control_texts:
            return 0
        pipeline = encoders()
        for start in range(0, len(plan.missing_control_texts), TEXT_BATCH):
            entries = plan.missing_control_texts[start : start + TEXT_BATCH]
            controls = [first_frame_image(load_image_for_bucket(Path(plan.items[index]["control"]), tuple(bucket), crop="center", flip=False).pixels) for _, _, index, bucket in entries]
            for (key, _, _, _), tensors in zip(entries, self.encode(arch, pipeline, [text for _, text, _, _ in entries], device, images=controls)):
                cache.save_entry(cache_dir, "text", key, tensors)
        return len(plan.missing_control_texts)

    def batch(self, task, captions, indices, dropped):
        # The caption's (or the empty one's) entry with this item's control image.
        return task.text_entries([task.data.item_text_keys[index][1 if gone else 0] for index, gone in zip(indices, dropped)])

    def samples(self, task, prompts):
        keys = task.data.sample_text_keys
        return task.text_entries([pair[0] for pair in keys]), task.text_entries([pair[1] for pair in keys])
