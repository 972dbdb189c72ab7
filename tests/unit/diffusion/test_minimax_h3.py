"""MiniMax-H3's denoiser call and sampling step, held to MiniMaxH3ModularPipeline's own blocks on a tiny transformer.

The reference is the modular pipeline run block by block as its t2va workflow runs them (layout, latents, the two
schedules, then the denoise loop's denoiser block, or the whole denoise step); the entry's call is given the same
video latents and audio rows in its own conventions (sigma time, noise-ward velocity) and must return the same
velocities, and the entry's draw through the shared sampler must end at the same latents.
"""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.core import PredictContext
from zeropipe.families.diffusion.bases.minimax_h3 import AUDIO_SHIFT, VIDEO_SHIFT, MiniMaxH3Call, audio_sigma, draw, unpatchify_video_rows
from zeropipe.families.diffusion.modular import run_block, run_loop_block

CPU = torch.device("cpu")
TINY = {
    "num_attention_heads": 2, "attention_head_dim": 32, "hidden_size": 64, "num_layers": 2, "num_refiner_layers": 1, "ffn_dim": 96,
    "in_channels": 24, "audio_in_channels": 32, "text_dim": 16, "freq_dim": 32, "time_embed_hidden_dim": 64, "time_embed_dim": 32, "rope_freq_dim": 4,
}
LAYOUT = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices", "num_condition_video_rows", "num_condition_audio_rows",
          "num_latent_frames", "latent_height", "latent_width", "num_audio_latents")


@pytest.fixture(scope="module")
def reference():
    """The tiny modular pipeline, and the t2va state its blocks built for a 5-second 64x64 request."""
    from diffusers import MiniMaxH3ModularPipeline, MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLatentsStep, MiniMaxH3PrepareLayoutStep, MiniMaxH3SetTimestepsStep

    torch.manual_seed(0)
    transformer = MiniMaxH3Transformer3DModel(**TINY).eval()
    pipeline = MiniMaxH3ModularPipeline()
    pipeline.update_components(transformer=transformer, scheduler=MiniMaxH3Scheduler(shift=VIDEO_SHIFT), audio_scheduler=MiniMaxH3Scheduler(shift=AUDIO_SHIFT))
    embeds = torch.randn(1, 5, TINY["text_dim"])
    tags = torch.full((5,), pipeline.text_tag, dtype=torch.long)
    state = run_block(pipeline, MiniMaxH3PrepareLayoutStep(), LAYOUT, text_token_tags=tags, height=64, width=64, num_frames=121, keyframe_anchors=())
    latents = torch.randn(1, 24, state["num_latent_frames"], state["latent_height"], state["latent_width"])
    state.update(run_block(pipeline, MiniMaxH3PrepareLatentsStep(), ("latents", "audio_latents"), latents=latents, **state))
    state.update(run_block(pipeline, MiniMaxH3SetTimestepsStep(), ("timesteps", "audio_timesteps", "row_timestep_plan"), num_inference_steps=4, **state))
    return pipeline, transformer, embeds, latents, state


def condition_of(embeds):
    """The text cache's form: the prompt padded to a longer batch, with its mask."""
    padded = torch.cat([embeds, torch.zeros(1, 3, embeds.shape[-1])], dim=1)
    return {"prompt_embeds": padded, "prompt_embeds_mask": torch.tensor([[1] * embeds.shape[1] + [0, 0, 0]])}


def test_the_audio_sigma_is_the_audio_schedules(reference):
    _, _, _, _, state = reference
    video, audio = 1 - state["timesteps"], 1 - state["audio_timesteps"]
    assert torch.allclose(audio_sigma(video), audio, atol=1e-6)


def test_predict_is_the_denoiser_blocks_output(reference):
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3LoopDenoiser

    pipeline, transformer, embeds, latents, state = reference
    step = 1
    fields = {name: state[name] for name in ("token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")}
    out = run_loop_block(
        pipeline, MiniMaxH3LoopDenoiser(), step, state["timesteps"][step], latents=state["latents"].clone(), audio_latents=state["audio_latents"].clone(),
        prompt_embeds=embeds, row_timestep_plan=state["row_timestep_plan"], denoiser_input_fields=fields, attention_kwargs=None,
    )
    sigma = (1 - state["timesteps"][step]).view(1)
    audio_rows = state["audio_latents"][None]
    video_v, audio_v = MiniMaxH3Call.joint_predict(
        MiniMaxH3Call(), transformer, latents, audio_rows, sigma, 1 - state["audio_timesteps"][step].view(1), condition_of(embeds), PredictContext(CPU, torch.float32, 16, 1.0),
    )
    frames, height, width = state["num_latent_frames"], state["latent_height"], state["latent_width"]
    expected = unpatchify_video_rows(out.noise_pred[0], 24, frames, height, width, (1, 2, 2))
    assert torch.allclose(-video_v, expected, atol=1e-5), (video_v + expected).abs().max()
    assert torch.allclose(-audio_v, out.audio_noise_pred, atol=1e-5)


def test_draw_through_the_shared_sampler_is_the_denoise_step(reference):
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3DenoiseStep

    pipeline, transformer, embeds, latents, state = reference
    fields = {name: state[name] for name in ("token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")}
    expected = run_block(
        pipeline, MiniMaxH3DenoiseStep(), ("latents", "audio_latents"), latents=state["latents"].clone(), audio_latents=state["audio_latents"].clone(),
        prompt_embeds=embeds, row_timestep_plan=state["row_timestep_plan"], timesteps=state["timesteps"], audio_timesteps=state["audio_timesteps"],
        num_condition_video_rows=0, num_condition_audio_rows=0, groups={"denoiser_input_fields": fields},
    )
    video, audio = draw(
        MiniMaxH3Call(), transformer, MiniMaxH3Scheduler(shift=VIDEO_SHIFT), MiniMaxH3Scheduler(shift=AUDIO_SHIFT), latents.clone(), state["audio_latents"][None].clone(), 4,
        condition_of(embeds), PredictContext(CPU, torch.float32, 16, 1.0),
    )
    frames, height, width = state["num_latent_frames"], state["latent_height"], state["latent_width"]
    assert torch.allclose(video, unpatchify_video_rows(expected["latents"], 24, frames, height, width, (1, 2, 2)), atol=1e-4)
    assert torch.allclose(audio[0], expected["audio_latents"], atol=1e-4)


def test_prompts_through_the_text_encoder_block_drive_the_call_as_the_pipeline_does():
    """Two prompts through the pipeline's own text-encoder block (a tiny 51-layer Qwen3-VL: it reads hidden state 50), cached
    padded with a mask; the entry's call on each cached prompt equals the denoiser block given that prompt's block output."""
    import transformers
    from diffusers import MiniMaxH3ModularPipeline, MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
    from diffusers.modular_pipelines.minimax_h3.denoise import MiniMaxH3LoopDenoiser

    from zeropipe.families.diffusion.bases.minimax_h3 import MiniMaxH3Prompts, packed_sequence, row_timesteps
    from zeropipe.families.diffusion.bases.qwen3_vl_text import ProcessorTextPath
    from zeropipe.families.diffusion.tiny.components import tiny_qwen3_vl_generation
    from zeropipe.families.diffusion.tiny.tokenizers import character_qwen_tokenizer

    fields = tiny_qwen3_vl_generation()
    fields.pop("class")
    fields["text_config"] = {**fields["text_config"], "num_hidden_layers": 51, "hidden_size": 16, "intermediate_size": 32, "head_dim": 8,
                             "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
    fields["vision_config"] = {**fields["vision_config"], "out_hidden_size": 16}
    torch.manual_seed(2)
    encoder = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(**fields)).eval()
    tokenizer = character_qwen_tokenizer(256)
    transformer = MiniMaxH3Transformer3DModel(**{**TINY, "text_dim": 16}).eval()
    pipeline = MiniMaxH3ModularPipeline()
    pipeline.update_components(text_encoder=encoder, tokenizer=tokenizer, processor=ProcessorTextPath(tokenizer), transformer=transformer)
    prompts = ["a red circle", "two blue squares on grey"]
    cached = MiniMaxH3Prompts().encode_prompts(pipeline, prompts, CPU)
    assert cached["prompt_embeds_mask"].sum(dim=1).tolist() == [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]

    torch.manual_seed(3)
    latents, audio = torch.randn(2, 24, 2, 4, 4), torch.randn(2, 2 * 3, 32)
    sigma, level = torch.tensor([0.7, 0.4]), torch.tensor([0.5, 0.2])
    video_v, audio_v = MiniMaxH3Call().joint_predict(transformer, latents, audio, sigma, level, cached, PredictContext(CPU, torch.float32, 16, 1.0))
    for index, prompt in enumerate(prompts):
        block = run_block(pipeline, pipeline.blocks.sub_blocks["text_encoder"], ("prompt_embeds", "text_token_tags"), prompt=prompt)
        assert torch.equal(block["text_token_tags"], torch.full_like(block["text_token_tags"], pipeline.text_tag))
        length = block["prompt_embeds"].shape[1]
        position_ids, tags, video_rows, audio_rows, text_rows = packed_sequence(transformer.config, length, 2, 4, 4, 3, CPU)
        plan = [row_timesteps(video_rows, audio_rows, length, float(1 - sigma[index]), float(1 - level[index]))]
        out = run_loop_block(
            pipeline, MiniMaxH3LoopDenoiser(), 0, torch.tensor(0.0), latents=patchify_video_latents(latents[index : index + 1], (1, 2, 2)),
            audio_latents=audio[index], prompt_embeds=block["prompt_embeds"], row_timestep_plan=plan, attention_kwargs=None,
            denoiser_input_fields={"token_tags": tags, "position_ids": position_ids, "video_indices": video_rows, "audio_indices": audio_rows, "text_indices": text_rows},
        )
        assert torch.allclose(-video_v[index], unpatchify_video_rows(out.noise_pred[0], 24, 2, 4, 4, (1, 2, 2))[0], atol=1e-5)
        assert torch.allclose(-audio_v[index], out.audio_noise_pred[0], atol=1e-5)


# ------------------------------------------------------------------ the entry's parts, held to the pipeline's own encode and decode
@pytest.fixture(scope="module")
def tiny_parts():
    """The entry's tiny video and audio VAEs (its preset's), in a modular pipeline with the entry's tiny transformer."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3ModularPipeline

    from zeropipe.families.diffusion.entries.minimax_h3 import ARCHITECTURE

    preset = ARCHITECTURE.record.preset
    torch.manual_seed(4)
    # Statistics other than (0, 1), so that a normalisation left out or inverted shows.
    vae = AutoencoderKLMiniMaxH3(**{**preset["vae"], "latents_mean": [0.1 * (c % 5) for c in range(24)], "latents_std": [0.5 + 0.1 * (c % 3) for c in range(24)]}).eval()
    audio_fields = {key: value for key, value in preset["audio_vae"].items() if key != "class"}
    audio_vae = AutoencoderKLMiniMaxH3Audio(**{**audio_fields, "latents_mean": [0.05 * (c % 7) for c in range(32)], "latents_std": [0.8 + 0.1 * (c % 4) for c in range(32)]}).eval()
    pipeline = MiniMaxH3ModularPipeline()
    pipeline.update_components(vae=vae, audio_vae=audio_vae)
    return ARCHITECTURE, pipeline, vae, audio_vae


def test_the_codec_takes_17k_plus_5_frames_and_names_that_rule():
    from zeropipe.data.videos import check_frame_buckets
    from zeropipe.families.diffusion.entries.minimax_h3 import ARCHITECTURE

    codec = ARCHITECTURE.record.codec
    assert [frames for frames in range(1, 40) if codec.accepts_frames(frames)] == [1, 5, 22, 39]
    with pytest.raises(ValueError, match=r"17k\+5 frames \(e\.g\. 5, 22, 39, 56\)"):
        check_frame_buckets([21], codec.accepts_frames, codec.frame_multiple, codec.frame_remainder)


def test_the_codecs_latents_are_the_pipelines_keyframe_encoding_and_decode_as_its_decode_step(tiny_parts):
    """Encoding: ``encode_vae_condition`` (ImageNet pixels, the posterior sampled under seed 42, float16, normalised per channel) is
    the codec's cached distribution sampled the same way and normalised by the codec's statistics. Decoding: the codec's pixels
    are ``MiniMaxH3VideoDecodeStep``'s video."""
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3VideoDecodeStep
    from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

    arch, pipeline, vae, _ = tiny_parts
    codec = arch.record.codec
    torch.manual_seed(5)
    pixels = torch.randint(0, 256, (1, 3, 22, 32, 32), dtype=torch.uint8)
    expected = encode_vae_condition(vae, pixels, pipeline.pixel_mean, pipeline.pixel_std, pipeline.keyframe_encode_seed)
    mean, std = codec.encode(vae, pixels.float() / 127.5 - 1)
    sampled = (mean + std * torch.randn(mean.shape, generator=torch.Generator().manual_seed(pipeline.keyframe_encode_seed))).half().float()
    shift, scale = codec.normalization(dict(vae.config))
    ours = (sampled - shift.view(1, -1, 1, 1, 1)) * scale.view(1, -1, 1, 1, 1)
    assert ours.shape == expected.shape == (1, 24, 7, 2, 2)  # 17k+5 frames to 5k+2 latent frames
    assert torch.allclose(ours, expected, atol=1e-5), (ours - expected).abs().max()

    decoded = run_block(pipeline, MiniMaxH3VideoDecodeStep(), ("videos",), latents=expected, output_type="pt")["videos"]
    denormalized = expected / scale.view(1, -1, 1, 1, 1) + shift.view(1, -1, 1, 1, 1)
    ours = codec.decode(vae, denormalized) / 2 + 0.5  # what the task turns into uint8 pixels
    assert torch.allclose(ours.permute(0, 2, 1, 3, 4), decoded, atol=1e-5), (ours.permute(0, 2, 1, 3, 4) - decoded).abs().max()


def test_the_audio_part_encodes_a_soundtrack_as_the_reference_encoder_and_decodes_as_the_audio_decode_step(tiny_parts):
    """The part's cached rows of a stereo clip are ``MiniMaxH3Ref2VAReferenceEncoderStep``'s audio rows of that soundtrack (mean
    of each channel's posterior, normalised, channel-major); drawn rows decode to ``MiniMaxH3AfterDenoiseStep`` +
    ``MiniMaxH3AudioDecodeStep``'s waveform."""
    from types import SimpleNamespace

    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AfterDenoiseStep, MiniMaxH3AudioDecodeStep
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

    from zeropipe.families.diffusion.parts.base import Encoding
    from zeropipe.families.diffusion.parts.waveform_audio import WaveformAudioTrack, stereo_latents

    arch, pipeline, _, audio_vae = tiny_parts
    (part,) = arch.record.conditions
    assert isinstance(part, WaveformAudioTrack)
    frames = 22
    count = part.latent_count(frames, 24.0)
    assert count == audio_latent_num_frames(frames) == 37
    torch.manual_seed(6)
    waveform = torch.rand(2, int(round(frames / 24 * 32000))) * 2 - 1  # what read_audio gives for the clip: (2, samples) at 32 kHz
    reference = SimpleNamespace(kind="audio", has_audio=True, audio=waveform)
    expected = run_block(pipeline, MiniMaxH3Ref2VAReferenceEncoderStep(), ("audio_condition_latents",), normalized_references=[reference])["audio_condition_latents"][0]
    (rows,) = part.encode(Encoding(None, torch.zeros(0), [{"waveform": waveform, "latents": count}], audio_vae, arch.record.codec, CPU))
    assert rows.shape == expected.shape == (2 * count, 32)
    assert torch.allclose(rows, expected, atol=1e-5), (rows - expected).abs().max()

    state = run_block(
        pipeline, MiniMaxH3AfterDenoiseStep(), ("audio_latents",), latents=torch.zeros(1, 24 * 4), audio_latents=rows, num_latent_frames=1, latent_height=2,
        latent_width=2, num_audio_latents=count,
    )
    decoded = run_block(pipeline, MiniMaxH3AudioDecodeStep(), ("audio",), audio_latents=state["audio_latents"])["audio"]
    config = audio_vae.config
    with torch.no_grad():
        ours = audio_vae.decode(stereo_latents(rows[None], torch.tensor(config.latents_mean), torch.tensor(config.latents_std))).sample.reshape(1, 2, -1)
    assert torch.allclose(ours, decoded, atol=1e-5)


def test_the_guidance_preserving_objective_fits_the_raw_velocity_of_both_streams():
    """With ``model.diffusion.guidance_preserving`` the entry's loss is diffusion-pipe's CFG-augmented one: both streams' guided
    velocities combined with the model's own unconditional ones (the empty prompt: no text rows) by ``(v_g + (w-1) u) / w``."""
    from diffusers import MiniMaxH3Transformer3DModel

    from zeropipe.families.diffusion.entries.minimax_h3 import ARCHITECTURE
    from zeropipe.families.diffusion.objectives import NoisedBatch, weighted_mse
    from zeropipe.families.diffusion.parts.guidance import SCALE, UNCONDITIONAL

    torch.manual_seed(7)
    model = MiniMaxH3Transformer3DModel(**ARCHITECTURE.record.preset["transformer"])
    latents, noise = torch.randn(1, 24, 2, 2, 2), torch.randn(1, 24, 2, 2, 2)
    sigma = torch.tensor([0.6])
    audio = torch.randn(1, 2 * 3, 32)
    own = {**condition_of(torch.randn(1, 5, 16)), "audio_latents": audio}
    empty = {"prompt_embeds": torch.zeros(1, 0, 16), "prompt_embeds_mask": torch.zeros(1, 0, dtype=torch.long)}
    guided = {**own, **{UNCONDITIONAL + key: value for key, value in empty.items()}, SCALE: torch.tensor(4.0)}
    noised = NoisedBatch(model_input=(1 - sigma) * latents + sigma * noise, timesteps=sigma * 1000, target=noise - latents, weights=None)
    context = PredictContext(CPU, torch.float32, 16, 1.0)

    torch.manual_seed(8)
    loss = ARCHITECTURE.call.loss(model, noised, guided, context)
    torch.manual_seed(8)
    plain = ARCHITECTURE.call.loss(model, noised, own, context)
    torch.manual_seed(8)
    audio_noise = torch.randn(audio.shape)
    level = audio_sigma(sigma)
    noisy = (1 - level.view(-1, 1, 1)) * audio + level.view(-1, 1, 1) * audio_noise
    call = ARCHITECTURE.call
    with torch.no_grad():
        video_g, audio_g = call.joint_predict(model, noised.model_input, noisy, sigma, level, own, context)
        video_u, audio_u = call.joint_predict(model, noised.model_input, noisy, sigma, level, {**own, **empty}, context)
    share = latents[0].numel() / (latents[0].numel() + audio[0].numel())
    expected = share * weighted_mse((video_g + 3 * video_u) / 4, noised.target, None) + (1 - share) * weighted_mse((audio_g + 3 * audio_u) / 4, audio_noise - audio, None)
    assert torch.allclose(loss, expected, rtol=1e-5), (loss, expected)
    assert not torch.allclose(loss, plain)


def test_a_run_of_images_alone_is_told_its_samples_need_a_clip():
    """The VAE encodes one frame but cannot decode one latent frame: a run whose samples would be one frame is refused by check."""
    from zeropipe.config.schema import RunConfig
    from zeropipe.families.diffusion.entries.minimax_h3 import ARCHITECTURE

    def problems(video):
        config = RunConfig.model_validate({"model": {"config": {"pipeline": "tiny-minimax-h3"}, "lora": {"r": 4}}, "data": {"synthetic": {"task": "shapes"}, "video": video}})
        return ARCHITECTURE.record.codec.problems(config, ARCHITECTURE)

    assert [key for key, _ in problems({"frame_buckets": [1]})] == ["data.video.sample_frames"]
    assert "22" in problems({"frame_buckets": [1]})[0][1]
    assert problems({"frame_buckets": [1], "sample_frames": 22}) == [] and problems({"frame_buckets": [1, 22]}) == []
