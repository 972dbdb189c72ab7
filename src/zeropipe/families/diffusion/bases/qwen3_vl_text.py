"""Qwen3VLProcessor's text path, for the modular pipelines' text-encoder blocks on machines without torchvision.

transformers builds ``Qwen3VLProcessor`` only with torchvision (its video processor needs it). The blocks of
FLUX.3 (``Flux3TextEncoderStep``) and MiniMax-H3 (``MiniMaxH3TextEncoderStep``) read three things of it for a text
prompt: its chat template (``apply_chat_template``, not tokenized), its tokenizer (``.tokenizer``) and the modality
type of each token (``create_mm_token_type_ids``: 0 for text; transformers' ``ProcessorMixin.create_mm_token_type_ids``
marks the image and video pad tokens 1 and 2). :class:`ProcessorTextPath` is those three over the tokenizer in the
processor's folder; a prompt holding a vision pad token is refused (it would need the real processor's images).
"""

from __future__ import annotations

from pathlib import Path

VISION_PADS = ("<|image_pad|>", "<|video_pad|>")


class ProcessorTextPath:
    """What the text-encoder blocks use of Qwen3VLProcessor for text alone, from its tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, conversation, add_generation_prompt: bool = False, tokenize: bool = False, **kwargs):
        if tokenize:
            raise ValueError("the text-encoder blocks tokenize the rendered prompt themselves; this stand-in renders the chat template only")
        return self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)

    def create_mm_token_type_ids(self, input_ids) -> list[list[int]]:
        pads = {self.tokenizer.convert_tokens_to_ids(token) for token in VISION_PADS if token in self.tokenizer.get_vocab()}
        rows = [list(row.tolist() if hasattr(row, "tolist") else row) for row in input_ids]
        if any(token in pads for row in rows for token in row):
            raise ValueError("an image or video pad token in a prompt needs the real Qwen3VLProcessor (its images): pip install torchvision")
        return [[0] * len(row) for row in rows]


def load_processor(folder: Path):
    """The processor in a pipeline's folder: Qwen3VLProcessor where torchvision is installed, else :class:`ProcessorTextPath`."""
    from transformers import AutoTokenizer

    try:
        import torchvision  # noqa: F401
    except ImportError:
        return ProcessorTextPath(AutoTokenizer.from_pretrained(str(folder)))
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(folder))
