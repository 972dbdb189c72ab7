"""Qwen-Image (``qwen-image``): its record and code are in ``bases/qwen_image.py``, the pieces it shares with ``qwen_image21``, ``qwen_image_edit``, ``qwen_image_edit_plus`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.qwen_image import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
