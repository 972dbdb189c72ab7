"""SkyReels-V2 text-to-video: Skywork's Wan 2.1-architecture model (its own ``SkyReelsV2Transformer3DModel``), trained at 24 fps.

``SkyReelsV2Pipeline`` prepares everything as ``WanPipeline`` does (UMT5 prompts of 512 tokens,
zeros after the prompt's own; the Wan VAE normalised per channel; one timestep per clip) and
calls its transformer without the diffusion-forcing arguments (``enable_diffusion_forcing``,
``fps``), which only the DF pipelines pass. Its original checkpoints use Wan's module names
(diffusers' ``convert_skyreelsv2_to_diffusers.py`` renames them with Wan's table), so its LoRA's
ComfyUI layout is Wan's. The sampler is Wan's UniPC; SkyReels' own example samples text-to-video
with a flow shift of 8 (5 for image-to-video), which the tiny preset's scheduler holds.
"""

from __future__ import annotations

import copy
import dataclasses

from zeropipe.families.diffusion.bases.wan import ARCHITECTURE as WAN_T2V
from zeropipe.families.diffusion.bases.wan import WAN_SCHEDULER
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import PerChannelVideoLatents


def tiny_preset(flow_shift: float) -> dict:
    preset = copy.deepcopy(WAN_T2V.record.preset)
    preset["scheduler"] = {**WAN_SCHEDULER, "flow_shift": flow_shift}
    return preset


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        WAN_T2V.record,
        name="skyreels-v2",
        trace_frames=97,  # SkyReelsV2Pipeline's default clip: 4 s at 24 fps
        pipeline_class="SkyReelsV2Pipeline",
        related_pipelines=(),
        denoiser_class="SkyReelsV2Transformer3DModel",
        codec=PerChannelVideoLatents(vae_class="AutoencoderKLWan", frame_multiple=4, frame_rate=24.0),
        preset_name="tiny-skyreels-v2",
        preset=tiny_preset(8.0),
        pipeline_kwargs={},  # one transformer; no boundary_ratio to turn off
    ),
    call=WAN_T2V.call,
    prompts=WAN_T2V.prompts,
    sampling=WAN_T2V.sampling,
    layouts=WAN_T2V.layouts,
)
