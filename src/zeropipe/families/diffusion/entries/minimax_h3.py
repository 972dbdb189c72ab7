"""MiniMax-H3 (``MiniMaxH3ModularPipeline``, diffusers 0.42.1: modular only): text to video with its stereo soundtrack.

One transformer denoises the video latents and the audio rows of a clip as one packed sequence (``bases/minimax_h3.py``:
the call, the prompts through the pipeline's own text-encoder block, the two-stream draw, all held to the modular
pipeline's blocks in ``tests/unit/diffusion/test_minimax_h3.py``). The video is the ``MiniMaxH3Latents`` codec's
(``AutoencoderKLMiniMaxH3``: ``17k+5`` frames at 24 fps, 16x space, ImageNet-normalised pixels, per-channel statistics);
the sound the ``WaveformAudioTrack`` condition's (``AutoencoderKLMiniMaxH3Audio``: the 32 kHz stereo waveform, 40 latents a
second, two channel-major blocks of rows). Clips without sound are left out (their files are named in the run's notes).

The checkpoint is guidance-distilled: its trainers keep the guidance with a dedicated objective, and so can this entry
(``model.diffusion.guidance_preserving: W``, ``parts/guidance.py``: diffusion-pipe's CFG-augmented training, its ``cfg``).
The LoRA targets the transformer blocks' and the refiner's attention and feed-forward layers (diffusion-pipe's
``DiTBlock`` / ``RefinerBlock`` linears except AdaLN, in diffusers' names). The LoRA exports in diffusers' layout, which
``MiniMaxH3LoraLoaderMixin`` reads; no original-layout converter is published with diffusers 0.42.1, so there is no second
layout. Image-to-video (``fl2va``) and reference-to-video (``ref2va``, another transformer) are not trained here.
"""

from __future__ import annotations

from zeropipe.families.diffusion.bases.minimax_h3 import AUDIO_SHIFT, VIDEO_SHIFT, MiniMaxH3Call, MiniMaxH3Prompts, MiniMaxH3Sampling
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import GuidedPrompt, WaveformAudioTrack
from zeropipe.families.diffusion.parts.latents import MiniMaxH3Latents
from zeropipe.families.diffusion.tiny.components import tiny_minimax_h3_audio_vae, tiny_minimax_h3_vae, tiny_qwen3_vl_generation

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
