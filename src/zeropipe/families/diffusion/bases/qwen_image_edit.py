"""Qwen-Image-Edit: Qwen-Image's transformer trained on (control image, instruction, target image) triples.

As ``QwenImageEditPipeline`` conditions it, the control image enters twice:

- through the VAE: its latents (the distribution's mode, normalised like the target's) are
  packed 2x2 into tokens and appended after the noisy target's tokens; ``img_shapes`` lists
  both grids, and only the target's tokens of the output are the prediction;
- through Qwen2.5-VL: the prompt is the pipeline's edit chat template with the image in the
  user turn (``<|vision_start|><|image_pad|><|vision_end|>``), so the text embeddings depend
  on the image; the template's first 64 tokens are dropped, as the pipeline does.

Training takes the control image at its target's bucket and crop (``data.control_path``,
matched by file name), so both token grids are the same size; its latents are cached with the
target's and the text embeddings per (caption, control image). The pipeline itself resizes the
control image to about a megapixel at inference (its ``calculate_dimensions``), which matches
training at ``resolution: 1024``; samples during training go through the pipeline, so they see
what inference sees.

Qwen-Image-Edit-2509 and -2511 (``QwenImageEditPlusPipeline``, several reference images, each
given to the VL model at about 384x384) are their own entry, ``qwen_image_edit_plus.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch

from zeropipe.families.diffusion.bases.qwen_image import ARCHITECTURE as QWEN_IMAGE
from zeropipe.families.diffusion.bases.qwen_image import QwenImageCall, QwenImagePrompts, QwenImageSampling, prompt_mask
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.parts import ControlImage, PromptWithControlImage
from zeropipe.families.diffusion.sampler import denoise
from zeropipe.families.diffusion.tiny.tokenizers import CHARACTERS, CHAT_TOKENS, tiny_edit_tokenizer, VISION_TOKENS


class PromptProcessor:
    """What ``Qwen2VLProcessor(text=..., images=...)`` returns for the pipeline's prompt encoding, from its image processor and tokenizer.

    transformers builds a Qwen2VLProcessor only where torchvision is installed (its video
    processor needs it), which a training machine need not have for images. This does the
    processor's part for images: each ``<|image_pad|>`` of a text becomes one token per 2x2
    merged patch of its image (``image_grid_thw``), then the texts are tokenized; the image
    processor's ``pixel_values`` and ``image_grid_thw`` come along.
    """

    image_token = "<|image_pad|>"

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor

    def __call__(self, text, images, padding=True, return_tensors="pt"):
        from transformers import BatchFeature

        pictures = self.image_processor(images=images, return_tensors=return_tensors)
        counts = iter((pictures["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2).tolist())
        expanded = []
        for line in text:
            first, *rest = line.split(self.image_token)
            expanded.append(first + "".join(self.image_token * next(counts) + piece for piece in rest))
        return BatchFeature({**self.tokenizer(expanded, padding=padding, return_tensors=return_tensors), **pictures})


@functools.cache
def as_transformers_processor(cls: type) -> type:
    """``cls`` as a subclass of transformers' ``ProcessorMixin`` (its own methods first), built on first use.

    diffusers' ``from_pretrained`` accepts a pipeline's ``processor`` argument only if it is one
    (``pipeline_loading_utils``: ``issubclass(model_cls, expected_class_obj)``); the stand-ins are made this
    way so that importing the entries does not import transformers' processing machinery.
    """
    from transformers import ProcessorMixin

    return type(cls.__name__, (cls, ProcessorMixin), {"__repr__": object.__repr__, "__module__": cls.__module__})


class QwenImageEditPrompts(QwenImagePrompts):
    """The prompt with its control image, through the pipeline's edit template; the tiny preset's processor folder."""

    def tiny_tokenizer(self, tokenizer):
        return tiny_edit_tokenizer(self.record.tokenizer_length(tokenizer))

    def tiny_prompt_processor(self, processor, parts, folder):
        """The processor folder's image processor, making few patches of a small image (56x56 to 112x112 pixels: 4 to 16 image tokens)."""
        from transformers import Qwen2VLImageProcessor

        Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(str(folder))

    def load_prompt_processor(self, pipeline_dir, processor, parts):
        from transformers import Qwen2VLImageProcessor

        return as_transformers_processor(PromptProcessor)(parts["tokenizer"], Qwen2VLImageProcessor.from_pretrained(str(pipeline_dir / processor)))

    def encode_prompts(self, pipeline, prompts, device):
        raise NotImplementedError("Qwen-Image-Edit encodes every prompt with its control image (encode_prompts_with_images)")

    def encode_prompts_with_images(self, pipeline, prompts, images, device):
        """Each prompt encoded with its control image (``PromptWithControlImage``)."""
        embeds, mask = pipeline.encode_prompt(prompt=prompts, image=images, device=device)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": prompt_mask(embeds, mask)}


class QwenImageEditCall(QwenImageCall):
    """The control image's latents (the same grid as the target's) appended after the target's tokens."""

    def images(self, condition, dtype):
        return [condition["control_latents"].to(dtype)]

    def trace_images(self, config, latent, dtype):
        # The control image's tokens double the image sequence (at the target's size).
        return {"control_latents": torch.randn(1, config.in_channels // 4, 1, latent, latent, dtype=dtype)}


class QwenImageEditSampling(QwenImageSampling):
    @torch.no_grad()
    def draw(self, pipeline, kwargs):
        """QwenImageEditPipeline's denoising steps, in the shared loop (``sampler.denoise``), with the control image at the sample size.

        The pipeline's own call resizes the control image to about a megapixel whatever the
        output size (``calculate_dimensions(1024 * 1024, ...)``): that is training's size only
        at ``resolution: 1024``, and for a tiny test pipeline 16k control tokens. This is its
        loop step for step, with its own methods (``prepare_latents`` encodes and packs the
        control image, ``_pack_latents``, the scheduler's shifted sigmas), the control image at
        the size training gave it: the target's.
        """
        import numpy as np
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_shift, retrieve_timesteps

        image = kwargs["image"]  # the control image (the control image part gives each prompt's)
        embeds, mask = kwargs["prompt_embeds"], kwargs["prompt_embeds_mask"]
        height, width, steps = kwargs["height"], kwargs["width"], kwargs["num_inference_steps"]
        device, dtype = embeds.device, embeds.dtype
        pixels = pipeline.image_processor.preprocess(image, height, width).unsqueeze(2)
        # Encoded here in the VAE's own dtype: prepare_latents casts the image to the latents' dtype before its VAE call, which fails
        # ("Input type (c10::BFloat16) and bias type (float)") when the samples run in bf16 beside a float32 VAE. Given latents, it packs them.
        encoded = pipeline._encode_vae_image(image=pixels.to(device, pipeline.vae.dtype), generator=kwargs["generator"])
        latents, control = pipeline.prepare_latents(
            encoded.to(dtype), 1, pipeline.transformer.config.in_channels // 4, height, width, dtype, device, kwargs["generator"]
        )
        control = control.to(dtype)
        grid = (1, height // pipeline.vae_scale_factor // 2, width // pipeline.vae_scale_factor // 2)
        config = pipeline.scheduler.config
        mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(pipeline.scheduler, steps, device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        pipeline.scheduler.set_begin_index(0)
        scale = kwargs["true_cfg_scale"]

        def predict(prompt, prompt_mask, t, latents):
            out = pipeline.transformer(
                hidden_states=torch.cat([latents, control], dim=1), timestep=t.expand(1).to(dtype) / 1000, encoder_hidden_states=prompt,
                encoder_hidden_states_mask=prompt_mask, img_shapes=[[grid, grid]], return_dict=False,
            )[0]
            return out[:, : latents.shape[1]]

        def model_output(index, t, latents):
            prediction = predict(embeds, mask, t, latents)
            if scale > 1:  # the pipeline's true classifier-free guidance, rescaled to the conditional prediction's norm
                negative = predict(kwargs["negative_prompt_embeds"], kwargs["negative_prompt_embeds_mask"], t, latents)
                combined = negative + scale * (prediction - negative)
                prediction = combined * (prediction.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
            return prediction

        return denoise(pipeline.scheduler, latents, timesteps, model_output)


def _preset() -> dict:
    """tiny-qwen-image with the vision tokens' ids in the text encoder's config and room for the edit template."""
    preset = copy.deepcopy(QWEN_IMAGE.record.preset)
    encoder = preset["text_encoder"]
    first = len(CHAT_TOKENS) + 1 + len(CHARACTERS)  # where tiny_edit_tokenizer puts the vision tokens
    ids = {token: first + number for number, token in enumerate(VISION_TOKENS)}
    encoder["text_config"]["max_position_embeddings"] = 1024
    encoder.update({"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"], "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]})
    return preset


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        QWEN_IMAGE.record,
        name="qwen-image-edit",
        pipeline_class="QwenImageEditPipeline",
        related_pipelines=("QwenImageEditInpaintPipeline",),
        preset_name="tiny-qwen-image-edit",
        preset=_preset(),
        # The text encoder sees the control image too; its latents are appended to the target's tokens.
        text=PromptWithControlImage(processors=("processor",)),
        conditions=(ControlImage(),),
        tokenizer_lengths={"tokenizer": 1024},  # the edit template alone is about 400 characters, one token each in the tiny tokenizer
    ),
    call=QwenImageEditCall(),
    prompts=QwenImageEditPrompts(),
    sampling=QwenImageEditSampling(),
    layouts=QWEN_IMAGE.layouts,
)

__all__ = ["ARCHITECTURE", "CHAT_TOKENS", "QwenImageEditCall", "QwenImageEditPrompts", "QwenImageEditSampling"]
