"""HunyuanVideo 1.5 text-to-video (``hunyuan-video-1.5``): its record and code are in ``bases/hunyuan_video15.py``, the pieces it shares with ``hunyuan_video15_i2v`` (no entry imports another)."""

from zeropipe.families.diffusion.bases.hunyuan_video15 import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
