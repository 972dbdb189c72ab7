"""Qwen3VLProcessor's text path, for the modular pipelines' text-encoder blocks on machines without torchvision.

transformers builds ``Qwen3VLProcessor`` only with torchvision (its video processor needs it). The blocks of
FLUX.3 (``Flux3TextEncoderStep``) and MiniMax-H3 (``MiniMaxH3TextEncoderStep``) read three things of it for a text
prompt: its chat template (``apply_chat_template``, not tokenized), its tokenizer (``.tokenizer``) and the modality
type of each token (``create_mm_token_type_ids``: 0 for text; transformers' ``ProcessorMixin.create_mm_token_type_ids``
marks the image and video pad tokens 1 and 2). :class:`ProcessorTextPath` is those three over the tokenizer in the
processor's folder; a prompt holding a vision pad token is refused (it would need the real processor's images).

MiniMax-H3's image-to-video block (``MiniMaxH3FL2VATextEncoderStep``) reads two more: the image processor
(``processor.image_processor(images=...)`` and its ``merge_size``) and the image pads' modality type (1).
:class:`ProcessorImagePath` adds them: the image processor is transformers' own PIL backend of Qwen3-VL's
(``Qwen2VLImageProcessorPil``: the same smart_resize grid, normalisation and patchify as the torchvision one, which
resizes with torchvision's bicubic rather than PIL's), loaded from the processor's folder, and the modality types are
``ProcessorMixin.create_mm_token_type_ids`` itself, run on the ids Qwen3VLProcessor would hold.
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


class ProcessorImagePath(ProcessorTextPath):
    """Qwen3VLProcessor's text path plus its image processor (transformers' PIL backend), for prompts that hold images."""

    def __init__(self, tokenizer, image_processor):
        super().__init__(tokenizer)
        self.image_processor = image_processor
        # The ids Qwen3VLProcessor.__init__ takes from its tokenizer (``image_token_id``...), read by ProcessorMixin's token types.
        self.image_token_id, self.video_token_id = (tokenizer.convert_tokens_to_ids(token) for token in VISION_PADS)
        self.audio_token_ids = []

    @property
    def image_token_ids(self) -> list[int]:
        return [self.image_token_id]

    @property
    def video_token_ids(self) -> list[int]:
        return [self.video_token_id]

    def create_mm_token_type_ids(self, input_ids) -> list[list[int]]:
        """transformers' own ``ProcessorMixin.create_mm_token_type_ids``: 0 text, 1 an image pad, 2 a video pad."""
        from transformers import ProcessorMixin

        return ProcessorMixin.create_mm_token_type_ids(self, input_ids)


def load_image_processor(folder: Path):
    """Qwen3-VL's image processor from a processor folder, in transformers' PIL backend (it needs no torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(str(folder))


def load_processor(folder: Path, images: bool = False):
    """The processor in a pipeline's folder: Qwen3VLProcessor where torchvision is installed, else :class:`ProcessorTextPath`
    (:class:`ProcessorImagePath` where its prompts hold images: ``images``)."""
    from transformers import AutoTokenizer

    try:
        import torchvision  # noqa: F401
    except ImportError:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        return ProcessorImagePath(tokenizer, load_image_processor(folder)) if images else ProcessorTextPath(tokenizer)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(folder))

