"""Wan Animate 2 (``wan-animate-2``, ``WanAnimate2ModularPipeline``): its record and code are in ``bases/wan_animate2.py`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.wan_animate2 import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
