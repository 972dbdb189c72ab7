"""SkyReels-V2 through the architecture door: its own transformer class and pipelines; predict is each pipeline's own transformer call."""

from __future__ import annotations

import random

import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_named, architecture_of
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline

CPU = torch.device("cpu")


def _calls(transformer):
    seen = []
    transformer.register_forward_hook(lambda module, args, kwargs, out: seen.append((kwargs, out[0])), with_kwargs=True)
    return seen


def test_text_to_video_predict_is_the_pipelines_call(tmp_path):
    from diffusers import SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel

    t2v = architecture_named("skyreels-v2")
    build_tiny_pipeline({"pipeline": "tiny-skyreels-v2"}, tmp_path / "t2v", seed=1)
    assert architecture_of(tmp_path / "t2v") is t2v and t2v.record.codec.frame_rate == 24.0
    pipeline = SkyReelsV2Pipeline.from_pretrained(str(tmp_path / "t2v"))
    assert isinstance(pipeline.transformer, SkyReelsV2Transformer3DModel)
    pipeline.set_progress_bar_config(disable=True)
    seen = _calls(pipeline.transformer)
    latents = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pipeline("a red circle moving left", num_frames=9, height=32, width=32, num_inference_steps=2, guidance_scale=1.0, latents=latents, output_type="latent")
        kwargs, expected = seen[0]
        # The prompt as the cache holds it: the pipeline's encode_prompt, zeros after the prompt's own tokens (512 of them for the
        # real tokenizer; the tiny one says 64, the pipeline's call pads to 512).
        cached = t2v.prompts.encode_prompts(pipeline, ["a red circle moving left"], CPU)["prompt_embeds"]
        assert torch.equal(cached, kwargs["encoder_hidden_states"][:, : cached.shape[1]]) and not kwargs["encoder_hidden_states"][:, cached.shape[1] :].any()
        condition = {"prompt_embeds": kwargs["encoder_hidden_states"]}
        got = t2v.call.predict(pipeline.transformer, latents, kwargs["timestep"], condition, PredictContext(CPU, torch.float32, 8, 1.0))
    assert torch.equal(got, expected)


def test_image_to_video_conditions_are_the_pipelines_own_and_predict_is_its_call(tmp_path):
    from diffusers import SkyReelsV2ImageToVideoPipeline

    from zeropipe.data.images import first_frame_image
    from zeropipe.families.diffusion.parts.base import Encoding
    from zeropipe.families.diffusion.pipelines import PipelineFolder, latent_scaling, normalize_latents
    from zeropipe.data.videos import moving_shape_frames

    i2v = architecture_named("skyreels-v2-i2v")
    folder = tmp_path / "i2v"
    build_tiny_pipeline({"pipeline": "tiny-skyreels-v2-i2v"}, folder, seed=2)
    assert architecture_of(folder) is i2v
    pipeline = SkyReelsV2ImageToVideoPipeline.from_pretrained(str(folder))
    pipeline.set_progress_bar_config(disable=True)
    frames = moving_shape_frames("circle", "red", "blue", "left", (32, 32), 9, random.Random(0))
    clip = torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)[None]

    first_frame_part, embeddings_part = i2v.record.conditions
    encoding = Encoding(vae=pipeline.vae, pixels=clip, loaded=[None], encoder=embeddings_part.encoder(PipelineFolder(folder, i2v), torch.float32, CPU), codec=i2v.record.codec, device=CPU)
    first_frame = normalize_latents(torch.stack(first_frame_part.encode(encoding)), *latent_scaling(folder, i2v))
    image_embeds = torch.stack(embeddings_part.encode(encoding))

    seen = _calls(pipeline.transformer)
    noisy = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pipeline(image=first_frame_image(clip[0]), prompt="a red circle", num_frames=9, height=32, width=32, num_inference_steps=2, guidance_scale=1.0, latents=noisy, output_type="latent")
        kwargs, expected = seen[0]
        assert torch.allclose(kwargs["encoder_hidden_states_image"], image_embeds, atol=1e-6)
        condition = {"prompt_embeds": kwargs["encoder_hidden_states"], "first_frame_latents": first_frame, "image_embeds": image_embeds}
        got = i2v.call.predict(pipeline.transformer, noisy, kwargs["timestep"], condition, None)
    assert kwargs["hidden_states"].shape[1] == 36
    assert torch.allclose(got, expected, atol=1e-5)
