"""Qwen-Image-Edit (``qwen-image-edit``): its record and code are in ``bases/qwen_image_edit.py``, the pieces it shares with ``qwen_image21``, ``qwen_image_edit_plus`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.qwen_image_edit import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
