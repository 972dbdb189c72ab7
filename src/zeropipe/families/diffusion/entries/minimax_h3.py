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
layout. Image-to-video (``fl2va``, the same checkpoint) is the entry ``minimax-h3-i2v`` (``model.diffusion.task: image-to-video``);
reference-to-video (``ref2va``, another transformer) is not trained here.
"""

from zeropipe.families.diffusion.bases.minimax_h3 import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
