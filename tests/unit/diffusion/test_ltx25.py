"""LTX-2.5 (diffusers 0.42.1 ships it only as LTX25ModularPipeline): its tiny preset in the modular layout, and the entry's
prompts and joint video/audio call held to the modular pipeline's own text block and denoiser block (LTX2LoopDenoiser)."""

from __future__ import annotations

import json

import pytest
import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_named, architecture_of
from zeropipe.families.diffusion.modular import run_block, run_loop_block
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, text_pipeline

LTX25 = architecture_named("ltx-2.5")
CPU = torch.device("cpu")
CONTEXT = PredictContext(CPU, torch.float32, 8, 1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx25") / "pipeline"
    build_tiny_pipeline({"pipeline": "tiny-ltx-2.5"}, folder, seed=1)
    return folder


@pytest.fixture(scope="module")
def pipeline(tiny):
    from diffusers import LTX25ModularPipeline
    from diffusers.guiders import LTX2Guidance

    pipe = LTX25ModularPipeline.from_pretrained(str(tiny))
    pipe.load_components(dtype=torch.float32)
    # The guiders' defaults add unconditional, spatio-temporal and modality passes; with these only the conditional pass runs,
    # so the block's output is the conditional prediction the entry's call is compared with.
    pipe.update_components(guider=LTX2Guidance(), audio_guider=LTX2Guidance())
    return pipe


def test_the_tiny_preset_is_ltx25s_modular_layout_and_its_transformer_is_ltx2s_class_with_25s_deltas(tiny, pipeline):
    index = json.loads((tiny / "modular_model_index.json").read_text())
    assert index["_class_name"] == "LTX25ModularPipeline" and architecture_of(tiny) is LTX25
    # The convolutional VAE (training encodes with it) and the diffusion decoder the pipeline decodes with are both in the folder.
    assert {"vae", "diffusion_decoder", "transformer", "connectors", "text_encoder", "audio_vae", "vocoder"} <= set(index)
    config = pipeline.transformer.config
    assert type(pipeline.transformer).__name__ == LTX25.record.denoiser_class == architecture_named("ltx2").record.denoiser_class
    assert (config.ff_bias, config.use_keyframes_abs_pos_embedding, config.use_prompt_embeddings) == (False, True, False)
    assert type(pipeline.text_encoder).__name__ == "Gemma4UnifiedForConditionalGeneration"


def test_prompts_and_the_joint_call_are_the_modular_pipelines_text_block_and_denoiser_block(tiny, pipeline):
    from diffusers import LTX2Pipeline
    from diffusers.modular_pipelines.ltx2.before_denoise import LTX2PrepareCoordsStep, LTX2SetTimestepsStep
    from diffusers.modular_pipelines.ltx2.denoise import LTX2LoopBeforeDenoiser, LTX2LoopDenoiser

    prompt = "a red ball"
    # The text cache's entry is the pipeline's text block's conditional output (Gemma 4, then the connectors).
    condition = {name: value[None] for name, value in encode_prompts(text_pipeline(tiny, LTX25, torch.float32, CPU), LTX25, [prompt], CPU)[0].items()}
    names = ("connector_prompt_embeds", "connector_audio_prompt_embeds", "connector_attention_mask", "negative_connector_prompt_embeds",
             "negative_connector_audio_prompt_embeds", "negative_connector_attention_mask")
    text = run_block(pipeline, pipeline.blocks.sub_blocks["text_encoder"], names, prompt=[prompt], negative_prompt="", max_sequence_length=128)
    assert torch.equal(condition["prompt_embeds"], text["connector_prompt_embeds"])
    assert torch.equal(condition["audio_prompt_embeds"], text["connector_audio_prompt_embeds"])
    assert torch.equal(condition["prompt_attention_mask"], text["connector_attention_mask"].float())

    # One step of the pipeline's denoise loop (step 1 of 2, below sigma 1) on a 9-frame 32-pixel clip, its schedules and rotary
    # coordinates from the pipeline's own blocks.
    generator = torch.Generator().manual_seed(0)
    video = torch.randn(1, 8, 2, 4, 4, generator=generator)
    tokens = LTX25.call.audio_tokens(pipeline.transformer, video)
    audio = torch.randn(1, tokens, pipeline.transformer.config.audio_in_channels, generator=generator)
    size = {"height": 32, "width": 32, "num_frames": 9}
    steps = run_block(pipeline, LTX2SetTimestepsStep(), ("timesteps", "audio_scheduler"), num_inference_steps=2, **size)
    coords = run_block(pipeline, LTX2PrepareCoordsStep(), ("video_coords", "audio_coords"), batch_size=1, num_videos_per_prompt=1, audio_num_frames=tokens, frame_rate=24.0, **size)
    t = steps["timesteps"][1]
    packed = LTX2Pipeline._pack_latents(video)
    state = run_loop_block(
        pipeline, [LTX2LoopBeforeDenoiser(), LTX2LoopDenoiser()], 1, t, latents=packed, audio_latents=audio, dtype=torch.float32,
        audio_scheduler=steps["audio_scheduler"], denoiser_input_fields={"audio_num_frames": tokens, **coords}, num_inference_steps=2,
        frame_rate=24.0, motion_speed=1.0, use_cross_timestep=True, attention_kwargs=None, **size, **text,
    )
    with torch.no_grad():
        video_velocity, audio_velocity = LTX25.call.joint_predict(pipeline.transformer, video, audio, t.expand(1), condition, CONTEXT)
    # The block gives each stream's denoised estimate x0 = x - sigma * velocity (sigmas of the video schedule and of its audio copy).
    video_sigma, audio_sigma = pipeline.scheduler.sigmas[1], steps["audio_scheduler"].sigmas[1]
    assert 0 < float(video_sigma) < 1
    assert torch.allclose(state.noise_pred_video, packed - video_sigma * LTX2Pipeline._pack_latents(video_velocity), atol=1e-5)
    assert torch.allclose(state.noise_pred_audio, audio - audio_sigma * audio_velocity, atol=1e-5)
