"""The prompt part: the text encoders' outputs for a caption, cached per caption (the text cache).

Every entry has one. :class:`PromptText` encodes a caption alone, by the pipeline's own
``encode_prompt`` (the entry's ``encode_prompts``); an entry whose text encoder also sees an
image declares another prompt part (``control_prompt.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from zeropipe.families.diffusion import cache
from zeropipe.families.diffusion.parts.base import Part, Planning

TEXT_BATCH = 16  # captions per text-encoder call while caching


def prompt_rows(out: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """Per prompt, its tensors of a batched encoding (on the CPU, in fp32: what the cache holds)."""
    return [{key: value[i].detach().float().cpu().contiguous() for key, value in out.items()} for i in range(count)]


@dataclass(frozen=True)
class PromptText(Part):
    """A prompt encoded alone, cached per caption.

    Attributes:
        processors: components besides the tokenizers that encoding a prompt needs (Qwen-Image-Edit's
            ``processor``), which the entry's ``load_prompt_processor`` makes from the pipeline folder
            and a tiny preset writes with ``tiny_prompt_processor``.
    """

    processors: tuple[str, ...] = ()

    def fingerprint(self, planning: Planning) -> str:
        """The text cache's part of every key: the encoders', tokenizers' and processors' files, and the entry's name."""
        arch = planning.arch
        names = (*arch.record.text_encoders, *arch.record.tokenizers, *self.processors)
        return cache._digest("+".join(planning.folder.fingerprint(name) for name in names) + f"/{arch.record.name}")

    # ------------------------------------------------------------------ the launcher
    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        """``text_keys`` (caption -> key) and ``missing_texts`` (the captions the node's setup encodes)."""
        config, cache_dir = planning.config, planning.cache_dir
        text_fp = self.fingerprint(planning)
        texts = sorted({item["caption"] for item in planning.items} | {""} | set(planning.prompts))
        text_keys = {text: cache.text_key(text, text_fp) for text in texts}
        # Sample prompts and the empty caption are always cached: sampling then needs no text encoder.
        cached_texts = texts if config.data.cache.text else sorted({""} | set(planning.prompts))
        missing = [t for t in cached_texts if not cache.has_entry(cache_dir, "text", text_keys[t])]
        if config.data.cache.text:
            planning.notes.append(f"text cache: {len(texts) - len(missing)} of {len(texts)} caption(s) cached already, {len(missing)} to encode")
        return {"text_keys": text_keys, "missing_texts": missing}

    def missing(self, plan: Any) -> int:
        """How many text cache entries the node's setup has to encode."""
        return len(plan.missing_texts)

    # ------------------------------------------------------------------ the node's cache filling
    def encode(self, arch: Any, pipeline, prompts: list[str], device: torch.device, images: list | None = None) -> list[dict[str, torch.Tensor]]:
        """Per prompt, the tensors the denoiser is conditioned on, by the pipeline's own encode_prompt."""
        with torch.no_grad():
            return prompt_rows(arch.prompts.encode_prompts(pipeline, prompts, device), len(prompts))

    def fill_cache(self, plan: Any, arch: Any, encoders: Callable[[], Any], device: torch.device, cache_dir) -> int:
        """Encode the missing captions (``encoders()`` loads the text pipeline); how many were encoded."""
        if not plan.missing_texts:
            return 0
        pipeline = encoders()
        for start in range(0, len(plan.missing_texts), TEXT_BATCH):
            texts = plan.missing_texts[start : start + TEXT_BATCH]
            for text, tensors in zip(texts, self.encode(arch, pipeline, texts, device)):
                cache.save_entry(cache_dir, "text", plan.text_keys[text], tensors)
        return len(plan.missing_texts)

    # ------------------------------------------------------------------ a rank
    def batch(self, task: Any, captions: list[str], indices: list[int], dropped: list[bool]) -> dict[str, torch.Tensor]:
        """The prompt's part of a micro-batch's ``condition`` (``task.text_condition`` reads the cache, or encodes)."""
        return task.text_condition(captions)

    def samples(self, task: Any, prompts: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the sample prompts' conditioning, the empty prompt's for each: the negative)."""
        return task.text_condition(prompts), task.text_condition([""] * len(prompts))
