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

The entry is ``entries/minimax_h3.py``: its latents are the ``MiniMaxH3Latents`` codec's, its sound the
``WaveformAudioTrack`` condition's (32 kHz stereo through the waveform audio VAE), its prompts ``MiniMaxH3Prompts`` with the
processor's text path where torchvision is missing (``bases/qwen3_vl_text.py``), its samples ``MiniMaxH3Sampling``'s.
"""

from __future__ import annotations

from typing import Any

import torch

from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.modular import TextEncoderBlock
from zeropipe.families.diffusion.parts import GuidedPrompt, WaveformAudioTrack
from zeropipe.families.diffusion.parts.latents import MiniMaxH3Latents
from zeropipe.families.diffusion.roles import DenoiserCall, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_minimax_h3_audio_vae, tiny_minimax_h3_vae, tiny_qwen3_vl_generation

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

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        """One clip's packed sequence for the planner's trace: the video rows, its soundtrack's audio rows and the prompt's rows.

        The planner counts latent frames as a ``4k+1`` VAE does; the clip those are (``4 (n - 1) + 1`` frames) is aligned to
        ``17k+5`` as the pipeline aligns a request (``align_num_frames``) and counted in H3's latent frames (``5k+2``) and audio
        latents (40 a second at 24 fps). The layout is integer bookkeeping, built on the CPU by the pipeline's own builders.
        """
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import align_num_frames, audio_latent_num_frames, video_latent_num_frames

        frames = 4 * (latent_frames - 1) + 1
        if frames > 1:
            frames = align_num_frames(frames, 17, 5)
            latent_frames = video_latent_num_frames(frames, 17, 5)
        audio = audio_latent_num_frames(frames)
        here, cpu = torch.empty(0).device, torch.device("cpu")  # the trace's device (meta)
        with cpu:
            layout = packed_sequence(config, text_tokens, latent_frames, latent_side, latent_side, audio, cpu)
            timesteps = row_timesteps(layout[2], layout[3], text_tokens, 0.5, float(1 - audio_sigma(torch.tensor(0.5))))
        position_ids, tags, video_rows, audio_rows, text_rows = (tensor.to(here) for tensor in layout)
        timestep, timestep_indices = (tensor.to(here) for tensor in timesteps)
        pt, ph, pw = tuple(config.patch_size)
        video_tokens = (latent_frames // pt) * (latent_side // ph) * (latent_side // pw)
        return {
            "hidden_states": torch.randn(1, video_tokens, config.in_channels * pt * ph * pw, dtype=dtype),
            "audio_hidden_states": torch.randn(1, AUDIO_CHANNELS * audio, config.audio_in_channels, dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, config.text_dim, dtype=dtype),
            "timestep": timestep, "timestep_indices": timestep_indices, "token_tags": tags, "position_ids": position_ids,
            "video_indices": video_rows, "audio_indices": audio_rows, "text_indices": text_rows,
        }

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
        """Every row's velocity error weighed alike, video and audio (diffusion-pipe's loss for MiniMax-H3).

        With ``model.diffusion.guidance_preserving`` (``parts/guidance.py``: diffusion-pipe's CFG-augmented training, its
        ``cfg`` setting) both streams' guided velocities are read as ``w`` times guided against the model's own
        unconditional velocity (the empty prompt's, taken without gradient), and the raw conditional velocity recovered from
        them is what is fitted: ``raw = (v_g + (w - 1) u) / w``, the same equation as ``guidance_preserving_loss``, per stream.
        """
        from zeropipe.families.diffusion.objectives import weighted_mse
        from zeropipe.families.diffusion.parts.guidance import split_unconditional

        own, unconditional, scale = split_unconditional(condition)
        sigma = noised.timesteps.float() / 1000.0
        audio = self.audio_rows(own, noised.model_input)
        if not audio.shape[1]:
            audio = audio.new_zeros(audio.shape[0], 0, getattr(model, "module", model).config.audio_in_channels)
        level = audio_sigma(sigma)
        noise = torch.randn(audio.shape, dtype=torch.float32).to(audio)  # this rank's stream, saved with checkpoints
        noisy = (1 - level.view(-1, 1, 1).to(audio)) * audio + level.view(-1, 1, 1).to(audio) * noise
        video_velocity, audio_velocity = self.joint_predict(model, noised.model_input, noisy, sigma, level, own, context)
        if unconditional is not None:
            with torch.no_grad():  # the model's own unconditional prediction is a fixed reference, as diffusion-pipe takes it
                video_u, audio_u = self.joint_predict(model, noised.model_input, noisy, sigma, level, unconditional, context)
            video_velocity = (video_velocity.float() + (scale - 1.0) * video_u.float()) / scale
            audio_velocity = (audio_velocity.float() + (scale - 1.0) * audio_u.float()) / scale
        if not audio.shape[1]:
            return weighted_mse(video_velocity, noised.target, noised.weights)
        video_rows, audio_rows = noised.target[0].numel(), audio[0].numel()
        share = video_rows / (video_rows + audio_rows)
        return share * weighted_mse(video_velocity, noised.target, noised.weights) + (1 - share) * weighted_mse(audio_velocity, noise - audio, noised.weights)


class MiniMaxH3Prompts(TextEncoderBlock):
    """The pipeline's own text-encoder block (``MiniMaxH3TextEncoderStep``, the t2va branch of its auto step: Qwen3-VL's
    hidden state 50 of the prompt as is, no chat template), run once per prompt as it takes one, each prompt's rows
    cached at its own length with a mask. Its ``text_token_tags`` are all text for a prompt alone: the call makes them."""

    def __init__(self):
        super().__init__(per_prompt=True)

    def encode_prompts(self, pipeline, prompts, device):
        """The block's rows of each prompt; the empty prompt (the unconditional conditioning of the guidance-preserving objective
        and of dropped captions) is no text rows at all: the block cannot encode it (Qwen3-VL takes no empty input), and the
        transformer takes a packed sequence without text (the pipeline has no negative prompt to say otherwise)."""
        spoken = [index for index, prompt in enumerate(prompts) if prompt]
        if len(spoken) == len(prompts):
            return super().encode_prompts(pipeline, prompts, device)
        encoder = pipeline.text_encoder
        out = super().encode_prompts(pipeline, [prompts[index] for index in spoken], device) if spoken else {
            "prompt_embeds": torch.zeros(0, 0, encoder.config.text_config.hidden_size, dtype=encoder.dtype, device=device),
            "prompt_embeds_mask": torch.zeros(0, 0, dtype=torch.long, device=device),
        }
        full = {name: value.new_zeros((len(prompts), *value.shape[1:])) for name, value in out.items()}
        for name, value in out.items():
            full[name][spoken] = value
        return full

    def tiny_tokenizer(self, tokenizer):
        from zeropipe.families.diffusion.tiny.tokenizers import character_qwen_tokenizer

        return character_qwen_tokenizer(256)

    def tiny_prompt_processor(self, processor, parts, folder):
        """The processor's folder of a tiny preset: its tokenizer (what the block reads of it without torchvision, ``ProcessorTextPath``)."""
        parts["tokenizer"].save_pretrained(str(folder))

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


class MiniMaxH3Sampling(Sampling):
    """Samples with their sound: noise for the video latents and the audio rows at the sample's length (video first, then audio,
    from the one generator, as ``MiniMaxH3PrepareLatentsStep`` draws them), denoised together by ``draw`` over the pipeline's two
    schedules. The checkpoint is guidance-distilled: one transformer pass per step, no guider and no negative prompt (the
    pipeline has neither), so ``generate.guidance_scale`` does not apply."""

    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {"condition": condition}

    def sample_condition(self, pipeline, kwargs, batch: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The conditioning the draw is given (text-to-video: the prompts' as cached)."""
        return kwargs["condition"]

    def sample_outputs(self, pipeline, kwargs):
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MINIMAX_H3_FPS, audio_latent_num_frames, video_latent_num_frames

        from zeropipe.families.diffusion.core import PredictContext

        model = pipeline.transformer
        module = getattr(model, "module", model)
        device, dtype = next(module.parameters()).device, next(module.parameters()).dtype
        codec = self.record.codec
        frames = int(kwargs.get("num_frames") or codec.clip_length(1))
        latent_frames = 1 if frames == 1 else video_latent_num_frames(frames, codec.frame_multiple, codec.frame_remainder)
        factor = pipeline.zeropipe_vae_factor
        batch = kwargs["condition"]["prompt_embeds"].shape[0]
        generator = kwargs["generator"]
        condition = self.sample_condition(pipeline, kwargs, batch, generator)  # its draws (a keyframe's noise) come first, as the pipeline's
        video = torch.randn((batch, module.config.in_channels, latent_frames, kwargs["height"] // factor, kwargs["width"] // factor), generator=generator)
        audio = torch.randn((batch, AUDIO_CHANNELS * audio_latent_num_frames(frames, MINIMAX_H3_FPS), module.config.audio_in_channels), generator=generator)
        context = PredictContext(device, dtype, factor, 1.0)
        video, audio = draw(self.entry.call, model, pipeline.scheduler, pipeline.audio_scheduler, video.to(device), audio.to(device), int(kwargs["num_inference_steps"]), condition, context)
        return video, {"audio_latents": audio}


# ------------------------------------------------------------------ the text-to-video record (entries/minimax_h3.py), which minimax-h3-i2v extends
TEXT_LAYER = 50  # the block reads Qwen3-VL's hidden state 50: a tiny text encoder needs 51 layers


def tiny_text_encoder() -> dict:
    fields = tiny_qwen3_vl_generation()
    fields["text_config"] = {**fields["text_config"], "num_hidden_layers": TEXT_LAYER + 1, "hidden_size": 16, "intermediate_size": 32, "head_dim": 8,
                             "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    fields["vision_config"] = {**fields["vision_config"], "out_hidden_size": 16}
    return fields


ARCHITECTURE = Architecture(
    record=Record(
        name="minimax-h3",
        pipeline_class="MiniMaxH3ModularPipeline",
        denoiser="transformer",
        denoiser_class="MiniMaxH3Transformer3DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        text=GuidedPrompt(processors=("processor",)),
        conditions=(WaveformAudioTrack(),),
        patch_factor=2,
        codec=MiniMaxH3Latents(vae_class="AutoencoderKLMiniMaxH3", frame_multiple=17, frame_remainder=5, frame_rate=24.0),
        lora_targets=r".*(transformer_blocks|token_refiner\.refiner_blocks)\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))",
        preset_name="tiny-minimax-h3",
        preset={
            "transformer": {
                "num_attention_heads": 2, "attention_head_dim": 32, "hidden_size": 64, "num_layers": 2, "num_refiner_layers": 1, "ffn_dim": 96,
                "in_channels": 24, "audio_in_channels": 32, "text_dim": 16, "freq_dim": 32, "time_embed_hidden_dim": 64, "time_embed_dim": 32, "rope_freq_dim": 4,
            },
            "vae": tiny_minimax_h3_vae(),
            "audio_vae": tiny_minimax_h3_audio_vae(),
            "text_encoder": tiny_text_encoder(),
            "scheduler": {"class": "MiniMaxH3Scheduler", "shift": VIDEO_SHIFT},
            "audio_scheduler": {"class": "MiniMaxH3Scheduler", "shift": AUDIO_SHIFT},
        },
        trace_frames=124,  # a 5-second request (120 frames at 24 fps) aligned up to 17k+5
        tokenizer_lengths={"tokenizer": 256},
        trace_tokens=256,
        image_processor_patch=2,
    ),
    call=MiniMaxH3Call(),
    prompts=MiniMaxH3Prompts(),
    sampling=MiniMaxH3Sampling(),
)
