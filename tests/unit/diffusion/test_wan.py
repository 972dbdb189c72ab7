"""Wan through the architecture door: the tiny preset loads in diffusers, prompts, denoiser call, expert timestep ranges, LoRA key layouts."""

from __future__ import annotations

import pytest
import torch

from zeropipe.config.schema import DiffusionSection
from zeropipe.families.diffusion.entries import PredictContext, architecture_named, architecture_of
from zeropipe.families.diffusion.objectives import FlowObjective
from zeropipe.families.diffusion.parts import FirstFrame
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, latent_scaling, normalize_latents, text_pipeline

WAN = architecture_named("wan")


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan") / "pipeline"
    build_tiny_pipeline({"pipeline": "tiny-wan"}, folder, seed=1)
    return folder


def test_tiny_wan_is_a_diffusers_wan_pipeline_that_draws_videos(tiny_wan):
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    assert architecture_of(tiny_wan) is WAN
    pipeline = WanPipeline.from_pretrained(str(tiny_wan))
    assert isinstance(pipeline.transformer, WanTransformer3DModel) and isinstance(pipeline.vae, AutoencoderKLWan)
    assert isinstance(pipeline.text_encoder, UMT5EncoderModel)
    assert pipeline.tokenizer.convert_ids_to_tokens(pipeline.tokenizer("a red circle").input_ids)[-1] == "</s>"
    pipeline.set_progress_bar_config(disable=True)
    frames = pipeline("a red circle moving left", num_frames=9, height=32, width=32, num_inference_steps=2, output_type="np").frames
    assert frames.shape == (1, 9, 32, 32, 3)


def test_prompts_are_encoded_by_the_pipeline_and_the_denoiser_takes_video_latents(tiny_wan):
    from diffusers import WanTransformer3DModel

    encoders = text_pipeline(tiny_wan, WAN, torch.float32, torch.device("cpu"))
    rows = encode_prompts(encoders, WAN, ["a red circle moving left", ""], torch.device("cpu"))
    assert rows[0]["prompt_embeds"].shape == (64, 32)
    # WanPipeline zeroes the embeddings after the prompt's own tokens: the empty prompt has only its end token.
    assert int((rows[1]["prompt_embeds"].abs().sum(-1) > 0).sum()) == 1
    transformer = WanTransformer3DModel.from_pretrained(str(tiny_wan / "transformer"))
    condition = {"prompt_embeds": torch.stack([row["prompt_embeds"] for row in rows])}
    latents = torch.randn(2, 16, 3, 4, 4)  # 9 frames of 32x32: 3 latent frames of 4x4
    out = WAN.call.predict(transformer, latents, torch.tensor([100.0, 900.0]), condition, PredictContext(torch.device("cpu"), torch.float32, 8, 1.0))
    assert out.shape == latents.shape


def test_latents_are_normalised_per_channel_as_the_pipeline_decodes_them(tiny_wan):
    import json

    config = json.loads((tiny_wan / "vae" / "config.json").read_text())
    config["latents_mean"] = [float(i) for i in range(16)]
    config["latents_std"] = [2.0] * 16
    shift, scale = WAN.record.codec.normalization(config)
    latents = torch.arange(16.0).view(1, 16, 1, 1, 1).expand(1, 16, 3, 4, 4)
    assert torch.allclose(normalize_latents(latents, shift, scale), torch.zeros(1)) and shift.shape == (16,)
    shift, scale = latent_scaling(tiny_wan, WAN)
    assert torch.equal(shift, torch.zeros(16)) and torch.equal(scale, torch.ones(16))


@pytest.mark.parametrize("sampling", ["logit_normal", "uniform"])
def test_an_expert_trains_only_its_side_of_the_boundary_with_the_distribution_sliced_not_squeezed(sampling):
    """Wan 2.2's experts: min_t/max_t keep the shifted distribution's own shape inside the range (as diffusion-pipe slices it)."""
    everything = FlowObjective({"flow_shift": 3.0}, DiffusionSection(timestep_sampling=sampling)).sigmas(200_000, torch.Generator().manual_seed(0))
    high = FlowObjective({"flow_shift": 3.0}, DiffusionSection(timestep_sampling=sampling, min_t=0.875)).sigmas(200_000, torch.Generator().manual_seed(1))
    low = FlowObjective({"flow_shift": 3.0}, DiffusionSection(timestep_sampling=sampling, max_t=0.875)).sigmas(200_000, torch.Generator().manual_seed(2))
    assert float(high.min()) >= 0.875 and float(low.max()) <= 0.875
    # Sliced: the share of the full distribution above 0.9 among those above 0.875 is what the expert sees.
    above = everything[everything >= 0.875]
    assert float((high >= 0.9).float().mean()) == pytest.approx(float((above >= 0.9).float().mean()), abs=0.01)
    below = everything[everything <= 0.875]
    assert float((low <= 0.5).float().mean()) == pytest.approx(float((below <= 0.5).float().mean()), abs=0.01)


def test_the_scheduler_flow_shift_is_wans_shift():
    assert FlowObjective(dict(WAN.record.preset["scheduler"]), DiffusionSection()).shift == 3.0
    assert FlowObjective(dict(WAN.record.preset["scheduler"]), DiffusionSection(shift=5.0)).shift == 5.0


def test_lora_keys_in_the_original_layout_convert_back_with_diffusers_converter():
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    layers = {}
    for module in ("blocks.0.attn1.to_q", "blocks.0.attn1.to_out.0", "blocks.1.attn2.to_v", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2"):
        layers[f"{module}.lora_A.weight"] = torch.randn(4, 8)
        layers[f"{module}.lora_B.weight"] = torch.randn(8, 4)
    original = WAN.layouts.original_lora_layout(layers, alpha=8.0)
    assert "diffusion_model.blocks.0.self_attn.q.lora_A.weight" in original
    assert "diffusion_model.blocks.0.self_attn.o.lora_B.weight" in original and "diffusion_model.blocks.1.ffn.2.alpha" in original
    # (clones: the converter scales some tensors in place)
    back = {key.removeprefix("transformer."): value for key, value in _convert_non_diffusers_wan_lora_to_diffusers({k: v.clone() for k, v in original.items()}).items()}
    assert set(back) == set(layers)
    # alpha / r = 2 is folded into the matrices by the converter: the product is what the adapter applies.
    for module in {key.rsplit(".lora_", 1)[0] for key in layers}:
        trained = layers[f"{module}.lora_B.weight"] @ layers[f"{module}.lora_A.weight"] * 2.0
        assert torch.allclose(back[f"{module}.lora_B.weight"] @ back[f"{module}.lora_A.weight"], trained, atol=1e-5)


def test_image_to_video_conditioning_is_what_wan_image_to_video_pipeline_feeds_its_transformer(tmp_path):
    """Mask and first-frame latents built from a clip as training builds them equal the pipeline's own prepare_latents."""
    import random

    from diffusers import WanImageToVideoPipeline

    from zeropipe.families.diffusion import cache
    from zeropipe.data.videos import moving_shape_frames

    i2v = architecture_named("wan-i2v")
    build_tiny_pipeline({"pipeline": "tiny-wan-i2v"}, tmp_path / "pipeline", seed=2)
    pipeline = WanImageToVideoPipeline.from_pretrained(str(tmp_path / "pipeline"))
    frames = moving_shape_frames("circle", "red", "blue", "left", (32, 32), 9, random.Random(0))
    clip = torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)[None]  # (1, 3, 9, 32, 32)
    _, expected = pipeline.prepare_latents(clip[:, :, 0], 1, 16, 32, 32, 9, torch.float32, torch.device("cpu"))

    shift, scale = latent_scaling(tmp_path / "pipeline", i2v)
    first_frame = normalize_latents(cache.encode_latent_distribution(pipeline.vae, FirstFrame.conditioning_pixels(clip))[0], shift, scale)
    seen = {}

    def transformer(hidden_states, timestep, encoder_hidden_states, return_dict, encoder_hidden_states_image=None):
        seen["input"] = hidden_states
        return (hidden_states[:, :16],)

    noisy = torch.randn(1, 16, 3, 4, 4)
    i2v.call.predict(transformer, noisy, torch.tensor([500.0]), {"prompt_embeds": torch.zeros(1, 64, 32), "first_frame_latents": first_frame}, None)
    assert seen["input"].shape == (1, 36, 3, 4, 4)
    assert torch.equal(seen["input"][:, :16], noisy)
    assert torch.allclose(seen["input"][:, 16:], expected, atol=1e-5)


def two_expert_pipeline(folder, boundary_ratio: float = 0.875, seed: int = 1):
    """A tiny pipeline in Wan 2.2 A14B's layout (transformer/ the high-noise expert, transformer_2/ the low-noise one), written by diffusers."""
    from diffusers import WanPipeline, WanTransformer3DModel

    build_tiny_pipeline({"pipeline": "tiny-wan"}, folder / "base", seed=seed)
    base = WanPipeline.from_pretrained(str(folder / "base"))
    torch.manual_seed(seed + 100)
    second = WanTransformer3DModel.from_config(base.transformer.config)
    WanPipeline(
        tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae, scheduler=base.scheduler,
        transformer=base.transformer, transformer_2=second, boundary_ratio=boundary_ratio,
    ).save_pretrained(str(folder / "a14b"))
    return folder / "a14b"


def test_an_expert_key_picks_its_transformer_and_its_side_of_the_pipelines_boundary(tmp_path):
    from zeropipe.config.schema import RunConfig
    from zeropipe.errors import ConfigError
    from zeropipe.families.diffusion.prepare import resolve_expert

    a14b = two_expert_pipeline(tmp_path)

    def resolved(**diffusion):
        config = RunConfig.model_validate({"model": {"path": str(a14b), "diffusion": diffusion}, "data": {"path": str(tmp_path)}})
        notes: list[str] = []
        folder = resolve_expert(config, WAN, a14b, notes)
        return folder, config.model.diffusion.min_t, config.model.diffusion.max_t, notes

    folder, low, high, notes = resolved(expert="low_noise")
    assert (folder, low, high) == ("transformer_2", 0.0, 0.875)
    assert notes == ["training the low-noise expert (transformer_2/) on noise levels 0 to 0.875 (the pipeline's boundary: 0.875)"]
    assert resolved(expert="high_noise")[:3] == ("transformer", 0.875, 1.0)
    assert resolved(expert="low_noise", min_t=0.2)[:3] == ("transformer_2", 0.2, 0.875)  # narrowed further, as asked
    assert resolved()[:3] == ("transformer", 0.0, 1.0)
    with pytest.raises(ConfigError, match=r"model.diffusion.max_t.*0.95 reaches above the boundary 0.875"):
        resolved(expert="low_noise", max_t=0.95)
    # A Wan 2.1 directory has one transformer: the key is refused with the fix.
    single = tmp_path / "base"
    config = RunConfig.model_validate({"model": {"path": str(single), "diffusion": {"expert": "low_noise"}}, "data": {"path": str(tmp_path)}})
    with pytest.raises(ConfigError, match="no transformer_2/ folder and boundary_ratio"):
        resolve_expert(config, WAN, single, [])


def wan21_i2v_pipeline(folder, seed: int = 3):
    """A tiny pipeline in Wan 2.1 I2V's layout: a transformer with image_dim, a CLIP image encoder and its processor, written by diffusers."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    build_tiny_pipeline({"pipeline": "tiny-wan-i2v"}, folder / "base", seed=seed)
    base = WanImageToVideoPipeline.from_pretrained(str(folder / "base"))
    torch.manual_seed(seed + 100)
    fields = {key: value for key, value in base.transformer.config.items() if not key.startswith("_")}
    transformer = WanTransformer3DModel(**{**fields, "image_dim": 32, "added_kv_proj_dim": 32})
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8))
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    WanImageToVideoPipeline(
        tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae, scheduler=base.scheduler,
        transformer=transformer, image_encoder=encoder, image_processor=processor,
    ).save_pretrained(str(folder / "wan21-i2v"))
    return folder / "wan21-i2v"


def test_wan21_image_to_video_embeds_the_first_frame_as_its_pipeline_does_and_the_transformer_sees_it(tmp_path):
    """Wan 2.1 I2V: the CLIP embeddings caching computes are the pipeline's encode_image; predict feeds them as the pipeline does."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from zeropipe.families.diffusion.pipelines import PipelineFolder

    i2v = architecture_named("wan-i2v")
    folder = wan21_i2v_pipeline(tmp_path)
    embeddings = i2v.record.conditions[1]
    assert architecture_of(folder) is i2v and embeddings.active(PipelineFolder(folder, i2v))
    assert not embeddings.active(PipelineFolder(tmp_path / "base", i2v))  # Wan 2.2 I2V's layout has no image encoder
    pipeline = WanImageToVideoPipeline.from_pretrained(str(folder))
    image = Image.new("RGB", (32, 32), (200, 40, 40))
    cached = embeddings.embed(embeddings.encoder(PipelineFolder(folder, i2v), torch.float32, torch.device("cpu")), [image], torch.device("cpu"))
    assert torch.equal(cached, pipeline.encode_image(image, torch.device("cpu")))

    noisy, first_frame, prompt = torch.randn(1, 16, 3, 4, 4), torch.randn(1, 16, 3, 4, 4), torch.randn(1, 64, 32)
    mask = torch.zeros(1, 4, 3, 4, 4)
    mask[:, :, 0] = 1
    timestep = torch.tensor([500.0])
    with torch.no_grad():
        expected = pipeline.transformer(
            hidden_states=torch.cat([noisy, mask, first_frame], dim=1), timestep=timestep, encoder_hidden_states=prompt,
            encoder_hidden_states_image=cached, return_dict=False,
        )[0]
        got = i2v.call.predict(pipeline.transformer, noisy, timestep, {"prompt_embeds": prompt, "first_frame_latents": first_frame, "image_embeds": cached}, None)
    assert torch.equal(got, expected)


def test_an_expert_key_on_a_unet_is_refused_before_anything_starts(tmp_path):
    from zeropipe.config.schema import RunConfig
    from zeropipe.families.diffusion import FAMILY

    config = RunConfig.model_validate({"model": {"config": {"pipeline": "tiny-sd15"}, "diffusion": {"expert": "high_noise"}}, "data": {"path": str(tmp_path)}})
    assert ("model.diffusion.expert", "applies to Wan 2.2 A14B's two flow-matching transformers, not to a UNet: remove it") in FAMILY.config_problems(config)
