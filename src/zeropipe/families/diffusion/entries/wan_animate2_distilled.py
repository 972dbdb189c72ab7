"""Wan Animate 2 distilled (``wan-animate-2-distilled``, ``WanAnimate2DistilledModularPipeline``): Wan Animate 2's record and call,
its samples without classifier-free guidance (``bases/wan_animate2.py``)."""

from zeropipe.families.diffusion.bases.wan_animate2 import DISTILLED as ARCHITECTURE

__all__ = ["ARCHITECTURE"]
