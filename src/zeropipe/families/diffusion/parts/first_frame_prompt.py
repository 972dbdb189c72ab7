"""The prompt part of an image-to-video entry whose text encoder also sees the first frame (MiniMax-H3's fl2va: Qwen3-VL reads
the keyframe as image tokens ahead of the prompt).

The conditioning then depends on the clip: the text cache holds one entry per (caption, clip, bucket), the clip's first
frame at the bucket it trains at (centre-cropped, as the latent cache crops it), and the empty caption's with that frame
(a dropped caption, and the unconditional side of the guidance-preserving objective: the image kept, the text gone, as
classifier-free guidance of an image-to-video model drops the text only; encoded only where the run has either). Each
sample prompt has its entries with the first frame the samples start from (the ``FirstFrame`` condition's: the data's
first video clip, at the sample size).
Encoding goes through the entry's ``encode_prompts_with_images``, as ``PromptWithControlImage``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.data.images import first_frame_image
from zeropipe.families.diffusion import cache
from zeropipe.families.diffusion.parts.base import Planning
from zeropipe.families.diffusion.parts.control_prompt import PromptWithControlImage
from zeropipe.families.diffusion.parts.guidance import GuidedPrompt, SCALE, UNCONDITIONAL, _scale
from zeropipe.families.diffusion.parts.text import TEXT_BATCH


def first_frame_text_key(text: str, text_fingerprint: str, item: dict[str, Any], bucket) -> str:
    """The key of a caption's conditioning with this clip's first frame at a bucket: the video file, where the clip starts in it
    (``data.video.clip_mode: multiple`` takes several clips of one file) and the bucket."""
    return cache._digest("text", text, text_fingerprint, "first-frame", *cache.file_identity(Path(item["path"])), item.get("start", 0), list(bucket))


def sample_item(items: list[dict[str, Any]]) -> int:
    """The item the samples start from: the first video clip, else the first item (``FirstFrame.sample_inputs``' choice)."""
    return next((index for index, item in enumerate(items) if item.get("frames", 1) > 1), 0)


def first_frame_at(arch: Any, plan: Any, index: int, bucket: tuple[int, ...]):
    """An item's first frame at a bucket, centre-cropped and unflipped (a PIL image), as the latent cache and the samples crop it."""
    return first_frame_image(arch.record.codec.load_pixels(plan, index, tuple(bucket), "center", False, None).pixels)


@dataclass(frozen=True)
class PromptWithFirstFrame(GuidedPrompt, PromptWithControlImage):
    """A prompt encoded with its clip's first frame, cached per (caption, clip, bucket); guidance-preserving where asked."""

    def problems(self, config, arch):
        problems = GuidedPrompt.problems(self, config, arch)
        if config.data.images.flip > 0:
            problems.append(("data.images.flip", f"the {arch.record.name} text encoder sees each clip's first frame unflipped (its entry is cached once per "
                                                 "caption and clip), so a flipped clip would not match its image tokens: set flip: 0"))
        if config.data.images.crop != "center":
            problems.append(("data.images.crop", f"the {arch.record.name} text encoder sees each clip's first frame as the latent cache crops it (from the centre), "
                                                 "so a random crop would not match its image tokens: set crop: center"))
        return problems

    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        """Per item, the keys of (caption, its first frame) and ("", its first frame); per sample prompt the same with the samples' frame."""
        config, items = planning.config, planning.items
        text_fp = self.fingerprint(planning)
        item_text_keys, sample_text_keys, texts = [], [], []
        # A clip's empty-caption entry is read only by a dropped caption or the guidance-preserving objective: each is a full
        # pass of the text encoder (Qwen3-VL-32B for H3), so it is encoded only where the run can read it.
        empties = config.data.images.caption_dropout > 0 or _scale(config) is not None
        for index, (item, bucket) in enumerate(zip(items, planning.buckets)):
            item_text_keys.append([first_frame_text_key(text, text_fp, item, bucket) for text in (item["caption"], "")])
            texts += [[key, text, index, list(bucket)] for key, text in zip(item_text_keys[-1], (item["caption"], ""))][: 2 if empties else 1]
        start = sample_item(items) if items else 0
        sample_bucket = planning.arch.record.codec.sample_bucket(config.data.images.resolution)
        for prompt in planning.prompts:
            sample_text_keys.append([first_frame_text_key(text, text_fp, items[start], sample_bucket) for text in (prompt, "")])
            texts += [[key, text, start, list(sample_bucket)] for key, text in zip(sample_text_keys[-1], (prompt, ""))]
        texts = list({entry[0]: entry for entry in texts}.values())
        missing = [entry for entry in texts if not cache.has_entry(planning.cache_dir, "text", entry[0])]
        if config.data.cache.text:
            planning.notes.append(f"text cache: {len(texts) - len(missing)} of {len(texts)} (caption, first frame) pair(s) cached already, {len(missing)} to encode")
        return {"text_keys": {}, "missing_texts": [], "item_text_keys": item_text_keys, "sample_text_keys": sample_text_keys, "missing_control_texts": missing}

    def fill_cache(self, plan, arch, encoders, device, cache_dir):
        """Each caption encoded with its clip's first frame, at the bucket it trains (or samples) at."""
        if not plan.missing_control_texts:
            return 0
        pipeline = encoders()
        for begin in range(0, len(plan.missing_control_texts), TEXT_BATCH):
            entries = plan.missing_control_texts[begin : begin + TEXT_BATCH]
            frames = [first_frame_at(arch, plan, index, tuple(bucket)) for _, _, index, bucket in entries]
            for (key, _, _, _), tensors in zip(entries, self.encode(arch, pipeline, [text for _, text, _, _ in entries], device, images=frames)):
                cache.save_entry(cache_dir, "text", key, tensors)
        return len(plan.missing_control_texts)

    def batch(self, task, captions, indices, dropped):
        """The caption's entry with the item's first frame (the empty caption's where dropped); with the guidance-preserving
        objective, the empty caption's with the same frame as the unconditional side."""
        keys = task.data.item_text_keys
        condition = task.text_entries([keys[index][1 if gone else 0] for index, gone in zip(indices, dropped)])
        scale = _scale(task.config)
        if scale is None:
            return condition
        empty = task.text_entries([keys[index][1] for index in indices])
        condition.update({UNCONDITIONAL + key: value for key, value in empty.items()})
        condition[SCALE] = torch.tensor(scale)
        return condition
