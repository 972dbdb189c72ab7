"""Wan 2.2 TI2V-5B (``wan-ti2v``): its record and code are in ``bases/wan_ti2v.py``, the pieces it shares with ``wan_ti2v_i2v`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.wan_ti2v import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
