"""Kandinsky 5 text-to-video (``kandinsky5-t2v``): its record and code are in ``bases/kandinsky5_t2v.py``, the pieces it shares with ``kandinsky5_i2v`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.kandinsky5_t2v import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
