"""Cosmos-Predict2 text-to-image (``cosmos-predict2``): its record and code are in ``bases/cosmos_predict2.py``, the pieces it shares with ``cosmos_predict2_video2world`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.cosmos_predict2 import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
