"""Kandinsky 5 text-to-image (``kandinsky5-t2i``): its record and code are in ``bases/kandinsky5_t2i.py``, the pieces it shares with ``kandinsky5_t2v`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.kandinsky5_t2i import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
