"""MiniMax-H3 image-to-video (``minimax-h3-i2v``, ``MiniMaxH3ModularPipeline``'s ``fl2va`` workflow with ``image``): the clip's
first frame conditions the video and its stereo soundtrack.

The text-to-video record (``bases/minimax_h3.py``, the ``minimax-h3`` entry) with the first frame twice (``bases/minimax_h3_i2v.py``):
as image tokens in the prompt (``PromptWithFirstFrame``: each caption cached with its clip's first frame, through the pipeline's
own ``MiniMaxH3FL2VATextEncoderStep``) and as the keyframe of the packed sequence (``SeededFirstFrame``: encoded as
``encode_vae_condition`` encodes a keyframe; ``MiniMaxH3I2VCall`` packs it as the pipeline's fl2va layout does). The call, the
prompt encoding and the samples are held to the pipeline's blocks in ``tests/unit/diffusion/test_minimax_h3_i2v.py``. The
guidance-preserving objective (``model.diffusion.guidance_preserving``) applies as for ``minimax-h3``: the unconditional side is
the empty caption with the same first frame.

Qwen3-VL's image processor: transformers builds ``Qwen3VLProcessor`` only with torchvision; without it the block is given
transformers' own PIL backend of the image processor (``Qwen2VLImageProcessorPil``: the same grid and patches; its bicubic
resize is PIL's, not torchvision's) with the tokenizer (``bases/qwen3_vl_text.ProcessorImagePath``).

The pipeline class is the text-to-video one and the release's ``transformer/`` draws both ways: a run trains this entry with
``model.diffusion.task: image-to-video`` (or a folder whose ``modular_model_index.json`` says ``"zeropipe_task": "image-to-video"``,
as the tiny preset's does); otherwise the folder is ``minimax-h3``. The last-frame (``last_image``) and reference-to-video
(``ref2va``: the ``transformer_ref/`` partition, video and audio references) workflows are not trained here.
"""

from __future__ import annotations

import copy
import dataclasses

from zeropipe.families.diffusion.bases.minimax_h3 import ARCHITECTURE as T2V
from zeropipe.families.diffusion.bases.minimax_h3_i2v import MiniMaxH3I2VCall, MiniMaxH3I2VPrompts, MiniMaxH3I2VSampling
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import PromptWithFirstFrame, SeededFirstFrame
from zeropipe.families.diffusion.tiny.tokenizers import CHARACTERS, CHAT_TOKENS, VISION_TOKENS


def tiny_preset() -> dict:
    """tiny-minimax-h3 with the vision tokens' ids in the text encoder's config (the tiny tokenizer puts them after its characters)."""
    preset = copy.deepcopy(T2V.record.preset)
    first = len(CHAT_TOKENS) + 1 + len(CHARACTERS)
    ids = {token: first + number for number, token in enumerate(VISION_TOKENS)}
    preset["text_encoder"].update({"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                                   "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]})
    return preset


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        T2V.record,
        name="minimax-h3-i2v",
        pipeline_settings=(("zeropipe_task", "image-to-video"),),
        text=PromptWithFirstFrame(processors=("processor",)),
        conditions=(*T2V.record.conditions, SeededFirstFrame()),
        preset_name="tiny-minimax-h3-i2v",
        preset=tiny_preset(),
    ),
    call=MiniMaxH3I2VCall(),
    prompts=MiniMaxH3I2VPrompts(),
    sampling=MiniMaxH3I2VSampling(),
    layouts=T2V.layouts,
    assembly=T2V.assembly,
)
