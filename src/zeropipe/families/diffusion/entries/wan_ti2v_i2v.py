"""Wan 2.2 TI2V-5B image-to-video: the first latent frame is the image's latents at timestep 0 (see ``wan_ti2v.py``).

A ``WanImageToVideoPipeline`` folder saved with ``expand_timesteps: true``; Wan-AI's TI2V-5B
folder says ``WanPipeline`` (its text-to-video use): image-to-video training points at a copy
whose ``model_index.json`` names ``WanImageToVideoPipeline`` (docs/video.md).
"""

from __future__ import annotations

from zeropipe.families.diffusion.bases.wan_ti2v import ARCHITECTURE as TI2V
from zeropipe.families.diffusion.bases.wan_ti2v import WanTI2VImageToVideo, tiny_preset
from zeropipe.families.diffusion.parts import FirstFrameAlone

ARCHITECTURE = WanTI2VImageToVideo(
    **{
        **{field: getattr(TI2V, field) for field in TI2V.__dataclass_fields__},
        "name": "wan-ti2v-i2v",
        "pipeline_class": "WanImageToVideoPipeline",
        "conditions": (FirstFrameAlone(),),
        "preset_name": "tiny-wan-ti2v-i2v",
        "preset": tiny_preset(),
    }
)
