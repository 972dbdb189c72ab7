"""Wan 2.2 TI2V-5B image-to-video: the first latent frame is the image's latents at timestep 0 (see ``bases/wan_ti2v.py``).

A ``WanImageToVideoPipeline`` folder saved with ``expand_timesteps: true``; Wan-AI's TI2V-5B
folder says ``WanPipeline`` (its text-to-video use): image-to-video training points at a copy
whose ``model_index.json`` names ``WanImageToVideoPipeline`` (docs/video.md).
"""

from __future__ import annotations

import dataclasses

from zeropipe.families.diffusion.bases.wan_ti2v import ARCHITECTURE as TI2V
from zeropipe.families.diffusion.bases.wan_ti2v import WanTI2VImageToVideoCall, tiny_preset
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import FirstFrameAlone

ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        TI2V.record,
        name="wan-ti2v-i2v",
        pipeline_class="WanImageToVideoPipeline",
        conditions=(FirstFrameAlone(),),
        preset_name="tiny-wan-ti2v-i2v",
        preset=tiny_preset(),
    ),
    call=WanTI2VImageToVideoCall(),
    prompts=TI2V.prompts,
    sampling=TI2V.sampling,
    layouts=TI2V.layouts,
)
