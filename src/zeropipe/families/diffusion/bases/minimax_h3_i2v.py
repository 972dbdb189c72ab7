"""MiniMax-H3 image-to-video (the modular pipeline's ``fl2va`` workflow with its first keyframe, ``image``): the clip's first
frame conditions the video and its sound twice, as image tokens in the prompt and as a keyframe in the packed sequence.

- **The prompt** (``MiniMaxH3I2VPrompts``): the pipeline's own ``MiniMaxH3FL2VATextEncoderStep`` (the ``fl2va`` branch of its
  text-encoder step) encodes ``"<Picture 1>: "``, the frame's vision block (``<|vision_start|>``, one ``<|image_pad|>`` per
  merged 32x32 patch, ``<|vision_end|>``) and the prompt with Qwen3-VL; the vision block's rows are tagged video
  (``text_token_tags``), which the cache keeps beside the rows. Without torchvision the block is handed
  ``bases/qwen3_vl_text.ProcessorImagePath``: transformers' PIL backend of Qwen3-VL's image processor, and
  ``ProcessorMixin.create_mm_token_type_ids`` itself.
- **The keyframe** (``parts.SeededFirstFrame``): the first frame encoded alone, sampled under seed 42 and rounded to float16
  (``encode_vae_condition``), normalised as the clip's latents, noised to ``t = 0.999`` (``keyframe_noise_aug``) and packed as
  the leading video rows, anchored at the first latent frame (``MiniMaxH3PrepareLayoutStep.build_packed_sequence`` with
  ``keyframe_anchors=("first",)``) and held at ``max(t, 0.999)`` (``MiniMaxH3SetTimestepsStep``). The transformer's output
  for those rows is dropped (the pipeline's loop never writes them): the loss is the generated rows', as for ``minimax-h3``.

Held to the pipeline's blocks in ``tests/unit/diffusion/test_minimax_h3_i2v.py``.
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.bases.minimax_h3 import (
    AUDIO_CHANNELS, AUDIO_TAG, TEXT_TAG, VIDEO_TAG, MiniMaxH3Call, MiniMaxH3Prompts, MiniMaxH3Sampling, audio_sigma, unpatchify_video_rows,
)

KEYFRAME_T = 0.999  # MiniMaxH3ModularPipeline.keyframe_noise_aug: the t (1 is clean) a keyframe is noised to and held at
ENCODE_SEED = 42  # MiniMaxH3ModularPipeline.keyframe_encode_seed
FL2VA_BLOCK = ("text_encoder", "fl2va")  # the pipeline's text-encoder step and its image-to-video branch


def keyframe_sequence(config, text_token_tags: torch.Tensor, frames: int, height: int, width: int, audio_latents: int, device: torch.device):
    """The fl2va layout of one sample with its first keyframe, by the modular pipeline's own builder:
    (position_ids, token_tags, video_indices, audio_indices, text_indices, keyframe rows)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    built = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_token_tags.long().cpu(), frames, height, width, audio_latents, tuple(config.patch_size), AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG, ("first",),
    )
    return (*(tensor.to(device) for tensor in built[:5]), built[5])


def keyframe_timesteps(video_indices, audio_indices, keyframe_rows: int, text_tokens: int, video_t: float, audio_t: float):
    """(distinct timesteps, each row's index into them): the keyframe rows held at ``max(t, 0.999)``, as the pipeline's step plans them."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    return MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_indices.cpu(), audio_indices.cpu(), keyframe_rows, 0, text_tokens, video_t, audio_t, max(video_t, KEYFRAME_T), 1.0,
    )


def noised_keyframe(latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``MiniMaxH3Scheduler.scale_noise`` at the keyframe level: ``t x0 + (1 - t) noise``, t = 0.999."""
    level = torch.tensor(KEYFRAME_T, dtype=torch.float32, device=latents.device)
    return level * latents.float() + (1.0 - level) * noise.float()


class MiniMaxH3I2VCall(MiniMaxH3Call):
    """The packed-sequence call with the first keyframe ahead of the generated video rows.

    ``condition`` adds to the text-to-video call's: ``text_token_tags`` (B, L) (the prompt rows' modality tags: the vision
    block's are video), ``first_frame_latents`` (B, C, 1, H, W) and, where given, ``keyframe_noise`` of that shape (else a
    fixed-seed draw, so the same inputs give the same output).
    """

    def joint_predict(self, model, video, audio, sigmas, audio_sigmas, condition, context):
        from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

        module = getattr(model, "module", model)
        config = module.config
        patch = tuple(config.patch_size)
        _, channels, frames, height, width = video.shape
        keyframes = condition["first_frame_latents"]
        noise = condition.get("keyframe_noise")
        if noise is None:
            noise = torch.randn(keyframes.shape, generator=torch.Generator().manual_seed(1)).to(keyframes.device)
        videos, audios = [], []
        for index in range(video.shape[0]):
            keep = condition["prompt_embeds_mask"][index].bool()
            embeds = condition["prompt_embeds"][index][keep]
            tags = condition["text_token_tags"][index][keep].round().long()
            position_ids, token_tags, video_rows, audio_rows, text_rows, held = keyframe_sequence(
                config, tags, frames, height, width, audio.shape[1] // AUDIO_CHANNELS, video.device,
            )
            timestep, timestep_indices = keyframe_timesteps(video_rows, audio_rows, held, embeds.shape[0], float(1 - sigmas[index]), float(1 - audio_sigmas[index]))
            anchor = noised_keyframe(keyframes[index : index + 1].to(video.device), noise[index : index + 1].to(video.device))
            rows = torch.cat([patchify_video_latents(anchor, patch), patchify_video_latents(video[index : index + 1].float(), patch)])
            video_out, audio_out = model(
                hidden_states=rows[None].to(context.dtype), audio_hidden_states=audio[index : index + 1].to(context.dtype),
                encoder_hidden_states=embeds[None].to(context.dtype), timestep=timestep.to(video.device), timestep_indices=timestep_indices.to(video.device),
                token_tags=token_tags, position_ids=position_ids, video_indices=video_rows, audio_indices=audio_rows, text_indices=text_rows, return_dict=False,
            )
            videos.append(-unpatchify_video_rows(video_out[0][held:], channels, frames, height, width, patch))
            audios.append(-audio_out[0])
        return torch.cat(videos), torch.stack(audios)

    def loss(self, model, noised, condition, context):
        """The text-to-video loss with one keyframe noise draw per step (this rank's stream), the same for the prompt's and the
        unconditional pass of the guidance-preserving objective."""
        keyframes = condition["first_frame_latents"]
        noise = torch.randn(keyframes.shape, dtype=torch.float32).to(keyframes.device)
        return super().loss(model, noised, {**condition, "keyframe_noise": noise}, context)

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        """The text-to-video trace with the keyframe's rows (one latent frame) ahead of the video's."""
        inputs = super().trace_inputs(config, latent_side, latent_frames, text_tokens, dtype)
        _, ph, pw = tuple(config.patch_size)
        per_frame = (latent_side // ph) * (latent_side // pw)
        rows, width = inputs["hidden_states"].shape[1:]
        audio = inputs["audio_hidden_states"].shape[1] // AUDIO_CHANNELS
        here, cpu = torch.empty(0).device, torch.device("cpu")
        with cpu:
            layout = keyframe_sequence(config, torch.full((text_tokens,), TEXT_TAG), rows // per_frame, latent_side, latent_side, audio, cpu)
            timesteps = keyframe_timesteps(layout[2], layout[3], layout[5], text_tokens, 0.5, float(1 - audio_sigma(torch.tensor(0.5))))
        position_ids, tags, video_rows, audio_rows, text_rows = (tensor.to(here) for tensor in layout[:5])
        timestep, timestep_indices = (tensor.to(here) for tensor in timesteps)
        return {
            **inputs, "hidden_states": torch.randn(1, rows + per_frame, width, dtype=dtype), "timestep": timestep, "timestep_indices": timestep_indices,
            "token_tags": tags, "position_ids": position_ids, "video_indices": video_rows, "audio_indices": audio_rows, "text_indices": text_rows,
        }


class MiniMaxH3I2VPrompts(MiniMaxH3Prompts):
    """Each prompt with its first frame through the pipeline's own ``MiniMaxH3FL2VATextEncoderStep``, one call per prompt (it
    takes one), each prompt's rows and their modality tags cached at its own length with a mask."""

    def encode_prompts(self, pipeline, prompts, device):
        raise NotImplementedError("MiniMax-H3 image-to-video encodes every prompt with its first frame (encode_prompts_with_images)")

    def encode_prompts_with_images(self, pipeline, prompts, images, device):
        from zeropipe.families.diffusion.modular import run_block

        block = pipeline.blocks.sub_blocks[FL2VA_BLOCK[0]].sub_blocks[FL2VA_BLOCK[1]]
        runs = [run_block(pipeline, block, ("prompt_embeds", "text_token_tags"), prompt=prompt, keyframes=[image]) for prompt, image in zip(prompts, images)]
        length = max(run["prompt_embeds"].shape[1] for run in runs)
        embeds = torch.stack([torch.nn.functional.pad(run["prompt_embeds"][0], [0, 0, 0, length - run["prompt_embeds"].shape[1]]) for run in runs])
        tags = torch.stack([torch.nn.functional.pad(run["text_token_tags"], [0, length - run["text_token_tags"].shape[0]]) for run in runs])
        mask = torch.stack([torch.arange(length) < run["text_token_tags"].shape[0] for run in runs]).long()
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask.to(embeds.device), "text_token_tags": tags.to(embeds.device)}

    def tiny_tokenizer(self, tokenizer):
        from zeropipe.families.diffusion.tiny.tokenizers import VISION_TOKENS, character_qwen_tokenizer

        return character_qwen_tokenizer(256, extra_tokens=VISION_TOKENS)

    def tiny_prompt_processor(self, processor, parts, folder):
        """The processor's folder of a tiny preset: its tokenizer and Qwen3-VL's image processor (16-pixel patches merged 2x2, as the
        release's), making few image tokens of a small frame (32x32 to 64x64 pixels: 1 to 4)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        parts["tokenizer"].save_pretrained(str(folder))
        Qwen2VLImageProcessorPil(
            patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=64 * 64, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        ).save_pretrained(str(folder))

    def load_prompt_processor(self, pipeline_dir, processor, parts):
        from pathlib import Path

        from zeropipe.families.diffusion.bases.qwen3_vl_text import load_processor

        return load_processor(Path(pipeline_dir) / processor, images=True)


class MiniMaxH3I2VSampling(MiniMaxH3Sampling):
    """Samples from a data clip's first frame (the ``FirstFrame`` part's ``image``): encoded by the pipeline's own
    ``encode_vae_condition`` and its keyframe noise drawn first from the samples' generator, as ``MiniMaxH3PrepareConditionLatentsStep``
    draws it before the video's and the audio's."""

    def sample_condition(self, pipeline, kwargs, batch, generator):
        import numpy as np
        from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

        vae = pipeline.vae
        device = next(vae.parameters()).device
        pixels = torch.from_numpy(np.array(kwargs["image"])).to(device).permute(2, 0, 1)[None, :, None]
        with torch.no_grad():
            keyframe = encode_vae_condition(vae, pixels, pipeline.pixel_mean, pipeline.pixel_std, pipeline.keyframe_encode_seed)
        noise = torch.randn((batch, *keyframe.shape[1:]), generator=generator)
        return {**kwargs["condition"], "first_frame_latents": keyframe.expand(batch, -1, -1, -1, -1), "keyframe_noise": noise}
