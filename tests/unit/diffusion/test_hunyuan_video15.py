"""HunyuanVideo 1.5 through the architecture door: the tiny preset is a diffusers pipeline, prompts are its encode_prompt's, predict is its denoiser call."""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_named, architecture_of
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, text_pipeline, vae_scale_factor, vae_temporal_factor

HV15 = architecture_named("hunyuan-video-1.5")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hv15") / "pipeline"
    build_tiny_pipeline({"pipeline": "tiny-hunyuan-video-1.5"}, folder, seed=1)
    return folder


def test_prompts_survive_the_template_cut_and_quoted_text_reaches_byt5(tiny):
    assert architecture_of(tiny) is HV15
    assert (vae_scale_factor(tiny), vae_temporal_factor(tiny)) == (16, 4)
    encoders = text_pipeline(tiny, HV15, torch.float32, CPU)
    short, long, glyph = encode_prompts(encoders, HV15, ["a red circle", "a blue square moving up on a green background", 'a sign saying "open"'], CPU)
    # 108 tokens (the system prompt's start) are cut off; what is kept holds the whole prompt, so a longer prompt keeps more.
    assert short["prompt_embeds"].shape == (1000, 32) and 0 < short["prompt_embeds_mask"].sum() < long["prompt_embeds_mask"].sum()
    # ByT5 sees only quoted text: zeros and an empty mask without it.
    assert short["prompt_embeds_2"].shape == (256, 32) and short["prompt_embeds_mask_2"].sum() == 0 and short["prompt_embeds_2"].abs().sum() == 0
    assert glyph["prompt_embeds_mask_2"].sum() > 0


def test_predict_is_the_pipelines_own_transformer_call(tiny):
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    pipeline = HunyuanVideo15Pipeline.from_pretrained(str(tiny))
    pipeline.set_progress_bar_config(disable=True)
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=1.0)  # one call per step: the conditional one
    seen = []
    pipeline.transformer.register_forward_hook(lambda module, args, kwargs, out: seen.append((kwargs, out[0])), with_kwargs=True)
    latents = torch.randn(1, 8, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    prompt = 'a red circle moving left, a sign saying "stop"'
    rows = encode_prompts(text_pipeline(tiny, HV15, torch.float32, CPU), HV15, [prompt], CPU)
    condition = {name: value[None] for name, value in rows[0].items()}
    with torch.no_grad():
        pipeline(prompt, num_frames=9, height=64, width=64, num_inference_steps=2, latents=latents, output_type="latent")
        kwargs, expected = seen[0]
        for name, key in (("encoder_hidden_states", "prompt_embeds"), ("encoder_hidden_states_2", "prompt_embeds_2")):
            assert torch.equal(kwargs[name], condition[key])  # the cached conditioning is what the pipeline encodes
        got = HV15.call.predict(pipeline.transformer, latents, kwargs["timestep"], condition, PredictContext(CPU, torch.float32, 16, 1.0))
    assert kwargs["hidden_states"].shape[1] == 8 + 8 + 1
    assert torch.equal(got, expected)


def test_image_to_video_conditions_are_the_pipelines_own_and_predict_is_its_transformer_call(tmp_path):
    """The first frame's latents and SigLIP embeddings, as caching computes them, are what the I2V pipeline feeds its transformer."""
    import random

    from diffusers import ClassifierFreeGuidance, HunyuanVideo15ImageToVideoPipeline

    from zeropipe.data.images import first_frame_image
    from zeropipe.families.diffusion.parts.base import Encoding
    from zeropipe.families.diffusion.pipelines import PipelineFolder, latent_scaling, normalize_latents
    from zeropipe.data.videos import moving_shape_frames

    i2v = architecture_named("hunyuan-video-1.5-i2v")
    build_tiny_pipeline({"pipeline": "tiny-hunyuan-video-1.5-i2v"}, tmp_path / "pipeline", seed=2)
    folder = tmp_path / "pipeline"
    assert architecture_of(folder) is i2v
    pipeline = HunyuanVideo15ImageToVideoPipeline.from_pretrained(str(folder))
    pipeline.set_progress_bar_config(disable=True)
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=1.0)
    frames = moving_shape_frames("circle", "red", "blue", "left", (64, 64), 9, random.Random(0))
    clip = torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)[None]

    latents_part, embeddings_part = i2v.record.conditions
    encoding = Encoding(vae=pipeline.vae, pixels=clip, loaded=[None], encoder=embeddings_part.encoder(PipelineFolder(folder, i2v), torch.float32, CPU), codec=i2v.record.codec, device=CPU)
    first_frame = normalize_latents(torch.stack(latents_part.encode(encoding)), *latent_scaling(folder, i2v))
    image_embeds = torch.stack(embeddings_part.encode(encoding))

    seen = []
    pipeline.transformer.register_forward_hook(lambda module, args, kwargs, out: seen.append((kwargs, out[0])), with_kwargs=True)
    noisy = torch.randn(1, 8, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pipeline(image=first_frame_image(clip[0]), prompt="a red circle", num_frames=9, num_inference_steps=2, latents=noisy, output_type="latent")
        kwargs, expected = seen[0]
        assert torch.equal(kwargs["image_embeds"], image_embeds)
        condition = {
            "prompt_embeds": kwargs["encoder_hidden_states"], "prompt_embeds_mask": kwargs["encoder_attention_mask"],
            "prompt_embeds_2": kwargs["encoder_hidden_states_2"], "prompt_embeds_mask_2": kwargs["encoder_attention_mask_2"],
            "first_frame_latents": first_frame, "image_embeds": image_embeds,
        }
        got = i2v.call.predict(pipeline.transformer, noisy, kwargs["timestep"], condition, None)
    assert torch.allclose(kwargs["hidden_states"][:, 8:16, :1], first_frame, atol=1e-5) and float(kwargs["hidden_states"][:, 16, 0].min()) == 1.0
    assert torch.allclose(got, expected, atol=1e-5)
