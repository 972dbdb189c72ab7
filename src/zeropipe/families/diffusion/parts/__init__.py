"""The parts a diffusion architecture entry is made of: a latent codec, a prompt part and conditions (see ``base.py``)."""

from __future__ import annotations

from typing import Any

from zeropipe.families.diffusion.parts.audio_track import AudioTrack
from zeropipe.families.diffusion.parts.base import Condition, Encoding, Inputs, Part, Planning, SampleInputs, Sampling
from zeropipe.families.diffusion.parts.clip_prompt import PromptPerClip
from zeropipe.families.diffusion.parts.codec import ImageLatents, PerChannelVideoLatents, VideoLatents
from zeropipe.families.diffusion.parts.control_image import ControlImage
from zeropipe.families.diffusion.parts.control_prompt import PromptWithControlImage
from zeropipe.families.diffusion.parts.first_frame import FirstFrame, FirstFrameAlone, SeededFirstFrame
from zeropipe.families.diffusion.parts.first_frame_embeddings import FirstFrameEmbeddings
from zeropipe.families.diffusion.parts.first_frame_prompt import PromptWithFirstFrame
from zeropipe.families.diffusion.parts.guidance import GuidedPrompt
from zeropipe.families.diffusion.parts.image_layers import ImageLayers
from zeropipe.families.diffusion.parts.reference_images import ReferenceImages
from zeropipe.families.diffusion.parts.reference_prompt import PromptWithReferenceImages
from zeropipe.families.diffusion.parts.text import PromptText
from zeropipe.families.diffusion.parts.waveform_audio import WaveformAudioTrack

# Settings only some parts read, and what to tell a user who sets one for an entry without such a part.
PART_SETTINGS = {
    "data.control_path": lambda config, arch: (
        "data.control_path", f"this {arch.record.name} pipeline takes no control image: remove data.control_path, or point model.path at an edit model's "
        "pipeline folder: FLUX.1 Kontext (FluxKontextPipeline, flux-kontext) or Qwen-Image-Edit (QwenImageEditPipeline, qwen-image-edit)"
    ),
    "data.control_paths": lambda config, arch: (
        "data.control_paths", f"this {arch.record.name} pipeline takes no reference images: remove data.control_paths, or train a multi-reference edit model (qwen-image-edit-plus, flux2)"
    ),
    "model.diffusion.guidance_preserving": lambda config, arch: (
        "model.diffusion.guidance_preserving", f"the {arch.record.name} entry does not offer the guidance-preserving objective (an entry selects it with "
        "its prompt part, GuidedPrompt): remove model.diffusion.guidance_preserving"
    ),
}


def active_conditions(arch: Any, folder: Any, config: Any) -> list[Any]:
    """The entry's conditions a run has: those its pipeline folder supports (``active``) and its settings ask for (``wanted``)."""
    return [condition for condition in arch.record.conditions if condition.active(folder) and condition.wanted(config)]


def part_problems(config: Any, arch: Any) -> list[tuple[str, str]]:
    """Every problem the entry's parts have with the settings, and the part settings set for an entry that has no part reading them."""
    read = {key for part in arch.record.parts for key in part.config_keys()}
    problems = [unread(config, arch) for key, unread in PART_SETTINGS.items() if key not in read and _setting(config, key)]
    return problems + [problem for part in arch.record.parts for problem in part.problems(config, arch)]


def _setting(config: Any, key: str) -> Any:
    value = config
    for name in key.split("."):
        value = getattr(value, name, None)
    return value


__all__ = [
    "AudioTrack", "Condition", "ControlImage", "Encoding", "FirstFrame", "FirstFrameAlone", "FirstFrameEmbeddings", "GuidedPrompt", "ImageLatents", "ImageLayers", "Inputs", "Part",
    "PerChannelVideoLatents", "Planning", "PromptPerClip", "PromptText", "PromptWithControlImage", "PromptWithFirstFrame", "PromptWithReferenceImages", "ReferenceImages", "SampleInputs",
    "SeededFirstFrame",
    "Sampling", "VideoLatents", "WaveformAudioTrack", "active_conditions", "part_problems",
]
