"""Wan image-to-video (``wan-i2v``): its record and code are in ``bases/wan_i2v.py``, the pieces it shares with ``skyreels_v2_i2v`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.wan_i2v import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
