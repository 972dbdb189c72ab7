"""FLUX.3: a rectified-flow MMDiT on FLUX.2's patched latents, conditioned on eight stacked hidden layers of Qwen3-VL (diffusers: modular only).

``Flux3Transformer2DModel`` takes the image tokens (FLUX.2's VAE latents, patched 2x2 into 128 channels and
normalised by the VAE's batch-norm statistics: the ``Flux2Latents`` codec), one token per latent pixel with 4-axis
position ids ``(t, h, w, l)`` whose spatial axes are scaled by 0.5 (``Flux3PrepareLatentsStep``), the text context
(Qwen3-VL's hidden states 4, 8, ..., 32 stacked along the features) with its own ids along ``l``
(``Flux3TextRoPEInputsStep``), and the flow timestep ``t / 1000``. Its output is the noise-ward velocity the
scheduler steps on, the objective's target as it is. The text window is the chat-templated prompt right-padded to a
multiple of 80 tokens, and the transformer attends to that padding (``Flux3TextEncoderStep``): each prompt is
called at its own window, so a batch of prompts of different windows is called one sample at a time.

This module builds those inputs with the modular pipeline's own helpers, so the call is ``Flux3LoopDenoiser``'s
(held to it in ``tests/unit/diffusion/test_flux3.py``); the entry is ``entries/flux3.py``.
FLUX.3 [distilled] (``Flux3DistilledModularPipeline``, ``entries/flux3_distilled.py``) is a flow map
(``flow_map=True``): each call also takes the timestep the step jumps to, ``target_timestep`` (a condition entry,
``TARGET``: in scheduler units, as ``timesteps``), and ``Flux3DistilledLoopDenoiser`` calls it so, without guidance
(held to it in ``tests/unit/diffusion/test_flux3_distilled.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from zeropipe.families.diffusion.bases.qwen3_vl_text import load_processor
from zeropipe.families.diffusion.parts.flow_map import GRADIENT_BATCH, GRADIENT_FREE_BATCH
from zeropipe.families.diffusion.core import Record
from zeropipe.families.diffusion.modular import DenoiserSampling, TextEncoderBlock
from zeropipe.families.diffusion.parts import PromptText
from zeropipe.families.diffusion.parts.latents import Flux2Latents
from zeropipe.families.diffusion.roles import DenoiserCall
from zeropipe.families.diffusion.tiny.components import tiny_flux2_vae, tiny_qwen3_vl_generation
from zeropipe.families.diffusion.tiny.tokenizers import QWEN3_CHAT_TEMPLATE, character_qwen_tokenizer

TARGET = "target_timestep"  # a flow map's condition entry: the timestep each call jumps to (scheduler units), FLUX.3 [distilled]'s
IMAGE_ROPE_SCALE = 0.5  # Flux3PrepareLatentsStep's default: the image ids' h and w axes are scaled by it


def image_ids(height: int, width: int) -> torch.Tensor:
    """The image tokens' position ids, by the modular pipeline's own helper."""
    from diffusers.modular_pipelines.flux3.before_denoise import _prepare_image_ids

    return _prepare_image_ids(height, width, IMAGE_ROPE_SCALE)


def text_ids(embeds: torch.Tensor) -> torch.Tensor:
    """The text tokens' position ids (one per token along ``l``), by the modular pipeline's own helper."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep

    return Flux3TextRoPEInputsStep._prepare_text_ids(embeds)


class Flux3Call(DenoiserCall):
    """``Flux3LoopDenoiser``'s call: packed image tokens, each prompt at its own window (``prompt_embeds_mask``), ``t / 1000``."""

    def call_one(self, model, latents: torch.Tensor, timesteps: torch.Tensor, embeds: torch.Tensor, context, target: torch.Tensor | None = None) -> torch.Tensor:
        """One window's call; ``target``: a flow map's jump-to timesteps (``Flux3DistilledLoopDenoiser``: ``target_timestep``, also over 1000)."""
        batch, channels, height, width = latents.shape
        jump = {} if target is None else {"target_timestep": (target.float() / 1000).to(context.dtype)}
        out = model(
            hidden_states=latents.flatten(2).transpose(1, 2).to(context.dtype), encoder_hidden_states=embeds.to(context.dtype),
            timestep=(timesteps.float() / 1000).to(context.dtype), img_ids=image_ids(height, width).to(latents.device),
            txt_ids=text_ids(embeds).to(latents.device), return_dict=False, **jump,
        )[0]
        return out.transpose(1, 2).reshape(batch, channels, height, width)

    def predict(self, model, model_input, timesteps, condition, context):
        mask = condition["prompt_embeds_mask"].bool()
        lengths = mask.sum(dim=1)
        target = condition.get(TARGET)
        if bool((lengths == lengths[0]).all()):
            return self.call_one(model, model_input, timesteps, condition["prompt_embeds"][:, : int(lengths[0])], context, target)
        return torch.cat([
            self.call_one(model, model_input[index : index + 1], timesteps[index : index + 1], condition["prompt_embeds"][index : index + 1, : int(lengths[index])], context,
                          None if target is None else target[index : index + 1])
            for index in range(model_input.shape[0])
        ])


def trace_inputs(config, latent: int, text_tokens: int, dtype: torch.dtype) -> dict:
    """The transformer's keyword arguments for one example of this size, made on the current (meta) device: 2x2-patched latents, one window of text."""
    tokens = (latent // 2) ** 2
    inputs = {
        "hidden_states": torch.randn(1, tokens, config.in_channels, dtype=dtype), "timestep": torch.tensor([0.5], dtype=dtype),
        "encoder_hidden_states": torch.randn(1, text_tokens, config.joint_attention_dim, dtype=dtype),
        "img_ids": torch.zeros(tokens, 4), "txt_ids": torch.zeros(text_tokens, 4),
    }
    if getattr(config, "flow_map", False):  # FLUX.3 [distilled]: the transformer requires the timestep it jumps to
        inputs["target_timestep"] = torch.tensor([0.25], dtype=dtype)
    return inputs


class Flux3DistilledCall(Flux3Call):
    """FLUX.3 [distilled]'s call (``Flux3DistilledLoopDenoiser``: one pass, no guidance, ``target_timestep`` the step's next
    timestep), trained with the flow-map objective (``parts/flow_map.py``). Without a ``TARGET`` in the condition the call
    is the map's diagonal (``target_timestep = timestep``): the instantaneous velocity, the flow objective's target."""

    gradient_batch, gradient_free_batch = GRADIENT_BATCH, GRADIENT_FREE_BATCH  # the flow-map objective's calls, for the planner

    def predict(self, model, model_input, timesteps, condition, context):
        if TARGET not in condition:
            condition = {**condition, TARGET: timesteps}
        return super().predict(model, model_input, timesteps, condition, context)

    def loss(self, model, noised, condition, context):
        from zeropipe.families.diffusion.parts.flow_map import flow_map_loss

        def jump(latents, t, s, given):
            return self.predict(model, latents, t, {**given, TARGET: s}, context)

        return flow_map_loss(jump, noised, condition)


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


TINY_PRESET = {  # the tiny-flux3 preset; FLUX.3 [distilled]'s is this with the transformer a flow map
    "transformer": {
        "in_channels": 16, "cond_in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
        "joint_attention_dim": 8 * 32, "timestep_channels": 32, "axes_dims_rope": [4, 4, 4, 4],
    },
    "vae": tiny_flux2_vae(),
    "text_encoder": {**tiny_qwen3_vl_generation(), "text_config": {**tiny_qwen3_vl_generation()["text_config"], "num_hidden_layers": TINY_TEXT_LAYERS}},
    "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
}


# FLUX.3's record: the entries `flux3` and `flux3-distilled` (its step-distilled flow map, dataclasses.replace of it) take it.
FLUX3 = Record(
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
    preset=TINY_PRESET,
    trace_tokens=160,  # two of the block's 80-token windows
    image_processor_patch=2,
)
