"""FLUX.3 (``Flux3ModularPipeline``, diffusers 0.42.1: modular only): text-to-image through the door for modular pipelines.

The denoiser call is ``bases/flux3.py``'s (held to ``Flux3LoopDenoiser``). Prompts are the pipeline's own
text-encoder block (``Flux3TextEncoderStep``: Qwen3-VL's hidden states 4, 8, ..., 32 stacked, each prompt in its
chat template right-padded to a multiple of 80 tokens), run once per prompt as it takes one, the window cached
with a mask. The block reads the processor (the ``tokenizer`` component, an ``AutoProcessor``: Qwen3VLProcessor)
for its chat template and its tokenizer only: where torchvision is missing (transformers builds Qwen3VLProcessor
only with it) the entry gives the block ``bases/qwen3_vl_text.ProcessorTextPath``, those from the same folder. The latents are
FLUX.2's (``Flux2Latents``: ``AutoencoderKLFlux2``, patched 2x2, batch-norm statistics). Samples are drawn through
the shared sampler (``modular.DenoiserSampling``) with classifier-free guidance against the empty prompt, as the
pipeline's guider does (its default scale 3.5 is ``generate.guidance_scale``'s to give).

The LoRA exports in diffusers' layout; FLUX.3's original (ComfyUI) key layout is not published with diffusers 0.42.1
(no converter of non-diffusers FLUX.3 LoRAs), so there is no second layout. FLUX.3 [distilled], a flow map on these
parts, is ``entries/flux3_distilled.py``.
"""

from __future__ import annotations

from zeropipe.families.diffusion.bases.flux3 import FLUX3, Flux3Prompts, Flux3Sampling, Flux3Trace
from zeropipe.families.diffusion.core import Architecture


ARCHITECTURE = Architecture(
    record=FLUX3,
    call=Flux3Trace(),
    prompts=Flux3Prompts(per_prompt=True, arguments={"max_sequence_length": 512}),
    sampling=Flux3Sampling(),
)
