"""HunyuanVideo and LTX-Video through the architecture door: tiny presets load in diffusers, VAE factors, latents, LoRA key layouts."""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_named, architecture_of
from zeropipe.families.diffusion.entries.hunyuan_video import original_lora_layers
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, latent_scaling, text_pipeline, vae_scale_factor, vae_temporal_factor

HUNYUAN = architecture_named("hunyuan-video")
LTX = architecture_named("ltx-video")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_hunyuan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hunyuan") / "pipeline"
    build_tiny_pipeline({"pipeline": "tiny-hunyuan-video"}, folder, seed=1)
    return folder


@pytest.fixture(scope="module")
def tiny_ltx(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx") / "pipeline"
    build_tiny_pipeline({"pipeline": "tiny-ltx-video"}, folder, seed=1)
    return folder


def test_tiny_hunyuan_video_is_a_diffusers_pipeline_with_4x_time_and_8x_space(tiny_hunyuan):
    from diffusers import HunyuanVideoPipeline

    assert architecture_of(tiny_hunyuan) is HUNYUAN
    # Its VAE says temporal_compression_ratio (not scale_factor_temporal, as Wan's does): 9 frames are 3 latent frames.
    assert (vae_scale_factor(tiny_hunyuan), vae_temporal_factor(tiny_hunyuan)) == (8, 4)
    assert [HUNYUAN.record.codec.accepts_frames(n) for n in (1, 5, 9, 8, 17)] == [True, True, True, False, True]
    pipeline = HunyuanVideoPipeline.from_pretrained(str(tiny_hunyuan))
    pipeline.set_progress_bar_config(disable=True)
    frames = pipeline("a red circle moving left", num_frames=9, height=32, width=32, num_inference_steps=2, output_type="np").frames
    assert frames.shape == (1, 9, 32, 32, 3)


def test_the_prompt_survives_the_template_cut_and_the_denoiser_is_told_the_guidance(tiny_hunyuan):
    encoders = text_pipeline(tiny_hunyuan, HUNYUAN, torch.float32, CPU)
    short, long = encode_prompts(encoders, HUNYUAN, ["a red circle", "a blue square moving up on a green background"], CPU)
    # HunyuanVideoPipeline cuts 95 tokens (its system prompt) off; what is left holds the prompt, so longer prompts keep more tokens.
    assert 0 < short["prompt_attention_mask"].sum() < long["prompt_attention_mask"].sum()
    assert short["prompt_embeds"].shape == (256, 32) and short["pooled_prompt_embeds"].shape == (32,)

    from diffusers import HunyuanVideoTransformer3DModel

    model = HunyuanVideoTransformer3DModel.from_pretrained(str(tiny_hunyuan / "transformer"))
    condition = {name: torch.stack([short[name], long[name]]) for name in short}
    latents = torch.randn(2, 16, 3, 4, 4)
    timesteps = torch.tensor([900.0, 100.0])
    out = HUNYUAN.call.predict(model, latents, timesteps, condition, PredictContext(CPU, torch.float32, 8, 1.0))
    other_guidance = HUNYUAN.call.predict(model, latents, timesteps, condition, PredictContext(CPU, torch.float32, 8, 6.0))
    assert out.shape == latents.shape and not torch.allclose(out, other_guidance)


def _diffusers_lora(hidden: int, mlp: int, rank: int) -> dict[str, torch.Tensor]:
    """A diffusers-layout LoRA of one double and one single HunyuanVideo block of the given width."""
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "transformer_blocks.0.attn.to_q": (hidden, hidden), "transformer_blocks.0.attn.to_k": (hidden, hidden), "transformer_blocks.0.attn.to_v": (hidden, hidden),
        "transformer_blocks.0.attn.add_q_proj": (hidden, hidden), "transformer_blocks.0.attn.add_k_proj": (hidden, hidden),
        "transformer_blocks.0.attn.add_v_proj": (hidden, hidden), "transformer_blocks.0.attn.to_out.0": (hidden, hidden),
        "transformer_blocks.0.ff.net.0.proj": (mlp, hidden), "transformer_blocks.0.ff_context.net.2": (hidden, mlp),
        "single_transformer_blocks.0.attn.to_q": (hidden, hidden), "single_transformer_blocks.0.attn.to_k": (hidden, hidden),
        "single_transformer_blocks.0.attn.to_v": (hidden, hidden), "single_transformer_blocks.0.proj_mlp": (mlp, hidden),
        "single_transformer_blocks.0.proj_out": (hidden, hidden + mlp),
    }
    layers = {}
    for module, (out_features, in_features) in shapes.items():
        layers[f"{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator)
        layers[f"{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator)
    return layers


def test_the_original_layout_lora_converts_back_with_diffusers_converter_to_the_same_updates():
    """At HunyuanVideo's real width (diffusers' converter assumes 3072): fused q/k/v(/mlp) split back to the trained updates."""
    from diffusers.loaders.lora_conversion_utils import _convert_hunyuan_video_lora_to_diffusers

    hidden, mlp, rank, alpha = 3072, 64, 2, 8.0
    layers = _diffusers_lora(hidden, mlp, rank)
    original = original_lora_layers(layers, alpha)
    assert set(original) == {
        f"diffusion_model.{name}.lora_{part}.weight" for part in "AB" for name in (
            "double_blocks.0.img_attn_qkv", "double_blocks.0.txt_attn_qkv", "double_blocks.0.img_attn_proj", "double_blocks.0.img_mlp.fc1",
            "double_blocks.0.txt_mlp.fc2", "single_blocks.0.linear1", "single_blocks.0.linear2",
        )
    }
    back = _convert_hunyuan_video_lora_to_diffusers(dict(original))
    for module in {key.partition(".lora_")[0] for key in layers}:
        trained = (alpha / rank) * layers[f"{module}.lora_B.weight"] @ layers[f"{module}.lora_A.weight"]
        converted = back[f"transformer.{module}.lora_B.weight"] @ back[f"transformer.{module}.lora_A.weight"]
        assert torch.allclose(converted, trained, atol=1e-3), module


def test_a_fused_layer_trained_in_part_is_refused_by_name():
    layers = {key: value for key, value in _diffusers_lora(32, 64, 2).items() if not key.startswith("transformer_blocks.0.attn.to_k.")}
    with pytest.raises(ValueError, match=r"transformer_blocks\.0\.attn\.to_k is not trained .* img_attn_qkv"):
        original_lora_layers(layers, 4.0)


def test_tiny_ltx_video_is_a_diffusers_pipeline_with_8x_time_and_its_statistics_from_the_vae_weights(tiny_ltx, tmp_path):
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline

    assert architecture_of(tiny_ltx) is LTX
    assert (vae_scale_factor(tiny_ltx), vae_temporal_factor(tiny_ltx)) == (8, 8)
    assert [LTX.record.codec.accepts_frames(n) for n in (1, 9, 17, 5, 13)] == [True, True, True, False, False]
    # LTX-Video 0.9.1's VAE config (patch size 4, three halving blocks): 32x in space, 8x in time.
    assert LTX.record.codec.vae_factors({"patch_size": 4, "patch_size_t": 1, "spatio_temporal_scaling": [True, True, True, False]}) == (32, 8)
    pipeline = LTXPipeline.from_pretrained(str(tiny_ltx))
    pipeline.set_progress_bar_config(disable=True)
    frames = pipeline("a red circle moving left", num_frames=9, height=32, width=32, num_inference_steps=2, output_type="np").frames
    assert frames.shape == (1, 9, 32, 32, 3)

    # The per-channel statistics are buffers in the VAE's weights: the normalisation reads them there.
    vae = AutoencoderKLLTXVideo.from_pretrained(str(tiny_ltx / "vae"))
    vae.latents_mean.copy_(torch.linspace(-1, 1, 8))
    vae.latents_std.fill_(2.0)
    vae.save_pretrained(str(tiny_ltx / "vae"))
    shift, scale = latent_scaling(tiny_ltx, LTX)
    latents = torch.randn(1, 8, 2, 4, 4)
    expected = LTXPipeline._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    assert torch.allclose((latents - shift.view(1, -1, 1, 1, 1)) * scale.view(1, -1, 1, 1, 1), expected)


def test_ltx_denoiser_call_packs_tokens_as_the_pipeline_does(tiny_ltx):
    from diffusers import LTXPipeline, LTXVideoTransformer3DModel

    encoders = text_pipeline(tiny_ltx, LTX, torch.float32, CPU)
    rows = encode_prompts(encoders, LTX, ["a red circle", "a blue square"], CPU)
    condition = {name: torch.stack([row[name] for row in rows]) for name in rows[0]}
    model = LTXVideoTransformer3DModel.from_pretrained(str(tiny_ltx / "transformer"))
    latents = torch.randn(2, 8, 2, 4, 4)
    timesteps = torch.tensor([700.0, 300.0])
    out = LTX.call.predict(model, latents, timesteps, condition, PredictContext(CPU, torch.float32, 8, 1.0))
    # The pipeline's own call, on packed tokens, at its default frame rate (25).
    packed = model(
        hidden_states=LTXPipeline._pack_latents(latents), encoder_hidden_states=condition["prompt_embeds"], timestep=timesteps,
        encoder_attention_mask=condition["prompt_attention_mask"], num_frames=2, height=4, width=4, rope_interpolation_scale=(8 / 25, 8, 8), return_dict=False,
    )[0]
    assert torch.allclose(out, LTXPipeline._unpack_latents(packed, 2, 4, 4), atol=1e-6)


def test_ltx_original_lora_layout_is_diffusers_names_under_diffusion_model_with_alpha_folded_in():
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltxv_lora_to_diffusers

    layers = {"transformer_blocks.0.attn1.to_q.lora_A.weight": torch.ones(2, 4), "transformer_blocks.0.attn1.to_q.lora_B.weight": torch.ones(4, 2)}
    original = LTX.layouts.original_lora_layout(layers, 8.0)
    assert set(original) == {"diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight", "diffusion_model.transformer_blocks.0.attn1.to_q.lora_B.weight"}
    assert torch.equal(original["diffusion_model.transformer_blocks.0.attn1.to_q.lora_B.weight"], torch.full((4, 2), 4.0))  # alpha / r = 8 / 2
    back = _convert_non_diffusers_ltxv_lora_to_diffusers(original)
    assert "transformer.transformer_blocks.0.attn1.to_q.lora_A.weight" in back


def test_single_files_ltx_is_renamed_for_streaming_and_hunyuans_fused_qkv_is_refused_with_the_fix(tmp_path):
    from safetensors.torch import save_file

    from zeropipe.families.diffusion.pipelines import single_file_renamer
    from zeropipe.errors import ConfigError

    ltx_file = tmp_path / "ltx-video-2b-v0.9.safetensors"
    save_file({"model.diffusion_model.transformer_blocks.0.attn1.to_q.weight": torch.zeros(2, 2), "model.diffusion_model.patchify_proj.weight": torch.zeros(2, 2)}, str(ltx_file))
    rename = single_file_renamer("LTXVideoTransformer3DModel", ltx_file)
    assert rename("model.diffusion_model.patchify_proj.weight") == "proj_in.weight"
    assert rename("model.diffusion_model.transformer_blocks.0.attn1.to_q.weight") == "transformer_blocks.0.attn1.to_q.weight"

    hunyuan_file = tmp_path / "hunyuan_video_720_cfgdistill_bf16.safetensors"
    save_file({"double_blocks.0.img_attn_qkv.weight": torch.zeros(6, 2), "img_in.proj.weight": torch.zeros(2, 2)}, str(hunyuan_file))
    with pytest.raises(ConfigError, match="from_single_file"):
        single_file_renamer("HunyuanVideoTransformer3DModel", hunyuan_file)
