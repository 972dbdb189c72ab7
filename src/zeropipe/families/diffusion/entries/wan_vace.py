"""Wan VACE (``wan-vace``: Wan 2.2 VACE-Fun A14B, Wan 2.1 VACE): its record and code are in ``bases/wan_vace.py`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.wan_vace import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
