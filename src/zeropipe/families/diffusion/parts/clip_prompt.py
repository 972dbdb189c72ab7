"""The prompt part of an entry whose prompt depends on the clip it describes (Cosmos 3 Omni): token ids per caption and clip shape.

Cosmos 3 has no text encoder: its transformer reads the prompt's token ids, and the pipeline's ``tokenize_prompt``
writes the clip's length, frame rate and resolution into the prompt ("The video is 1.0 seconds long and is of 24
FPS. This video is of 480x832 resolution.") under a system prompt for an image or a video. The same caption is
so other ids on a clip of another bucket, and the text cache holds one entry per (caption, width, height, frames,
fps): the caption's ids, and the negative prompt's (the empty one with the pipeline's inverse templates, what its
guidance runs as the unconditional pass), which a dropped caption trains on. Each sample prompt has its entries at
the samples' shape. Tokenizing is the entry's ``encode_prompts_for_clips`` (the pipeline's own ``tokenize_prompt``).

The ids are cached as int64 (the cache keeps a tensor's dtype) and handed to the call as integers, never in the
compute dtype: bf16 holds integers exactly only up to 256.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from zeropipe.families.diffusion import cache
from zeropipe.families.diffusion.parts.base import Planning
from zeropipe.families.diffusion.parts.text import TEXT_BATCH, PromptText

NEGATIVE = "\x00negative"  # the text of a clip's negative-prompt entry in the plan (no caption is this string)


def clip_text_key(text: str, text_fingerprint: str, shape: tuple[int, int, int, float]) -> str:
    """The key of a caption's token ids on a clip of this (width, height, frames, fps); NEGATIVE's: the clip's negative prompt."""
    return cache._digest("text", text, text_fingerprint, "clip", list(shape))


def clip_frame_rate(config: Any, codec: Any) -> float:
    """The frame rate clips are taken at, as the codec's ``take_clips`` decides it (data.video.fps, or the model's own)."""
    fps = config.data.video.fps
    return float(codec.frame_rate if fps == "auto" else fps)


@dataclass(frozen=True)
class PromptPerClip(PromptText):
    """A prompt tokenized with the shape of the clip it describes, cached per (caption, clip shape); its negative per clip shape."""

    def fingerprint(self, planning: Planning) -> str:
        """The tokenizer's files, the entry, the pipeline's system-prompt setting and diffusers' version (its templates)."""
        import diffusers

        system = planning.folder.index.get("default_use_system_prompt", True)
        return cache._digest(super().fingerprint(planning), "system", system, diffusers.__version__)

    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        """Per item, the keys of (caption, its clip's shape) and of that shape's negative; per sample prompt the same at the samples' shape."""
        config = planning.config
        text_fp = self.fingerprint(planning)
        fps = clip_frame_rate(config, planning.arch.record.codec)
        video = config.data.video
        resolution = config.data.images.resolution
        sample_shape = (resolution, resolution, int(video.sample_frames or max(video.frame_buckets)), fps)
        wanted: dict[str, list] = {}  # key -> [key, text, width, height, frames, fps]

        def keys(text: str, shape: tuple) -> list[str]:
            pair = [clip_text_key(text, text_fp, shape), clip_text_key(NEGATIVE, text_fp, shape)]
            wanted.setdefault(pair[0], [pair[0], text, *shape])
            wanted.setdefault(pair[1], [pair[1], NEGATIVE, *shape])
            return pair

        item_text_keys = [keys(item["caption"], (*bucket[:3], fps)) for item, bucket in zip(planning.items, planning.buckets)]
        sample_text_keys = [keys(prompt, sample_shape) for prompt in planning.prompts]
        missing = [entry for key, entry in wanted.items() if not cache.has_entry(planning.cache_dir, "text", key)]
        # Token ids cost no encoder: they are always cached, whatever data.cache.text says.
        planning.notes.append(f"text cache: {len(wanted) - len(missing)} of {len(wanted)} (prompt, clip shape) token id list(s) cached already, {len(missing)} to tokenize")
        return {"text_keys": {}, "missing_texts": [], "item_text_keys": item_text_keys, "sample_text_keys": sample_text_keys, "missing_control_texts": missing}

    def missing(self, plan):
        return len(plan.missing_control_texts)

    def encode(self, arch, pipeline, prompts, device, images=None):
        raise TypeError(f"the {arch.record.name} prompt depends on the clip's shape: it is tokenized by encode_clips, per (caption, clip shape)")

    def encode_clips(self, arch: Any, pipeline, entries: list[list]) -> list[dict[str, torch.Tensor]]:
        """Per plan entry [key, text, width, height, frames, fps], its cached tensors: ``input_ids`` (int64) and ``input_ids_mask``."""
        rows = []
        for _, text, width, height, frames, fps in entries:
            negative = text == NEGATIVE
            ids = arch.prompts.encode_prompts_for_clips(pipeline, "" if negative else text, int(width), int(height), int(frames), float(fps))[1 if negative else 0]
            ids = torch.tensor(ids, dtype=torch.long)
            rows.append({"input_ids": ids, "input_ids_mask": torch.ones_like(ids)})
        return rows

    def fill_cache(self, plan, arch, encoders, device, cache_dir):
        if not plan.missing_control_texts:
            return 0
        pipeline = encoders()
        for start in range(0, len(plan.missing_control_texts), TEXT_BATCH):
            entries = plan.missing_control_texts[start : start + TEXT_BATCH]
            for entry, tensors in zip(entries, self.encode_clips(arch, pipeline, entries)):
                cache.save_entry(cache_dir, "text", entry[0], tensors)
        return len(plan.missing_control_texts)

    # ------------------------------------------------------------------ a rank
    def entries(self, task: Any, keys: list[str], fps: float) -> dict[str, torch.Tensor]:
        """The token ids of these entries padded to the longest (mask 0 after each), as int64 on the rank's device, and each clip's fps."""
        rows = [cache.load_entry(task.cache_dir, "text", key) for key in keys]
        out = {name: pad_sequence([row[name] for row in rows], batch_first=True).to(task.device, torch.long) for name in ("input_ids", "input_ids_mask")}
        out["fps"] = torch.full((len(keys),), float(fps), device=task.device)
        return out

    def batch(self, task, captions, indices, dropped):
        # The caption's ids on this item's clip, or (dropped) that clip's negative prompt's.
        return self.entries(task, [task.data.item_text_keys[index][1 if gone else 0] for index, gone in zip(indices, dropped)], task.data.fps)

    def samples(self, task, prompts):
        keys = task.data.sample_text_keys
        return self.entries(task, [pair[0] for pair in keys], task.data.fps), self.entries(task, [pair[1] for pair in keys], task.data.fps)
