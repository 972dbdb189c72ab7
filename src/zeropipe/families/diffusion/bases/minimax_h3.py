"""MiniMax-H3: video with its stereo soundtrack from one transformer over one packed sequence (diffusers: modular only).

``MiniMaxH3Transformer3DModel`` denoises ``[text | keyframe conditions | target audio | target video]`` as one
sequence of rows, one sample at a time: the video latents (24 channels, 16x space, ``17n+5`` frames to ``5n+2``
latent frames) patchified 1x2x2, the audio latents (32 channels, 40 per second, the two stereo channels as two
channel-major blocks of rows), the text rows (Qwen3-VL's hidden state 50, at the prompt's own length), each row with
a modality tag and a 3-axis rotary position, and one timestep per row reduced to ``(timestep, timestep_indices)``.
This module builds that sequence with the modular pipeline's own static builders
(``MiniMaxH3PrepareLayoutStep.build_packed_sequence``, ``MiniMaxH3SetTimestepsStep.build_row_timesteps``,
``patchify_video_latents``), so the denoiser call is the ``MiniMaxH3LoopDenoiser`` block's (held to it in
``tests/unit/diffusion/test_minimax_h3.py``).

Conventions (``MiniMaxH3Scheduler``): the transformer's time runs the other way (``t = 1 - sigma``, 1 is clean) and
it predicts the data-ward velocity (``x0 = x_t + sigma * v``): ``joint_predict`` converts both, so the objective is
the same rectified flow as every other ``flow`` entry (target ``noise - x0``). The audio is noised at its own
level, the video's sigma mapped from the video schedule's shift (12) to the audio's (3): at every step of the
pipeline's two schedules (``scheduler``, ``audio_scheduler``) the two sigmas are so related, and diffusion-pipe's
trainer (``models/minimax_h3.py``: ``time_shift_sigma``) draws the audio level the same way. The loss weighs every
row alike, video and audio (diffusion-pipe's ``loss_fn``); a clip without audio trains video rows only, with an
empty audio block, as diffusion-pipe does.

Status: the denoiser call, the prompts through the pipeline's text-encoder block and the two-stream sampling step are
here (``bases/``, for the entry module to come) and held to the modular pipeline's blocks; there is NO entry yet (docs/video.md, "Not done yet"): its tiny preset needs tiny builds of the video
VAE, the waveform audio VAE and Qwen3-VL with its processor (the processor needs torchvision, which this machine
does not have), and the ``AudioTrack`` part encodes LTX-2's mel-spectrogram audio, not H3's 32 kHz waveform.
"""

from __future__ import annotations

from typing import Any

import torch

from zeropipe.families.diffusion.modular import TextEncoderBlock
from zeropipe.families.diffusion.roles import DenoiserCall

VIDEO_SHIFT = 12.0  # MiniMaxH3Scheduler's shift for the video rows (the pipeline's `scheduler`)
AUDIO_SHIFT = 3.0  # and for the audio rows (`audio_scheduler`)
AUDIO_CHANNELS = 2  # stereo, packed channel-major
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2  # the rows' modality tags: they index the transformer's AdaLN table


def shifted(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """MiniMaxH3Scheduler's exponential shift of a sigma: ``s*sigma / (1 + (s-1)*sigma)``."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def audio_sigma(sigma: torch.Tensor, video_shift: float = VIDEO_SHIFT, audio_shift: float = AUDIO_SHIFT) -> torch.Tensor:
    """The audio rows' sigma at a video sigma: the video shift undone, the audio shift applied (both schedules share their base grid)."""
    base = sigma / (video_shift - (video_shift - 1) * sigma)
    return shifted(base, audio_shift)


def unpatchify_video_rows(rows: torch.Tensor, channels: int, frames: int, height: int, width: int, patch_size: tuple[int, int, int]) -> torch.Tensor:
    """Rows (frames/pt * height/ph * width/pw, C*pt*ph*pw) back to latents (1, C, frames, height, width): ``patchify_video_latents`` undone."""
    pt, ph, pw = patch_size
    rows = rows.reshape(1, frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    return rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(1, channels, frames, height, width)


def packed_sequence(config: Any, text_tokens: int, frames: int, height: int, width: int, audio_latents: int, device: torch.device):
    """The t2va layout of one sample, by the modular pipeline's own builder: (position_ids, token_tags, video_indices, audio_indices, text_indices)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    built = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.full((text_tokens,), TEXT_TAG, dtype=torch.long), frames, height, width, audio_latents, tuple(config.patch_size), AUDIO_CHANNELS, AUDIO_TAG, VIDEO_TAG,
    )
    return tuple(tensor.to(device) for tensor in built[:5])


def row_timesteps(video_indices, audio_indices, text_tokens: int, video_t: float, audio_t: float):
    """(distinct timesteps, each row's index into them) for generated rows only (no conditioning rows): the modular pipeline's own reduction."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    return MiniMaxH3SetTimestepsStep.build_row_timesteps(video_indices.cpu(), audio_indices.cpu(), 0, 0, text_tokens, video_t, audio_t, 1.0, 1.0)


class MiniMaxH3Call(DenoiserCall):
    """The packed-sequence call, one sample at a time, in the objective's conventions (sigma time, noise-ward velocity)."""

    def joint_predict(self, model, video: torch.Tensor, audio: torch.Tensor, sigmas: torch.Tensor, audio_sigmas: torch.Tensor, condition: dict[str, torch.Tensor], context) -> tuple[torch.Tensor, torch.Tensor]:
        """The noise-ward velocities of video latents (B, C, F, H, W) and audio rows (B, 2*N, C_audio) at these sigmas.

        ``condition``: ``prompt_embeds`` (B, L, D) padded with ``prompt_embeds_mask`` (B, L): each prompt's rows at its own length.
        """
        from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

        module = getattr(model, "module", model)
        config = module.config
        patch = tuple(config.patch_size)
        _, channels, frames, height, width = video.shape
        videos, audios = [], []
        for index in range(video.shape[0]):
            keep = condition["prompt_embeds_mask"][index].bool()
            embeds = condition["prompt_embeds"][index][keep]
            position_ids, tags, video_rows, audio_rows, text_rows = packed_sequence(config, embeds.shape[0], frames, height, width, audio.shape[1] // AUDIO_CHANNELS, video.device)
            timestep, timestep_indices = row_timesteps(video_rows, audio_rows, embeds.shape[0], float(1 - sigmas[index]), float(1 - audio_sigmas[index]))
            video_out, audio_out = model(
                hidden_states=patchify_video_latents(video[index : index + 1].float(), patch)[None].to(context.dtype),
                audio_hidden_states=audio[index : index + 1].to(context.dtype), encoder_hidden_states=embeds[None].to(context.dtype),
                timestep=timestep.to(video.device), timestep_indices=timestep_indices.to(video.device), token_tags=tags, position_ids=position_ids,
                video_indices=video_rows, audio_indices=audio_rows, text_indices=text_rows, return_dict=False,
            )
            videos.append(-unpatchify_video_rows(video_out[0], channels, frames, height, width, patch))
            audios.append(-audio_out[0])
        return torch.cat(videos), torch.stack(audios)

    def audio_rows(self, condition: dict[str, torch.Tensor], video: torch.Tensor) -> torch.Tensor:
        """The batch's cached audio rows (B, 2*N, C_audio), or an empty audio block where it has none (images, silent clips)."""
        if "audio_latents" in condition:
            return condition["audio_latents"].float()
        return video.new_zeros(video.shape[0], 0, 1)

    def predict(self, model, model_input, timesteps, condition, context):
        """The video velocity; the audio (if cached) noised at its level with noise of a fixed seed, so the same inputs give the same output."""
        sigma = timesteps.float() / 1000.0
        audio = self.audio_rows(condition, model_input)
        if audio.shape[1]:
            noise = torch.randn(audio.shape, generator=torch.Generator().manual_seed(0)).to(audio)
            level = audio_sigma(sigma).view(-1, 1, 1).to(audio)
            audio = (1 - level) * audio + level * noise
        else:
            audio = audio.new_zeros(audio.shape[0], 0, getattr(model, "module", model).config.audio_in_channels)
        return self.joint_predict(model, model_input, audio, sigma, audio_sigma(sigma), condition, context)[0]

    def loss(self, model, noised, condition, context):
        """Every row's velocity error weighed alike, video and audio (diffusion-pipe's loss for MiniMax-H3)."""
        from zeropipe.families.diffusion.objectives import weighted_mse

        sigma = noised.timesteps.float() / 1000.0
        audio = self.audio_rows(condition, noised.model_input)
        if not audio.shape[1]:
            return weighted_mse(self.predict(model, noised.model_input, noised.timesteps, condition, context), noised.target, noised.weights)
        level = audio_sigma(sigma)
        noise = torch.randn(audio.shape, dtype=torch.float32).to(audio)  # this rank's stream, saved with checkpoints
        noisy = (1 - level.view(-1, 1, 1).to(audio)) * audio + level.view(-1, 1, 1).to(audio) * noise
        video_velocity, audio_velocity = self.joint_predict(model, noised.model_input, noisy, sigma, level, condition, context)
        video_rows, audio_rows = noised.target[0].numel(), audio[0].numel()
        share = video_rows / (video_rows + audio_rows)
        return share * weighted_mse(video_velocity, noised.target, noised.weights) + (1 - share) * weighted_mse(audio_velocity, noise - audio, noised.weights)


class MiniMaxH3Prompts(TextEncoderBlock):
    """The pipeline's own text-encoder block (``MiniMaxH3TextEncoderStep``, the t2va branch of its auto step: Qwen3-VL's
    hidden state 50 of the prompt as is, no chat template), run once per prompt as it takes one, each prompt's rows
    cached at its own length with a mask. Its ``text_token_tags`` are all text for a prompt alone: the call makes them."""

    def __init__(self):
        super().__init__(per_prompt=True)

    def load_prompt_processor(self, pipeline_dir, processor, parts):
        from pathlib import Path

        from zeropipe.families.diffusion.bases.qwen3_vl_text import load_processor

        return load_processor(Path(pipeline_dir) / processor)


@torch.no_grad()
def draw(call: MiniMaxH3Call, model, scheduler, audio_scheduler, video: torch.Tensor, audio: torch.Tensor, steps: int, condition: dict[str, torch.Tensor], context) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of both streams through the shared sampler (``sampler.denoise_streams``), driven by the entry's joint call:
    video latents (B, C, F, H, W) and audio rows (B, 2*N, C_audio) from noise, over the pipeline's two schedules."""
    from zeropipe.families.diffusion.sampler import denoise_streams

    scheduler.set_timesteps(steps, device=video.device)
    audio_scheduler.set_timesteps(steps, device=video.device)

    def velocities(index, timesteps, latents):
        # MiniMaxH3Scheduler's timesteps are 1 - sigma; it steps on the data-ward velocity the transformer gives (the call's, negated).
        sigma, level = (1 - timesteps[0]).expand(video.shape[0]), (1 - timesteps[1]).expand(video.shape[0])
        video_v, audio_v = call.joint_predict(model, latents[0], latents[1], sigma, level, condition, context)
        return -video_v, -audio_v

    return denoise_streams((scheduler, audio_scheduler), (video, audio), list(zip(scheduler.timesteps, audio_scheduler.timesteps)), velocities)
