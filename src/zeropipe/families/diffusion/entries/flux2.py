"""FLUX.2 [dev] (``flux2``): its record and code are in ``bases/flux2.py``, the pieces it shares with ``flux2_klein`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.flux2 import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
