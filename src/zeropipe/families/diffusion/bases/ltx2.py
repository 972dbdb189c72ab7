"""LTX-2 (and LTX-2.3, the same classes with another config): video and its sound from one transformer, trained jointly.

``LTX2VideoTransformer3DModel`` denoises two token streams in every block, the video's (a
32x32x8-pixel-per-latent VAE, as LTX-Video) and the audio's (``AutoencoderKLLTX2Audio``
latents of a 16 kHz mel spectrogram, 25 per second), which attend to each other. Prompts are
Gemma 3's hidden states of every layer (``LTX2Pipeline.encode_prompt``) turned by the text
connectors (``connectors``, frozen) into a video and an audio conditioning; the connectors'
outputs are what the text cache holds.

Training (the objective of LTX-2's own trainer, ltx-trainer's text-to-video strategy with
``with_audio``): flow matching with one noise level per clip for both streams, the video and
the audio velocity errors added. The video side is the shared objective
(``model.diffusion.shift``: ``auto`` is the scheduler's static ``shift``, 1.0 in LTX-2's
config; its sampler shifts by the token count); the audio side is the ``AudioTrack`` part's
cached latents, noised here at the same level (``loss``). Samples are drawn by LTX2Pipeline
with its defaults except spatio-temporal and modality guidance (each one more transformer pass
per step, and STG's block index is the 48-layer model's) and come back with their audio track
muxed in. LoRAs export in diffusers' layout and in LTX-2's original (ComfyUI) one,
``diffusion_model.`` plus diffusers' names for the blocks' layers (diffusers'
``_convert_non_diffusers_ltx2_lora_to_diffusers`` maps the rest).
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.bases.ltx_video import LTXLayouts
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import PromptText
from zeropipe.families.diffusion.parts.audio_track import AudioTrack
from zeropipe.families.diffusion.parts.latents import LTX2Latents
from zeropipe.families.diffusion.roles import SoundingCall, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_gemma3
from zeropipe.families.diffusion.tiny.tokenizers import character_t5_tokenizer

# LTX2Pipeline's default prompt length (Gemma pads every prompt to it, on the left); a tokenizer with a shorter
# model_max_length (the tiny preset's, 128) pads to its own.
PROMPT_TOKENS = 1024
TINY_PROMPT_TOKENS = 128
# The key that tells sample_outputs where the video conditioning ends in the joined prompt embeddings (not a pipeline argument).
VIDEO_WIDTH = "ltx2_video_conditioning_width"


class ConnectorOutputs(torch.nn.Module):
    """Stands in for the text connectors while sampling: the prompt embeddings given are the connectors' outputs (the text cache's), joined.

    LTX2Pipeline always runs its ``connectors`` on ``prompt_embeds``; the cache holds their outputs
    (Gemma's hidden states of every layer would be 49 times larger), so the sampler is handed those,
    the video and the audio conditioning side by side, and this splits them back.
    """

    def __init__(self, video_width: int, device: torch.device):
        super().__init__()
        self.video_width = video_width
        self.register_buffer("anchor", torch.zeros(0, device=device), persistent=False)

    @property
    def device(self) -> torch.device:  # a pipeline asks each of its components where it runs
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    def forward(self, prompt_embeds, attention_mask, padding_side="left", scale_factor=8):
        return prompt_embeds[..., : self.video_width], prompt_embeds[..., self.video_width :], attention_mask


class LTX2Prompts(PromptEncoding):
    """Gemma's hidden states of every layer, turned by the frozen text connectors into the video and the audio conditioning."""

    def tiny_tokenizer(self, tokenizer):
        return character_t5_tokenizer(TINY_PROMPT_TOKENS)

    def tiny_prompt_processor(self, processor, parts, folder):
        """The tiny preset's connectors are one of its components, written with the pipeline."""

    def load_prompt_processor(self, pipeline_dir, processor, parts):
        """The text connectors, frozen, in the text encoder's dtype and place (fp32 on the CPU without one, as from_pretrained loads them)."""
        from diffusers.pipelines.ltx2 import LTX2TextConnectors

        encoder = parts.get("text_encoder")
        dtype, device = (encoder.dtype, encoder.device) if encoder is not None else (torch.float32, torch.device("cpu"))
        connectors = LTX2TextConnectors.from_pretrained(str(pipeline_dir / processor), torch_dtype=dtype)
        connectors.requires_grad_(False)
        return connectors.to(device).eval()

    def encode_prompts(self, pipeline, prompts, device):
        length = min(self.record.tokenizer_length("tokenizer"), int(pipeline.tokenizer.model_max_length))
        embeds, mask, _, _ = pipeline.encode_prompt(prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=length, device=device)
        side = getattr(pipeline.tokenizer, "padding_side", "left")
        connectors = pipeline.connectors
        video, audio, mask = connectors(embeds.to(connectors.dtype), mask, padding_side=side)
        return {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_attention_mask": mask.float()}


class LTX2Call(SoundingCall):
    """The joint video and audio call of LTX2VideoTransformer3DModel: ``predict`` gives the video velocity, ``loss`` adds the audio's."""

    def joint_predict(self, model, video: torch.Tensor, audio: torch.Tensor, timesteps: torch.Tensor, condition, context) -> tuple[torch.Tensor, torch.Tensor]:
        """The velocities of both streams: video latents (B, C, F, H, W) and audio tokens (B, L, C*M), called as LTX2Pipeline calls the transformer."""
        from diffusers import LTX2Pipeline

        module = getattr(model, "module", model)  # the DeepSpeed engine wraps the transformer
        patch, patch_t = module.config.patch_size, module.config.patch_size_t
        _, _, frames, height, width = video.shape
        packed = LTX2Pipeline._pack_latents(video, patch, patch_t)
        timestep = timesteps.to(context.dtype)
        mask = condition["prompt_attention_mask"]
        video_out, audio_out = model(
            hidden_states=packed, audio_hidden_states=audio.to(context.dtype),
            encoder_hidden_states=condition["prompt_embeds"], audio_encoder_hidden_states=condition["audio_prompt_embeds"],
            timestep=timestep, sigma=timestep, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            num_frames=frames // patch_t, height=height // patch, width=width // patch, fps=self.record.codec.frame_rate,
            audio_num_frames=audio.shape[1], use_cross_timestep=True, return_dict=False,  # LTX2Pipeline's default
        )
        return LTX2Pipeline._unpack_latents(video_out, frames // patch_t, height // patch, width // patch, patch, patch_t), audio_out

    def audio_tokens(self, module, video: torch.Tensor) -> int:
        """The audio latents of a clip of these video latents, as LTX2Pipeline sizes them from its duration."""
        from zeropipe.data.audio import audio_latent_frames

        config = module.config
        pixel_frames = (video.shape[2] - 1) * self.record.codec.frame_multiple + 1
        return audio_latent_frames(pixel_frames / self.record.codec.frame_rate, int(config.audio_sampling_rate), int(config.audio_hop_length), int(config.audio_scale_factor))

    def silent_audio_shape(self, module, video):
        return (video.shape[0], self.audio_tokens(module, video), module.config.audio_in_channels)

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        from zeropipe.data.audio import audio_latent_frames

        frames, side = latent_frames // config.patch_size_t, latent_side // config.patch_size
        pixel_frames = (latent_frames - 1) * self.record.codec.frame_multiple + 1
        audio = audio_latent_frames(pixel_frames / self.record.codec.frame_rate, int(config.audio_sampling_rate), int(config.audio_hop_length), int(config.audio_scale_factor))
        video_width = config.num_attention_heads * config.attention_head_dim
        # LTX-2.0 projects the connectors' caption-wide output in the transformer; LTX-2.3 (use_prompt_embeddings false) is given it
        # already projected per modality by the connectors, at each stream's cross-attention width.
        projected = getattr(config, "use_prompt_embeddings", True)
        video_text = (config.caption_channels or video_width) if projected else config.cross_attention_dim
        audio_text = config.caption_channels if projected else config.audio_cross_attention_dim
        return {
            "hidden_states": torch.randn(1, frames * side * side, config.in_channels * config.patch_size_t * config.patch_size**2, dtype=dtype),
            "audio_hidden_states": torch.randn(1, audio, config.audio_in_channels, dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, video_text, dtype=dtype),
            "audio_encoder_hidden_states": torch.randn(1, text_tokens, audio_text, dtype=dtype),
            "timestep": torch.tensor([500.0], dtype=dtype), "sigma": torch.tensor([500.0], dtype=dtype),
            "encoder_attention_mask": torch.ones(1, text_tokens, dtype=dtype), "audio_encoder_attention_mask": torch.ones(1, text_tokens, dtype=dtype),
            "num_frames": frames, "height": side, "width": side, "fps": self.record.codec.frame_rate, "audio_num_frames": audio, "use_cross_timestep": True,
        }


class LTX2Sampling(Sampling):
    """LTX2Pipeline's own call, handed the connectors' cached outputs (``ConnectorOutputs``); it returns the audio latents too."""

    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        joined = torch.cat([condition["prompt_embeds"], condition["audio_prompt_embeds"]], dim=-1)
        negative_joined = torch.cat([negative["prompt_embeds"], negative["audio_prompt_embeds"]], dim=-1)
        return {
            "prompt_embeds": joined, "prompt_attention_mask": condition["prompt_attention_mask"],
            "negative_prompt_embeds": negative_joined, "negative_prompt_attention_mask": negative["prompt_attention_mask"],
            "guidance_scale": guidance_scale, "stg_scale": 0.0, "audio_stg_scale": 0.0, "spatio_temporal_guidance_blocks": None,
            "modality_scale": 1.0, "audio_modality_scale": 1.0,
            VIDEO_WIDTH: condition["prompt_embeds"].shape[-1],
        }

    def sample_outputs(self, pipeline, kwargs):
        kwargs = dict(kwargs)
        pipeline.connectors = ConnectorOutputs(int(kwargs.pop(VIDEO_WIDTH)), kwargs["prompt_embeds"].device)
        video, audio = pipeline(**kwargs)[:2]
        return video, {"audio_latents": audio}

    def draw(self, pipeline, kwargs):
        return self.sample_outputs(pipeline, kwargs)[0]

    def unpack_latents(self, pipeline, latents, size, vae_factor):
        # LTX2Pipeline returns the video latents unpacked and denormalised; the shared code denormalises what it is given.
        vae = pipeline.vae
        return pipeline._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


ARCHITECTURE = Architecture(
    record=Record(
        name="ltx2",
        trace_frames=121,  # LTX2Pipeline's default length: about 5 s at 24 fps
        pipeline_class="LTX2Pipeline",
        denoiser="transformer",
        denoiser_class="LTX2VideoTransformer3DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        tokenizer_lengths={"tokenizer": PROMPT_TOKENS},
        # The text connectors are frozen and run while caching, after Gemma: their outputs are the conditioning.
        text=PromptText(processors=("connectors",)),
        patch_factor=1,
        codec=LTX2Latents(vae_class="AutoencoderKLLTX2Video", frame_multiple=8, frame_rate=24.0, vae_while_sampling=True),
        conditions=(AudioTrack(),),
        preset_name="tiny-ltx2",
        preset={
            # Built in this order, each from its own seed.
            "transformer": {
                "in_channels": 8, "out_channels": 8, "num_attention_heads": 2, "attention_head_dim": 8, "cross_attention_dim": 16,
                "audio_in_channels": 16, "audio_out_channels": 16, "audio_num_attention_heads": 2, "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8,
                "num_layers": 2, "caption_channels": 32, "rope_double_precision": False, "rope_type": "split",
            },
            # 8x in space and time, as in diffusers' LTX-2 tests (LTX-2's is 32x space with patch_size 4): a 32-pixel clip has 4x4 latents.
            "vae": {
                "in_channels": 3, "out_channels": 3, "latent_channels": 8, "block_out_channels": [16, 16, 16], "decoder_block_out_channels": [16, 16, 16],
                "layers_per_block": [1, 1, 1], "decoder_layers_per_block": [1, 1, 1, 1], "spatio_temporal_scaling": [True, True, True],
                "decoder_spatio_temporal_scaling": [True, True, True], "decoder_inject_noise": [False, False, False, False],
                "downsample_type": ["spatiotemporal"] * 3, "upsample_residual": [False] * 3, "upsample_factor": [1] * 3, "timestep_conditioning": False,
                "patch_size": 1, "patch_size_t": 1, "encoder_causal": True, "decoder_causal": False,
            },
            # 16 kHz stereo, 16 mel bins (LTX-2: 64), 4 latent channels (LTX-2: 8): tokens of 4 x 16/4 = 16 features, base_channels, as the statistics.
            "audio_vae": {
                "class": "AutoencoderKLLTX2Audio", "base_channels": 16, "output_channels": 2, "ch_mult": [1, 2, 2], "num_res_blocks": 1, "in_channels": 2,
                "resolution": 32, "latent_channels": 4, "mel_bins": 16, "sample_rate": 16000, "mel_hop_length": 160,
            },
            # Upsamples the mel frames by the hop length (5 x 4 x 4 x 2 = 160) to 16 kHz stereo.
            "vocoder": {
                "class": "ltx2.LTX2Vocoder", "in_channels": 32, "hidden_channels": 32, "out_channels": 2, "upsample_kernel_sizes": [10, 8, 8, 4],
                "upsample_factors": [5, 4, 4, 2], "resnet_kernel_sizes": [3], "resnet_dilations": [[1, 3, 5]], "leaky_relu_negative_slope": 0.1,
                "output_sampling_rate": 16000,
            },
            "connectors": {
                "class": "ltx2.LTX2TextConnectors", "caption_channels": 32, "text_proj_in_factor": 3, "video_connector_num_attention_heads": 4,
                "video_connector_attention_head_dim": 8, "video_connector_num_layers": 1, "video_connector_num_learnable_registers": None,
                "audio_connector_num_attention_heads": 4, "audio_connector_attention_head_dim": 8, "audio_connector_num_layers": 1,
                "audio_connector_num_learnable_registers": None, "connector_rope_base_seq_len": 32, "rope_double_precision": False, "rope_type": "split",
            },
            "text_encoder": tiny_gemma3(PROMPT_TOKENS),
            # LTX-2's sampler: Euler with a shift that grows with the number of video tokens.
            "scheduler": {
                "class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True,
                "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024, "max_image_seq_len": 4096,
            },
        },
        # Every linear layer of the blocks' attention and feed-forward, video and audio alike (audio_attn1.to_q, audio_to_video_attn.to_q,
        # audio_ff.net.0.proj: peft matches a suffix after a dot, so the audio feed-forward is named),
        # as diffusion-pipe targets LTX-2's BasicAVTransformerBlock.
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2"),
    ),
    call=LTX2Call(),
    prompts=LTX2Prompts(),
    sampling=LTX2Sampling(),
    layouts=LTXLayouts(),
)
