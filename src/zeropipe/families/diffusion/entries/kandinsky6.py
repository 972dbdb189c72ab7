"""Kandinsky 6.0 Video (``kandinsky6``, ``Kandinsky6TI2VAPipeline``): text to video with its 44.1 kHz sound, trained jointly.

The call, prompts and samples are ``bases/kandinsky6.py``'s (held to the pipeline's own transformer call in
``tests/unit/diffusion/test_kandinsky6.py``); the video is HunyuanVideo's VAE (``SoundingVideoLatents``: ``VideoLatents`` whose synthetic clips have sound, 4k+1 frames at 24 fps,
latents scaled by the VAE's ``scaling_factor``), the sound the ``MMAudioTrack`` condition's (MMAudio's mel VAE; clips
without sound are left out, named in the run's notes). The released checkpoints: Pro (29B: a 60-block fused transformer,
video 4096 wide, audio 2048) and Lite (3B), each as the sft/pretrain model and a pi-Flow distilled one. A distilled folder is
refused before anything runs (``Kandinsky6Call.checkpoint_problems``): its transformer's heads predict 10 velocity grids, the policy
``PiflowScheduler`` integrates, which pi-Flow trains by imitating the teacher along the policy's trajectory, not from data
(docs/video.md, Kandinsky 6; ``benchmarks/piflow_objectives.py``); train the non-distilled ``Kandinsky-6.0-Pro-5s-Diffusers``.

The LoRA targets the attention projections of the text blocks, of both streams' self- and cross-attention and of the
two cross-modal attentions, and every feed-forward (diffusers' module names, which keep Kandinsky's ``to_query``...
``out_layer``). It exports in diffusers' layout (``transformer.<module>.lora_A.weight``, what peft's ``set_peft_model_state_dict``
and the transformer's ``PeftAdapterMixin.load_lora_adapter`` read: the pipeline has no ``load_lora_weights``) and in ComfyUI's
(``Kandinsky6Layouts``: ComfyUI's native Kandinsky 6 model's module names, ``visual_blocks.N.videoT.self_attention.to_query``...,
under ``diffusion_model.``).
"""

from zeropipe.families.diffusion.bases.kandinsky6 import ARCHITECTURE

__all__ = ["ARCHITECTURE"]
