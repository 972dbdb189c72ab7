"""Wan 2.1 / 2.2 text-to-video (``wan``): its record and code are in ``bases/wan.py``, the pieces it shares with ``skyreels_v2``, ``wan_i2v``, ``wan_ti2v`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.wan import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
