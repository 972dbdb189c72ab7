"""Qwen-Image-Layered: Qwen-Image's transformer trained to split an image into RGBA layers (image decomposition).

What ``QwenImageLayeredPipeline`` (diffusers 0.42) does, and what the entry takes from it:

- **Latents.** The RGBA-VAE (``AutoencoderKLQwenImage`` with ``input_channels: 4``: Qwen-Image's VAE with a fourth
  channel in its first and last convolutions) encodes every image alone, one frame each, normalised per channel.
  The image to decompose goes in as RGB made RGBA with an opaque alpha; the layers keep their alpha.
- **The denoised stack.** ``layers + 1`` frames, packed 2x2 into tokens frame after frame
  (``QwenImageLayeredPipeline._pack_latents``): the image itself first, then each layer (bottom first). The
  training target's latents (the codec's, one frame) are that first frame; the layers (the ``ImageLayers``
  condition, ``parts/image_layers.py``) are noised at the same level by the entry's ``loss`` and predicted with it,
  both in the loss, as the stack the pipeline denoises.
- **The denoiser call.** The stack's tokens, then the image's own latents (the distribution's mode, normalised) as
  a condition frame; ``img_shapes`` lists every frame's grid (the layered 3D rotary embedding,
  ``use_layer3d_rope``, gives each layer its index and the condition index -1), ``additional_t_cond`` is the
  pipeline's ``is_rgb`` (0), and only the stack's tokens of the output are the prediction. A stack of one frame is
  the model asked for zero layers (the image alone), which the pipeline allows too.
- **Prompts.** Qwen-Image's: ``encode_prompt`` with the same template and drop (34 tokens), a mask per caption.
  The pipeline captions the image with Qwen2.5-VL (its ``processor``) where no prompt is given; training gives
  every image its caption, so the processor is not loaded.
- **Samples.** The pipeline's call cannot draw training's samples: it resizes the image to 640 or 1024 px
  (``resolution``) whatever the sample size, and captions the image whenever ``prompt`` is empty even with
  ``prompt_embeds`` given. ``QwenImageLayeredSampling`` is its loop step for step (its own ``prepare_latents``,
  sigmas, ``mu`` and true classifier-free guidance, without ``cfg_normalize``, the pipeline's default) in the shared
  ``sampler.denoise``, the image at the sample size; ``tests/unit/diffusion/test_qwen_image_layered.py`` holds it
  equal to the pipeline's call. The image's sample is the first frame; each layer is written as an RGBA PNG beside it.

The LoRA's original layout is Qwen-Image's (diffusers' module names under ``diffusion_model.``), which ComfyUI loads
for Qwen-Image-Layered (it is Qwen-Image's model with the layered rotary embedding and one more embedding).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from zeropipe.families.diffusion.bases.qwen_image import ARCHITECTURE as QWEN_IMAGE
from zeropipe.families.diffusion.bases.qwen_image import QwenImageSampling
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts.image_layers import ImageLayers
from zeropipe.families.diffusion.parts.latents import QwenImage21Latents
from zeropipe.families.diffusion.roles import DenoiserCall
from zeropipe.families.diffusion.sampler import denoise

# The planner traces four layers, the pipeline's default (``layers=4``): five frames denoised and the image's.
TRACE_LAYERS = 4
IS_RGB = 0  # the pipeline's additional_t_cond (``is_rgb``) for every image


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, F, H, W) latents -> (B, F x H/2 x W/2, 4C) tokens, frame after frame, as QwenImageLayeredPipeline._pack_latents."""
    from diffusers import QwenImageLayeredPipeline

    batch, channels, frames, height, width = latents.shape
    return QwenImageLayeredPipeline._pack_latents(latents.permute(0, 2, 1, 3, 4), batch, channels, height, width, frames)


class QwenImageLayeredCall(DenoiserCall):
    def inputs(self, model_input, timesteps, condition, context):
        batch, _, frames, height, width = model_input.shape  # the image, then each layer
        grid = (1, height // 2, width // 2)
        image = condition["image_latents"].to(model_input.dtype)  # (B, C, 1, h, w): the condition frame
        return {
            "hidden_states": torch.cat([pack(model_input), pack(image)], dim=1), "timestep": (timesteps / 1000).to(context.dtype),
            "encoder_hidden_states": condition["prompt_embeds"], "encoder_hidden_states_mask": condition.get("prompt_embeds_mask"),
            "img_shapes": [[grid] * frames + [grid]] * batch,
            "additional_t_cond": torch.full((batch,), IS_RGB, dtype=torch.long, device=model_input.device),
        }

    def predict(self, model, model_input, timesteps, condition, context):
        from diffusers import QwenImageLayeredPipeline

        _, _, frames, height, width = model_input.shape
        out = model(**self.inputs(model_input, timesteps, condition, context), return_dict=False)[0][:, : frames * (height // 2) * (width // 2)]
        factor = context.vae_factor
        return QwenImageLayeredPipeline._unpack_latents(out, height * factor, width * factor, frames - 1, factor)

    def loss(self, model, noised, condition, context):
        """The image's and every layer's velocity errors, the layers noised at the image's level (one stack, as the pipeline denoises it)."""
        from zeropipe.families.diffusion.objectives import weighted_mse

        layers = condition["layer_latents"].float().squeeze(3).permute(0, 2, 1, 3, 4)  # (B, layers, C, 1, h, w) -> (B, C, layers, h, w)
        # The flow objective's timesteps are sigma * 1000 (the transformer is given sigma, as predict gives it).
        sigma = (noised.timesteps.float() / 1000).view(-1, 1, 1, 1, 1).to(layers)
        noise = torch.randn(layers.shape, dtype=torch.float32).to(layers)  # this rank's stream, saved with checkpoints
        noisy = (1 - sigma) * layers + sigma * noise
        stack = torch.cat([noised.model_input, noisy.to(noised.model_input.dtype)], dim=2)
        target = torch.cat([noised.target, (noise - layers).to(noised.target.dtype)], dim=2)
        return weighted_mse(self.predict(model, stack, noised.timesteps, condition, context), target, noised.weights)

    def trace_batch(self, config, latent, latent_frames, text_tokens, dtype):
        channels = config.in_channels // 4
        return (
            torch.randn(1, channels, 1 + TRACE_LAYERS, latent, latent, dtype=dtype), torch.tensor([500.0], dtype=dtype),
            {"prompt_embeds": torch.randn(1, text_tokens, config.joint_attention_dim, dtype=dtype), "image_latents": torch.randn(1, channels, 1, latent, latent, dtype=dtype)},
        )


class QwenImageLayeredSampling(QwenImageSampling):
    @torch.no_grad()
    def sample_outputs(self, pipeline, kwargs):
        """QwenImageLayeredPipeline's denoising loop on the image at the sample size: the image's frame, and the layers' latents as the VAE decodes them."""
        import numpy as np
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_layered import retrieve_timesteps

        image, layers = kwargs["image"], kwargs["layers"]  # the data item's image and its number of layers (the image layers part gives them)
        embeds, mask = kwargs["prompt_embeds"], kwargs["prompt_embeds_mask"]
        height, width, steps = kwargs["height"], kwargs["width"], kwargs["num_inference_steps"]
        device, dtype = embeds.device, embeds.dtype
        processor = pipeline.image_processor
        pixels = processor.preprocess(processor.resize(image, height, width), height, width).unsqueeze(2)
        # Encoded here in the VAE's own dtype (prepare_latents casts the image to the latents' dtype before its VAE call: bf16 samples beside a
        # float32 VAE fail); given latents, it packs them.
        encoded = pipeline._encode_vae_image(image=pixels.to(device, pipeline.vae.dtype), generator=kwargs["generator"])
        latents, image_latents = pipeline.prepare_latents(
            encoded.to(dtype), 1, pipeline.transformer.config.in_channels // 4, height, width, layers, dtype, device, kwargs["generator"]
        )
        grid = (1, height // pipeline.vae_scale_factor // 2, width // pipeline.vae_scale_factor // 2)
        shapes = [[grid] * (layers + 1) + [grid]]
        mu = (image_latents.shape[1] / (256 * 256 / 16 / 16)) ** 0.5  # the pipeline's shift, from the image's tokens
        timesteps, _ = retrieve_timesteps(pipeline.scheduler, steps, device, sigmas=np.linspace(1.0, 0, steps + 1)[:-1], mu=mu)
        pipeline.scheduler.set_begin_index(0)
        is_rgb = torch.full((1,), IS_RGB, dtype=torch.long, device=device)
        scale = kwargs["true_cfg_scale"]

        def predict(prompt, prompt_mask, t, latents):
            out = pipeline.transformer(
                hidden_states=torch.cat([latents, image_latents], dim=1), timestep=t.expand(1).to(dtype) / 1000, guidance=None,
                encoder_hidden_states_mask=prompt_mask, encoder_hidden_states=prompt, img_shapes=shapes, additional_t_cond=is_rgb, return_dict=False,
            )[0]
            return out[:, : latents.shape[1]]

        def model_output(index, t, latents):
            prediction = predict(embeds, mask, t, latents)
            if scale > 1:  # the pipeline's true classifier-free guidance (cfg_normalize off, its default)
                negative = predict(kwargs["negative_prompt_embeds"], kwargs["negative_prompt_embeds_mask"], t, latents)
                prediction = negative + scale * (prediction - negative)
            return prediction

        latents = denoise(pipeline.scheduler, latents, timesteps, model_output)
        stack = pipeline._unpack_latents(latents, height, width, layers, pipeline.vae_scale_factor)  # (B, C, layers + 1, h, w), normalised
        config = pipeline.vae.config
        mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1).to(stack)
        std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1).to(stack)
        # The image's frame goes to the codec (the shared code denormalises it); the layers as the pipeline decodes them.
        return stack[:, :, :1], {"layer_latents": stack[:, :, 1:] * std + mean}

    def draw(self, pipeline, kwargs):
        return self.sample_outputs(pipeline, kwargs)[0]

    def unpack_latents(self, pipeline, latents, size, vae_factor):
        return latents  # sample_outputs unpacked the stack already


def _preset() -> dict:
    """tiny-qwen-image with the layered transformer (its 3D rotary embedding, the is_rgb embedding) and the RGBA-VAE's four image channels."""
    preset = copy.deepcopy(QWEN_IMAGE.record.preset)
    preset["transformer"].update({"use_additional_t_cond": True, "use_layer3d_rope": True})
    preset["vae"]["input_channels"] = 4
    return preset


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        QWEN_IMAGE.record,
        name="qwen-image-layered",
        pipeline_class="QwenImageLayeredPipeline",
        related_pipelines=(),
        preset_name="tiny-qwen-image-layered",
        preset=_preset(),
        # The RGBA-VAE: the image given opaque, its samples written as RGB (the layers, with their alpha, by the image layers part).
        codec=QwenImage21Latents(vae_class="AutoencoderKLQwenImage"),
        conditions=(ImageLayers(),),
        # The processor serves only the pipeline's captioning of an image given without a prompt (Qwen2VLProcessor, which transformers
        # builds only with torchvision); every training image has its caption, so it is not loaded.
        pipeline_kwargs={"processor": None},
    ),
    call=QwenImageLayeredCall(),
    prompts=QWEN_IMAGE.prompts,
    sampling=QwenImageLayeredSampling(),
    layouts=QWEN_IMAGE.layouts,
)

__all__ = ["ARCHITECTURE"]
