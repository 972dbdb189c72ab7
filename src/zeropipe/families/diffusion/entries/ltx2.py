"""LTX-2 (``ltx2``): its record and code are in ``bases/ltx2.py``, the pieces it shares with ``ltx-2.5`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.ltx2 import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
