"""SkyReels-V2 text-to-video (``skyreels-v2``): its record and code are in ``bases/skyreels_v2.py``, the pieces it shares with ``skyreels_v2_i2v`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.skyreels_v2 import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
