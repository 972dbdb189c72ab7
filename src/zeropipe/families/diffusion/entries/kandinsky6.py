"""Kandinsky 6.0 Video (``kandinsky6``, ``Kandinsky6TI2VAPipeline``): text to video with its 44.1 kHz sound, trained jointly.

The call, prompts and samples are ``bases/kandinsky6.py``'s (held to the pipeline's own transformer call in
``tests/unit/diffusion/test_kandinsky6.py``); the video is HunyuanVideo's VAE (``SoundingVideoLatents``: ``VideoLatents`` whose synthetic clips have sound, 4k+1 frames at 24 fps,
latents scaled by the VAE's ``scaling_factor``), the sound the ``MMAudioTrack`` condition's (MMAudio's mel VAE; clips
without sound are left out, named in the run's notes). The released checkpoints: Pro (29B: a 60-block fused transformer,
video 4096 wide, audio 2048) and Lite (3B), each as the sft/pretrain model and a pi-Flow distilled one (the distilled
transformer's heads predict 10 velocity grids for ``PiflowScheduler``; train the non-distilled ``Kandinsky-6.0-Pro-5s-Diffusers``).

The LoRA targets the attention projections of the text blocks, of both streams' self- and cross-attention and of the
two cross-modal attentions, and every feed-forward (diffusers' module names, which keep Kandinsky's ``to_query``...
``out_layer``). It exports in diffusers' layout (``transformer.<module>.lora_A.weight``, what peft's ``set_peft_model_state_dict``
and the transformer's ``PeftAdapterMixin.load_lora_adapter`` read: the pipeline has no ``load_lora_weights``) and in ComfyUI's
(``Kandinsky6Layouts``: ComfyUI's native Kandinsky 6 model's module names, ``visual_blocks.N.videoT.self_attention.to_query``...,
under ``diffusion_model.``).
"""

from __future__ import annotations

from zeropipe.families.diffusion.bases.kandinsky6 import CLIP_TOKENS, PROMPT_TOKENS, Kandinsky6Call, Kandinsky6Layouts, Kandinsky6Prompts, Kandinsky6Sampling
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import PromptText
from zeropipe.families.diffusion.parts.latents import SoundingVideoLatents
from zeropipe.families.diffusion.parts.mmaudio_track import MMAudioTrack
from zeropipe.families.diffusion.tiny.components import clip_text, tiny_hunyuan_video_vae, tiny_qwen2_5_vl

ATTENTION = r"(to_query|to_key|to_value|out_layer)"
LORA_TARGETS = (
    rf".*(_text_transformer_blocks\.\d+\.attn|visual_transformer_blocks\.\d+\.((video|audio)_dec_block\.(self_attention|cross_attention)|va_cross_attention|av_cross_attention))\.{ATTENTION}"
    r"|.*transformer_blocks\.\d+\.((video|audio)_dec_block\.)?feed_forward\.net\.(0\.proj|2)"
)


def tiny_text_encoder() -> dict:
    """Qwen2.5-VL at 2 layers of 32, its positions long enough for the template (129 tokens) and the padded prompt."""
    qwen = tiny_qwen2_5_vl()
    return {**qwen, "text_config": {**qwen["text_config"], "vocab_size": 256, "max_position_embeddings": 512}}


ARCHITECTURE = Architecture(
    record=Record(
        name="kandinsky6",
        pipeline_class="Kandinsky6TI2VAPipeline",
        denoiser="transformer",
        denoiser_class="Kandinsky6Transformer3DModel",
        objective="flow",
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        tokenizer_lengths={"tokenizer": PROMPT_TOKENS, "tokenizer_2": CLIP_TOKENS},
        text=PromptText(),
        patch_factor=2,
        codec=SoundingVideoLatents(vae_class="AutoencoderKLHunyuanVideo", frame_multiple=4, frame_rate=24.0),
        conditions=(MMAudioTrack(),),
        lora_targets=LORA_TARGETS,
        preset_name="tiny-kandinsky6",
        preset={
            # Pro's switches (ca_rope, cross_gates, fix_modulation, two visual token types) at 2 fused blocks; the two streams'
            # heads the same width (16), as the cross-modal rotary embedding needs (Pro: 128 each).
            "transformer": {
                "in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": 32, "in_text_dim2": 32, "time_dim": 32, "patch_size": [1, 2, 2],
                "model_dim": 32, "ff_dim": 64, "num_text_blocks": 1, "num_visual_blocks": 2, "axes_dims": [4, 6, 6], "visual_cond": True,
                "in_audio_dim": 8, "out_audio_dim": 8, "model_dim_a": 16, "time_dim_a": 32, "ff_dim_a": 32, "axes_dims_a": [4, 6, 6],
                "audio_freqs_scaling": 0.144, "text_token_padding": True, "ca_rope": True, "cross_gates": True, "fix_modulation": True,
                "visual_token_type_num_embeddings": 2,
            },
            "vae": tiny_hunyuan_video_vae(),
            "text_encoder": tiny_text_encoder(),
            "text_encoder_2": {"class": "CLIPTextModel", **clip_text(hidden=32)},
            # 16 kHz, 16 mel bins, a 64-sample hop (128 samples a latent; the release: 44.1 kHz, 128 bins, 512), 8 latent channels (40).
            "audio_vae": {
                "class": "MMAudioVAE", "mel_bins": 16, "latent_channels": 8, "hidden_channels": 16, "channel_multipliers": [1, 2], "layers_per_block": 1,
                "sample_rate": 16000, "n_fft": 256, "hop_length": 64, "scaling_factor": 0.5302,
            },
            # Upsamples the mel frames by the hop (4 x 4 x 4 = 64) back to 16 kHz.
            "vocoder": {
                "class": "MMAudioVocoder", "num_mels": 16, "upsample_initial_channel": 32, "upsample_rates": [4, 4, 4], "upsample_kernel_sizes": [8, 8, 8],
                "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]],
            },
            # Euler on flow sigmas with a fixed shift (kandinsky-6's scheduler_scale).
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 10.0, "use_dynamic_shifting": False},
        },
        trace_frames=121,  # the pipeline's default length: 5 s at 24 fps
        trace_tokens=PROMPT_TOKENS,  # every prompt is padded to 1024 tokens
    ),
    call=Kandinsky6Call(),
    prompts=Kandinsky6Prompts(),
    sampling=Kandinsky6Sampling(),
    layouts=Kandinsky6Layouts(),
)
