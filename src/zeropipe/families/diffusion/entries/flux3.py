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
(no converter of non-diffusers FLUX.3 LoRAs), so there is no second layout. FLUX.3 [distilled] is a flow-map model
and not an entry (docs/diffusion.md, "Not done yet").
"""

from __future__ import annotations

from pathlib import Path

from zeropipe.families.diffusion.bases.flux3 import Flux3Call, trace_inputs
from zeropipe.families.diffusion.bases.qwen3_vl_text import load_processor
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.modular import DenoiserSampling, TextEncoderBlock
from zeropipe.families.diffusion.parts import PromptText
from zeropipe.families.diffusion.parts.latents import Flux2Latents
from zeropipe.families.diffusion.tiny.components import tiny_flux2_vae, tiny_qwen3_vl_generation
from zeropipe.families.diffusion.tiny.tokenizers import QWEN3_CHAT_TEMPLATE, character_qwen_tokenizer

PROCESSOR = "tokenizer"  # the pipeline's component: an AutoProcessor (Qwen3VLProcessor), under the name `tokenizer`
TINY_TEXT_LAYERS = 33  # the block taps hidden states 4, 8, ..., 32: a tiny Qwen3-VL needs 33 layers


class Flux3Prompts(TextEncoderBlock):
    def tiny_prompt_processor(self, processor, parts, folder):
        tokenizer = character_qwen_tokenizer(256)
        tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
        tokenizer.save_pretrained(str(folder))

    def load_prompt_processor(self, pipeline_dir, processor, parts):
        return load_processor(Path(pipeline_dir) / processor)


class Flux3Trace(Flux3Call):
    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        return trace_inputs(config, latent_side, text_tokens, dtype)


class Flux3Sampling(DenoiserSampling):
    def timesteps(self, scheduler, steps, tokens, device):
        """``Flux3SetTimestepsStep``'s: sigmas ``linspace(1, 1/steps, steps)`` on the scheduler's own (constant) shift."""
        import numpy as np

        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps).tolist(), device=device)
        return scheduler.timesteps

    def latent_shape(self, config, batch, height, width, factor):
        return (batch, config.in_channels, height // (factor * 2), width // (factor * 2))  # latents patched 2x2


ARCHITECTURE = Architecture(
    record=Record(
        name="flux3",
        pipeline_class="Flux3ModularPipeline",
        denoiser="transformer",
        denoiser_class="Flux3Transformer2DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=(),  # the tokenizer is the processor's (the `tokenizer` component), loaded with it
        text=PromptText(processors=(PROCESSOR,)),
        patch_factor=2,
        codec=Flux2Latents(vae_class="AutoencoderKLFlux2"),
        preset_name="tiny-flux3",
        preset={
            "transformer": {
                "in_channels": 16, "cond_in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                "joint_attention_dim": 8 * 32, "timestep_channels": 32, "axes_dims_rope": [4, 4, 4, 4],
            },
            "vae": tiny_flux2_vae(),
            "text_encoder": {**tiny_qwen3_vl_generation(), "text_config": {**tiny_qwen3_vl_generation()["text_config"], "num_hidden_layers": TINY_TEXT_LAYERS}},
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
        },
        trace_tokens=160,  # two of the block's 80-token windows
        image_processor_patch=2,
    ),
    call=Flux3Trace(),
    prompts=Flux3Prompts(per_prompt=True, arguments={"max_sequence_length": 512}),
    sampling=Flux3Sampling(),
)
