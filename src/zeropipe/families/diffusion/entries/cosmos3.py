"""Cosmos 3 Omni (``cosmos3``, ``Cosmos3OmniPipeline``): text to video (and to image, one frame) on the Wan 2.2 VAE.

The record, call, prompts (token ids per caption and clip shape: ``parts/clip_prompt.py``), samples and assembly are
``bases/cosmos3.py``'s. Image-conditioned frames, sound and actions are not trained (docs/video.md).
"""

from zeropipe.families.diffusion.bases.cosmos3 import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
