"""Kandinsky 6.0 Video image-to-video (``kandinsky6-i2v``, ``Kandinsky6TI2VAPipeline`` with ``image``): the clip's first frame
conditions the video and its sound.

The text-to-video record (``bases/kandinsky6.py``, the ``kandinsky6`` entry) with the ``FirstFrameAlone`` condition (the clip's first frame encoded
alone as a one-frame clip, scaled by the VAE's ``scaling_factor``, as the pipeline's ``encode_image`` encodes ``image``; the
cache keeps the distribution's mode where the pipeline draws from it) beside the ``MMAudioTrack`` sound, and its own call
(``Kandinsky6I2VCall``: the image's latents appended as a clean tail frame with the mask channel, token type 1 and the first
frame's rotary position, as the pipeline's loop builds them; held to the pipeline's own call in
``tests/unit/diffusion/test_kandinsky6.py``). Every frame of the clip is denoised and in the loss, the tail frame being
reference only. Samples take a data clip's first frame as the pipeline's ``image``.

The pipeline class is the text-to-video one and the release's one checkpoint draws both ways: a run trains this entry with
``model.diffusion.task: image-to-video`` (or a folder whose ``model_index.json`` says ``"zeropipe_task": "image-to-video"``, as the
tiny preset's does); otherwise the folder is ``kandinsky6``.
"""

from __future__ import annotations

import dataclasses

from zeropipe.families.diffusion.bases.kandinsky6 import ARCHITECTURE as T2V
from zeropipe.families.diffusion.bases.kandinsky6 import Kandinsky6I2VCall
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import FirstFrameAlone

ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        T2V.record,
        name="kandinsky6-i2v",
        pipeline_settings=(("zeropipe_task", "image-to-video"),),
        conditions=(*T2V.record.conditions, FirstFrameAlone()),
        preset_name="tiny-kandinsky6-i2v",
    ),
    call=Kandinsky6I2VCall(),
    prompts=T2V.prompts,
    sampling=T2V.sampling,
    layouts=T2V.layouts,
    assembly=T2V.assembly,
)
