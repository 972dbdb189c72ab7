"""LTX-2.5 (``ltx-2.5``; diffusers 0.42.1 ships it only as ``LTX25ModularPipeline`` with ``LTX25AutoBlocks``): LTX-2's entry
where the model allows it, through the door for modular pipelines where the pipeline differs.

What differs from LTX-2 (``bases/ltx2.py``), read from diffusers' blocks and its converter
(``scripts/convert_ltx2_to_diffusers.py``, version "2.5"):

- *Transformer*: the same class, ``LTX2VideoTransformer3DModel``, with LTX-2.3's config (gated attention,
  cross-attention modulation, no caption projection: the connectors project per modality) and two deltas: the
  video feed-forward has no bias (``ff_bias`` false) and a learned keyframe position embedding
  (``use_keyframes_abs_pos_embedding``) that only keyframe-conditioned sampling applies. Its call is LTX-2's
  (``LTX2Call``: video and audio streams in one call, the audio loss term added), held to the modular pipeline's
  denoiser block, ``LTX2LoopDenoiser`` (``tests/unit/diffusion/test_ltx25.py``).
- *Prompts*: Gemma 4 (``Gemma4UnifiedForConditionalGeneration``) in place of Gemma 3, its hidden states of every
  layer through the same text connectors: the pipeline's own text block (``LTX2TextConditioningStep``: the
  encoder step, then the connector step), whose connector outputs the text cache keeps, as LTX-2's.
- *Decoding*: the pipeline decodes video with ``LTX2VideoDiffusionDecoderModel`` (``diffusion_decoder``), a decoder
  that is itself a diffusion model (it draws noise and denoises pixels), in the latent space of the convolutional
  VAE, which LTX-2.5 still ships and which training needs (the diffusion decoder has no encoder). Samples drawn
  during training are decoded by the convolutional VAE's decoder (diffusers' own alternative:
  ``blocks.sub_blocks["decode"] = LTX2AutoDecoderStep()``): on the CPU the diffusion decoder runs FlexAttention's
  unfused path (about 30 s for one 9-frame 32-pixel clip of the tiny preset on a busy 2-core machine, which torch warns
  may be incorrect), and sampling it adds a second generator-dependent draw to each sample. The folder keeps the
  diffusion decoder for inference outside ZeRO-Pipe.
- *Sampling*: the modular pipeline's run is not called (``sampler.pipeline_call`` refuses a modular pipeline): the
  shared two-stream loop (``sampler.denoise_streams``) steps the video and audio latents on the pipeline's
  scheduler and its copy, their timesteps set by the pipeline's own ``LTX2SetTimestepsStep`` (sigmas
  ``linspace(1, 1/steps)``, shifted by the video's token count), each step LTX-2's joint call with
  classifier-free guidance against the empty prompt for both streams (the two prompts in one batch, as LTX2Pipeline batches them) (the pipeline's guiders add
  spatio-temporal and modality guidance, each one more transformer pass per step; LTX-2's samples leave them out too).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from zeropipe.families.diffusion.bases.ltx2 import ARCHITECTURE as LTX2
from zeropipe.families.diffusion.bases.ltx2 import LTX2Prompts
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.modular import TextEncoderBlock
from zeropipe.families.diffusion.roles import Sampling

TINY_TEXT_LAYERS = 2


class LTX25Prompts(TextEncoderBlock, LTX2Prompts):
    """The pipeline's text block (Gemma 4, then the connectors), its conditional outputs cached as LTX-2's prompt encoding caches them."""

    def cached(self, out):
        return {**out, "prompt_attention_mask": out["prompt_attention_mask"].float()}

    def encode_prompts(self, pipeline, prompts, device):
        from zeropipe.families.diffusion.modular import run_block

        # LTX-2's prompt length (1024), or a shorter tokenizer's own (the tiny preset's 128), as LTX-2's entry pads.
        length = min(self.record.tokenizer_length("tokenizer"), int(pipeline.tokenizer.model_max_length))
        out = run_block(pipeline, pipeline.blocks.sub_blocks[self.block], self.returns, prompt=list(prompts), max_sequence_length=length, **self.arguments)
        return self.cached({self.returns[name]: value for name, value in out.items()})


class LTX25Sampling(Sampling):
    """Video and audio drawn by the shared two-stream loop with LTX-2's joint call (see the module's docstring)."""

    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {"condition": condition, "negative": negative, "guidance_scale": guidance_scale}

    def sample_outputs(self, pipeline, kwargs):
        from diffusers import LTX2Pipeline
        from diffusers.modular_pipelines.ltx2.before_denoise import LTX2SetTimestepsStep

        from zeropipe.families.diffusion.core import PredictContext
        from zeropipe.families.diffusion.modular import run_block
        from zeropipe.families.diffusion.sampler import denoise_streams

        call = self.entry.call
        model = pipeline.transformer
        module = getattr(model, "module", model)
        parameter = next(module.parameters())
        device, dtype = parameter.device, parameter.dtype
        condition, negative = kwargs["condition"], kwargs["negative"]
        batch = condition["prompt_embeds"].shape[0]
        factor, temporal = pipeline.zeropipe_vae_factor, self.record.codec.frame_multiple
        frames, height, width = int(kwargs["num_frames"]), int(kwargs["height"]), int(kwargs["width"])
        context = PredictContext(device, dtype, factor, 1.0)
        generator = kwargs["generator"]
        video = torch.randn((batch, module.config.in_channels, (frames - 1) // temporal + 1, height // factor, width // factor), generator=generator).to(device)
        tokens = call.audio_tokens(module, video)
        audio = torch.randn((batch, tokens, module.config.audio_in_channels), generator=generator).to(device)
        steps = run_block(
            pipeline, LTX2SetTimestepsStep(), ("timesteps", "audio_scheduler"), num_inference_steps=int(kwargs["num_inference_steps"]),
            num_frames=frames, height=height, width=width,
        )
        scale = float(kwargs["guidance_scale"])

        guided = scale > 1
        # With guidance, the conditional and the empty prompt in one batch (as LTX2Pipeline batches them): one transformer pass per step.
        prompts = {name: torch.cat([negative[name], value]) for name, value in condition.items()} if guided else condition

        def model_output(index, step, streams):
            current = [stream.to(dtype) for stream in streams]
            if guided:
                current = [torch.cat([stream, stream]) for stream in current]
            times = step[0].expand(current[0].shape[0]).to(device)
            velocity = [out.float() for out in call.joint_predict(model, *current, times, prompts, context)]
            if guided:
                velocity = [unconditional + scale * (conditional - unconditional) for unconditional, conditional in (out.chunk(2) for out in velocity)]
            return tuple(velocity)

        timesteps = [(t, t) for t in steps["timesteps"]]
        video, audio = denoise_streams((pipeline.scheduler, steps["audio_scheduler"]), (video, audio), timesteps, model_output)
        # As LTX2Pipeline returns its audio latents: denormalised by the audio VAE's statistics, unpacked to (B, C, L, mel bins).
        audio_vae = pipeline.audio_vae
        audio = LTX2Pipeline._denormalize_audio_latents(audio, audio_vae.latents_mean, audio_vae.latents_std)
        audio = LTX2Pipeline._unpack_audio_latents(audio, tokens, num_mel_bins=audio_vae.config.mel_bins // audio_vae.mel_compression_ratio)
        return video, {"audio_latents": audio}

    def draw(self, pipeline, kwargs):
        return self.sample_outputs(pipeline, kwargs)[0]


def _preset() -> dict:
    preset = copy.deepcopy(LTX2.record.preset)
    # LTX-2.3's layout plus LTX-2.5's two deltas (diffusers' converter, version "2.5"), at LTX-2's tiny widths.
    preset["transformer"].update(
        use_prompt_embeddings=False, gated_attn=True, cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True, perturbed_attn=True,
        ff_bias=False, use_keyframes_abs_pos_embedding=True,
    )
    # Gemma 4 at 2 layers of 32 (text only: the vision and audio towers are optional in its config and never called for text).
    preset["text_encoder"] = {
        "class": "Gemma4UnifiedForConditionalGeneration",
        "text_config": {
            "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": TINY_TEXT_LAYERS, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 16, "max_position_embeddings": 2048, "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
        },
    }
    # The connectors' input is Gemma's hidden states of every layer (layers + 1, as the converter derives it from the Gemma 4 config),
    # projected per modality to each stream's cross-attention width.
    preset["connectors"].update(
        caption_channels=32, text_proj_in_factor=TINY_TEXT_LAYERS + 1, per_modality_projections=True, video_hidden_dim=16, audio_hidden_dim=8,
        video_connector_num_attention_heads=2, audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=4, video_gated_attn=True,
        audio_gated_attn=True,
    )
    # The diffusion decoder in the tiny VAE's latent space (8 channels, 8x in space and time): diffusers' own tiny test config at patch size 1.
    preset["diffusion_decoder"] = {
        "class": "LTX2VideoDiffusionDecoderModel", "out_channels": 3, "latent_channels": 8, "patch_size": 1, "decoder_head_dim": 16,
        "decoder_stage_channels": [64, 32, 16, 16, 16], "decoder_stage_depths": [1, 1, 1, 1, 2], "decoder_stage_kernels": [[3, 3, 3]] * 4,
        "decoder_upsample_strides": [[1, 2, 2], [2, 1, 1], [2, 2, 2], [2, 2, 2]], "decoder_upsample_channel_reductions": [2, 2, 1, 1],
        "decoder_stage5_kernel": [3, 3, 3], "decoder_t_emb_dim": 32, "spatial_compression_ratio": 8, "temporal_compression_ratio": 8,
    }
    # LTX-2.5's scheduler as the converter writes it for the non-distilled checkpoint: dynamic shifting, terminal shift 0.1.
    preset["scheduler"] = {**preset["scheduler"], "shift_terminal": 0.1}
    return preset


ARCHITECTURE = Architecture(
    record=dataclasses.replace(
        LTX2.record,
        name="ltx-2.5",
        pipeline_class="LTX25ModularPipeline",
        preset_name="tiny-ltx-2.5",
        preset=_preset(),
    ),
    call=LTX2.call,
    prompts=LTX25Prompts(
        block="text_encoder",
        returns={"connector_prompt_embeds": "prompt_embeds", "connector_audio_prompt_embeds": "audio_prompt_embeds", "connector_attention_mask": "prompt_attention_mask"},
        arguments={"negative_prompt": ""},
    ),
    sampling=LTX25Sampling(),
    layouts=LTX2.layouts,
)
