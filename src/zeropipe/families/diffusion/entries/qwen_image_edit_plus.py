"""Qwen-Image-Edit-Plus (Qwen-Image-Edit-2509 and -2511): Qwen-Image's transformer trained to edit several reference images into one target.

As ``QwenImageEditPlusPipeline`` conditions it, every reference image enters twice:

- through the VAE: each reference's latents (the distribution's mode, normalised like the
  target's) are packed 2x2 into tokens and appended, in order, after the noisy target's tokens;
  ``img_shapes`` lists the target's grid and then each reference's, and only the target's tokens
  of the output are the prediction. (2511's transformer has ``zero_cond_t``: it gives the
  reference tokens timestep 0 itself, from ``img_shapes``.)
- through Qwen2.5-VL: the prompt is the edit chat template with ``Picture 1: <|vision_start|>
  <|image_pad|><|vision_end|>Picture 2: ...`` before the instruction, each reference resized to
  about 384x384 pixels at its aspect ratio (the pipeline's ``CONDITION_IMAGE_SIZE``); the
  template's first 64 tokens are dropped, as the pipeline does. The pipeline encodes one prompt
  per call (it refuses batches), and so does ``encode_prompts_with_images``.

Training takes each reference at its target's bucket and crop (``data.control_paths`` or
``data.control_path``, see ``parts/reference_images.py``), so every grid is the target's; the
pipeline itself resizes each reference to about a megapixel at inference (``VAE_IMAGE_SIZE``),
which matches training at ``resolution: 1024`` with references of the target's aspect ratio.
Samples run the pipeline's loop with the references at the sample size (``QwenImageEditPlusSampling.draw``).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from zeropipe.families.diffusion.bases.qwen_image import prompt_mask
from zeropipe.families.diffusion.bases.qwen_image_edit import ARCHITECTURE as QWEN_IMAGE_EDIT
from zeropipe.families.diffusion.bases.qwen_image_edit import QwenImageEditCall, QwenImageEditPrompts, QwenImageEditSampling
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import PromptWithReferenceImages, ReferenceImages
from zeropipe.families.diffusion.sampler import denoise

# The planner traces two references (the pipeline takes up to three; the official examples use two).
TRACE_REFERENCES = 2


class QwenImageEditPlusPrompts(QwenImageEditPrompts):
    def encode_prompts_with_images(self, pipeline, prompts, images, device):
        """Per prompt its list of reference images, encoded as the pipeline's ``__call__`` does (its condition images), one prompt per call."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

        rows = []
        for prompt, references in zip(prompts, images):
            resized = []
            for image in references:
                width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
                resized.append(pipeline.image_processor.resize(image, height, width))
            embeds, mask = pipeline.encode_prompt(prompt=[prompt], image=resized, device=device)
            rows.append((embeds[0], prompt_mask(embeds, mask)[0]))
        length = max(embeds.shape[0] for embeds, _ in rows)
        # Padded as the pipeline pads a batch: zeros, masked out.
        embeds = torch.stack([torch.cat([e, e.new_zeros(length - e.shape[0], e.shape[1])]) for e, _ in rows])
        mask = torch.stack([torch.cat([m, m.new_zeros(length - m.shape[0])]) for _, m in rows])
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


class QwenImageEditPlusCall(QwenImageEditCall):
    """Every reference's latents (B, N, C, 1, H, W; each the target's grid) appended, in order, after the target's tokens."""

    def images(self, condition, dtype):
        references = condition["reference_latents"].to(dtype)
        return [references[:, number] for number in range(references.shape[1])]

    def trace_images(self, config, latent, dtype):
        return {"reference_latents": torch.randn(1, TRACE_REFERENCES, config.in_channels // 4, 1, latent, latent, dtype=dtype)}


class QwenImageEditPlusSampling(QwenImageEditSampling):
    @torch.no_grad()
    def draw(self, pipeline, kwargs):
        """QwenImageEditPlusPipeline's denoising loop with the reference images at the sample size.

        The pipeline's own call resizes every reference to about a megapixel whatever the output
        size (``VAE_IMAGE_SIZE``): training's size only at ``resolution: 1024``, and for a tiny test
        pipeline 16k tokens per reference. This is its loop step for step, with its own methods
        (``prepare_latents`` encodes, packs and concatenates the references; the scheduler's
        shifted sigmas; true CFG rescaled to the conditional norm), each reference at the size
        training gave it: the target's.
        """
        import numpy as np
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_shift, retrieve_timesteps

        images = kwargs["image"]  # the reference images (the reference images part gives each prompt its item's)
        images = images if isinstance(images, list) else [images]
        embeds, mask = kwargs["prompt_embeds"], kwargs["prompt_embeds_mask"]
        height, width, steps = kwargs["height"], kwargs["width"], kwargs["num_inference_steps"]
        device, dtype = embeds.device, embeds.dtype
        pixels = [pipeline.image_processor.preprocess(image, height, width).unsqueeze(2).to(device, pipeline.vae.dtype) for image in images]
        # Encoded here in the VAE's own dtype (prepare_latents casts images to the latents' dtype before its VAE call: bf16 samples beside a
        # float32 VAE fail); given latents, it packs them.
        pixels = [pipeline._encode_vae_image(image=image, generator=kwargs["generator"]).to(dtype) for image in pixels]
        latents, references = pipeline.prepare_latents(pixels, 1, pipeline.transformer.config.in_channels // 4, height, width, dtype, device, kwargs["generator"])
        references = references.to(dtype)
        grid = (1, height // pipeline.vae_scale_factor // 2, width // pipeline.vae_scale_factor // 2)
        shapes = [[grid] * (1 + len(images))]
        config = pipeline.scheduler.config
        mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(pipeline.scheduler, steps, device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        pipeline.scheduler.set_begin_index(0)
        scale = kwargs["true_cfg_scale"]

        def predict(prompt, prompt_mask, t, latents):
            out = pipeline.transformer(
                hidden_states=torch.cat([latents, references], dim=1), timestep=t.expand(1).to(dtype) / 1000, guidance=None,
                encoder_hidden_states_mask=prompt_mask, encoder_hidden_states=prompt, img_shapes=shapes, return_dict=False,
            )[0]
            return out[:, : latents.shape[1]]

        def model_output(index, t, latents):
            prediction = predict(embeds, mask, t, latents)
            if scale > 1:
                negative = predict(kwargs["negative_prompt_embeds"], kwargs["negative_prompt_embeds_mask"], t, latents)
                combined = negative + scale * (prediction - negative)
                prediction = combined * (prediction.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
            return prediction

        return denoise(pipeline.scheduler, latents, timesteps, model_output)


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        QWEN_IMAGE_EDIT.record,
        name="qwen-image-edit-plus",
        pipeline_class="QwenImageEditPlusPipeline",
        related_pipelines=(),
        preset_name="tiny-qwen-image-edit-plus",
        preset=copy.deepcopy(QWEN_IMAGE_EDIT.record.preset),
        # The text encoder sees every reference image; their latents are appended to the target's tokens, in order.
        text=PromptWithReferenceImages(processors=("processor",)),
        conditions=(ReferenceImages(),),
    ),
    call=QwenImageEditPlusCall(),
    prompts=QwenImageEditPlusPrompts(),
    sampling=QwenImageEditPlusSampling(),
    layouts=QWEN_IMAGE_EDIT.layouts,
)

__all__ = ["ARCHITECTURE"]
