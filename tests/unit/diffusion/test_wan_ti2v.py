"""Wan 2.2 TI2V-5B through the architecture door: found by model_index.json's expand_timesteps, and its predict is the pipeline's own denoiser call."""

from __future__ import annotations

import json
import random

import pytest
import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_named, architecture_of
from zeropipe.families.diffusion.parts.base import Encoding
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, latent_scaling, normalize_latents, vae_scale_factor, vae_temporal_factor

TI2V = architecture_named("wan-ti2v")
I2V = architecture_named("wan-ti2v-i2v")
CPU = torch.device("cpu")


def _skewed_statistics(folder):
    """Per-channel statistics that are not the identity, so that normalising latents wrongly shows."""
    path = folder / "vae" / "config.json"
    config = json.loads(path.read_text())
    config["latents_mean"] = [0.01 * i for i in range(48)]
    config["latents_std"] = [0.5 + 0.02 * i for i in range(48)]
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan-ti2v")
    build_tiny_pipeline({"pipeline": "tiny-wan-ti2v"}, root / "t2v", seed=1)
    build_tiny_pipeline({"pipeline": "tiny-wan-ti2v-i2v"}, root / "i2v", seed=1)
    build_tiny_pipeline({"pipeline": "tiny-wan"}, root / "wan21", seed=1)
    for name in ("t2v", "i2v"):
        _skewed_statistics(root / name)
    return root


def _calls(transformer):
    """Record every call of the transformer: (its keyword arguments, its output)."""
    seen = []
    transformer.register_forward_hook(lambda module, args, kwargs, out: seen.append((kwargs, out[0])), with_kwargs=True)
    return seen


def test_the_folder_says_which_wan_it_is_and_the_vae_compresses_16x(folders):
    assert architecture_of(folders / "t2v") is TI2V and architecture_of(folders / "i2v") is I2V
    assert architecture_of(folders / "wan21").record.name == "wan"  # a WanPipeline saved without expand_timesteps
    assert (vae_scale_factor(folders / "t2v"), vae_temporal_factor(folders / "t2v")) == (16, 4)
    assert TI2V.record.codec.frame_rate == 24.0 and TI2V.record.codec.normalization(json.loads((folders / "t2v" / "vae" / "config.json").read_text()))[0].shape == (48,)


def test_text_to_video_predict_is_the_pipelines_call_with_a_timestep_per_token(folders):
    from diffusers import WanPipeline

    pipeline = WanPipeline.from_pretrained(str(folders / "t2v"))
    pipeline.set_progress_bar_config(disable=True)
    seen = _calls(pipeline.transformer)
    latents = torch.randn(1, 48, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pipeline("a red circle moving left", num_frames=9, height=64, width=64, num_inference_steps=2, guidance_scale=1.0, latents=latents, output_type="latent")
        kwargs, expected = seen[0]
        assert kwargs["timestep"].shape == (1, 3 * 2 * 2)  # one per token
        t = kwargs["timestep"][:, 0]
        got = TI2V.call.predict(pipeline.transformer, latents, t, {"prompt_embeds": kwargs["encoder_hidden_states"]}, PredictContext(CPU, torch.float32, 16, 1.0))
    assert torch.equal(got, expected)


def test_image_to_video_predict_is_the_pipelines_call_on_the_first_frame_latents_training_caches(folders):
    """The first frame encoded alone and normalised as caching does equals the pipeline's condition; the denoiser call is the same."""
    from diffusers import WanImageToVideoPipeline

    from zeropipe.data.images import first_frame_image
    from zeropipe.data.videos import moving_shape_frames

    pipeline = WanImageToVideoPipeline.from_pretrained(str(folders / "i2v"))
    pipeline.set_progress_bar_config(disable=True)
    frames = moving_shape_frames("circle", "red", "blue", "left", (64, 64), 9, random.Random(0))
    clip = torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)[None]  # (1, 3, 9, 64, 64)

    condition = I2V.record.conditions[0]
    encoded = condition.encode(Encoding(vae=pipeline.vae, pixels=clip, loaded=[None], encoder=None, codec=I2V.record.codec, device=CPU))
    shift, scale = latent_scaling(folders / "i2v", I2V)
    first_frame = normalize_latents(torch.stack(encoded), shift, scale)
    assert first_frame.shape == (1, 48, 1, 4, 4)

    seen = _calls(pipeline.transformer)
    noisy = torch.randn(1, 48, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pipeline(image=first_frame_image(clip[0]), prompt="a red circle", num_frames=9, height=64, width=64, num_inference_steps=2, guidance_scale=1.0, latents=noisy, output_type="latent")
        kwargs, expected = seen[0]
        # The first frame's tokens are told timestep 0, the others the step's.
        assert float(kwargs["timestep"][0, :4].abs().sum()) == 0 and bool((kwargs["timestep"][0, 4:] > 0).all())
        t = kwargs["timestep"][:, -1]
        got = I2V.call.predict(pipeline.transformer, noisy, t, {"prompt_embeds": kwargs["encoder_hidden_states"], "first_frame_latents": first_frame}, None)
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(kwargs["hidden_states"][:, :, :1], first_frame, atol=1e-5)


def test_the_loss_leaves_out_the_given_first_frame_only_for_image_to_video():
    prediction, target = torch.randn(2, 48, 3, 2, 2), torch.randn(2, 48, 3, 2, 2)
    compared = I2V.call.loss_region(prediction, target)
    assert compared[0].shape == (2, 48, 2, 2, 2) and torch.equal(compared[1], target[:, :, 1:])
    assert TI2V.call.loss_region(prediction, target)[0] is prediction
