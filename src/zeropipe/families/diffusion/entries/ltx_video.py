"""LTX-Video (``ltx-video``): its record and code are in ``bases/ltx_video.py``, the pieces it shares with ``ltx2`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.ltx_video import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
