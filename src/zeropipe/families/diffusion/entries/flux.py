"""Flux.1 (``flux``): its record and code are in ``bases/flux.py``, the pieces it shares with ``flux_kontext`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.flux import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
