"""LTX-2: the denoiser called as LTX2Pipeline calls it, the audio loss term, clips' audio read with PyAV, the original LoRA layout."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
import pytest
import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_named, architecture_of
from zeropipe.data.audio import has_audio, mel_spectrogram, read_audio
from zeropipe.families.diffusion.objectives import NoisedBatch, weighted_mse
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, text_pipeline, vae_scale_factor, vae_temporal_factor

LTX2 = architecture_named("ltx2")
CPU = torch.device("cpu")
CONTEXT = PredictContext(CPU, torch.float32, 8, 1.0)


@pytest.fixture(scope="module")
def tiny_ltx2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltx2") / "pipeline"
    build_tiny_pipeline({"pipeline": "tiny-ltx2"}, folder, seed=1)
    return folder


def test_the_denoiser_and_the_prompts_are_called_and_prepared_as_ltx2_pipeline_does(tiny_ltx2):
    from diffusers import LTX2Pipeline

    assert architecture_of(tiny_ltx2) is LTX2 and (vae_scale_factor(tiny_ltx2), vae_temporal_factor(tiny_ltx2)) == (8, 8)
    pipeline = LTX2Pipeline.from_pretrained(str(tiny_ltx2))
    pipeline.set_progress_bar_config(disable=True)
    seen = {}

    def remember(module, args, kwargs, output):
        seen.update(kwargs=kwargs, output=output)

    pipeline.transformer.register_forward_hook(remember, with_kwargs=True)
    pipeline(
        "a red ball", num_frames=9, height=32, width=32, frame_rate=24.0, num_inference_steps=1, guidance_scale=1.0, output_type="latent",
        stg_scale=0.0, audio_stg_scale=0.0, spatio_temporal_guidance_blocks=None, max_sequence_length=128, generator=torch.Generator().manual_seed(0),
    )
    called = seen["kwargs"]
    # The text cache's entry: Gemma through the connectors, as the pipeline conditions its transformer.
    condition = {name: value[None] for name, value in encode_prompts(text_pipeline(tiny_ltx2, LTX2, torch.float32, CPU), LTX2, ["a red ball"], CPU)[0].items()}
    assert torch.allclose(condition["prompt_embeds"], called["encoder_hidden_states"], atol=1e-5)
    assert torch.allclose(condition["audio_prompt_embeds"], called["audio_encoder_hidden_states"], atol=1e-5)
    video = pipeline._unpack_latents(called["hidden_states"], 2, 4, 4)
    with torch.no_grad():
        video_out, audio_out = LTX2.call.joint_predict(pipeline.transformer, video, called["audio_hidden_states"], called["timestep"], condition, CONTEXT)
    assert torch.allclose(video_out, pipeline._unpack_latents(seen["output"][0], 2, 4, 4), atol=1e-4)
    assert torch.allclose(audio_out, seen["output"][1], atol=1e-4)
    # The clip's audio latents are as many as the pipeline draws for its duration.
    assert LTX2.call.audio_tokens(pipeline.transformer, video) == called["audio_hidden_states"].shape[1] == 9


def test_only_the_audio_loss_term_reaches_the_last_blocks_audio_feed_forward(tiny_ltx2):
    from diffusers import LTX2VideoTransformer3DModel
    from peft import LoraConfig

    from zeropipe.models.common import resolve_lora_targets

    model = LTX2VideoTransformer3DModel.from_pretrained(str(tiny_ltx2 / "transformer"))
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=list(LTX2.record.lora_targets)))
    torch.nn.init.normal_(model.transformer_blocks[1].audio_ff.net[2].lora_B["default"].weight, std=0.1)  # B starts at zero
    torch.manual_seed(0)
    video = torch.randn(2, 8, 2, 4, 4)
    noise = torch.randn_like(video)
    timesteps = torch.tensor([300.0, 700.0])
    sigma = (timesteps / 1000).view(-1, 1, 1, 1, 1)
    noised = NoisedBatch((1 - sigma) * video + sigma * noise, timesteps, noise - video, None)
    condition = {"prompt_embeds": torch.randn(2, 16, 32), "audio_prompt_embeds": torch.randn(2, 16, 32), "prompt_attention_mask": torch.ones(2, 16),
                 "audio_latents": torch.randn(2, 9, 16)}
    weight = model.transformer_blocks[1].audio_ff.net[2].lora_A["default"].weight
    video_only = weighted_mse(LTX2.call.predict(model, noised.model_input, timesteps, condition, CONTEXT), noised.target, None)
    (video_grad,) = torch.autograd.grad(video_only, weight, allow_unused=True)
    assert video_grad is None or video_grad.abs().max() == 0
    (joint_grad,) = torch.autograd.grad(LTX2.call.loss(model, noised, condition, CONTEXT), weight)
    assert joint_grad.abs().max() > 0


def write_clip(path, seconds: float, tone: float | None, rate: int = 44100) -> None:
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=Fraction(24))
        video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
        audio = container.add_stream("aac", rate=rate, layout="mono") if tone else None
        for _ in range(int(24 * seconds)):
            container.mux(video.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), 90, np.uint8), format="rgb24")))
        container.mux(video.encode())
        if audio is not None:
            t = np.arange(int(rate * seconds)) / rate
            frame = av.AudioFrame.from_ndarray((0.5 * np.sin(2 * np.pi * tone * t)).astype(np.float32)[None], format="fltp", layout="mono")
            frame.sample_rate, frame.pts = rate, 0
            container.mux(audio.encode(frame))
            container.mux(audio.encode())


def test_a_clips_audio_is_read_resampled_to_stereo_over_its_span_and_a_silent_file_is_told(tmp_path):
    write_clip(tmp_path / "tone.mp4", 1.0, 440.0)
    write_clip(tmp_path / "silent.mp4", 1.0, None)
    assert has_audio(tmp_path / "tone.mp4") and not has_audio(tmp_path / "silent.mp4")
    sound = read_audio(tmp_path / "tone.mp4", start=0.25, duration=0.5, sample_rate=16000, channels=2)
    assert sound.shape == (2, 8000) and torch.allclose(sound[0], sound[1])
    peak = np.fft.rfftfreq(8000, 1 / 16000)[np.abs(np.fft.rfft(sound[0].numpy())).argmax()]
    assert abs(peak - 440.0) < 4
    # Past the track's end: silence, as LTX-2's trainer pads.
    assert read_audio(tmp_path / "tone.mp4", start=0.9, duration=0.5, sample_rate=16000)[:, 4000:].abs().max() < 1e-3
    mel = mel_spectrogram(sound[None], 16000, mel_bins=64, hop_length=160)
    assert mel.shape == (1, 2, 51, 64)
    # The tone's energy sits in the mel bins around 440 Hz, not at the top.
    assert mel[0, 0].mean(0)[:20].max() > mel[0, 0].mean(0)[40:].max() + 3
    from zeropipe.errors import DataError

    with pytest.raises(DataError, match="no audio stream"):
        read_audio(tmp_path / "silent.mp4", 0.0, 0.5, 16000)


def test_the_original_lora_layout_converts_back_with_diffusers_ltx2_converter():
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers

    layers = {
        "transformer_blocks.0.audio_attn1.to_q.lora_A.weight": torch.randn(4, 16),
        "transformer_blocks.0.audio_attn1.to_q.lora_B.weight": torch.randn(16, 4),
        "transformer_blocks.1.ff.net.2.lora_A.weight": torch.randn(4, 64),
        "transformer_blocks.1.ff.net.2.lora_B.weight": torch.randn(16, 4),
    }
    original = LTX2.layouts.original_lora_layout(layers, alpha=8.0)
    assert "diffusion_model.transformer_blocks.0.audio_attn1.to_q.lora_A.weight" in original and all(".lora_" in key for key in original)
    back = _convert_non_diffusers_ltx2_lora_to_diffusers(original)
    assert set(back) == {f"transformer.{key}" for key in layers}
    assert torch.allclose(back["transformer.transformer_blocks.1.ff.net.2.lora_B.weight"], layers["transformer_blocks.1.ff.net.2.lora_B.weight"] * 2.0)


def test_audio_comes_from_the_latent_cache_and_turning_it_off_is_refused_with_the_key(tmp_path):
    from zeropipe.config.schema import RunConfig
    from zeropipe.families.diffusion.parts import part_problems

    config = RunConfig.model_validate({
        "run": {"name": "ltx2", "output_dir": str(tmp_path)}, "model": {"config": {"pipeline": "tiny-ltx2"}},
        "data": {"synthetic": {"task": "shapes", "examples": 10}, "cache": {"latents": False}},
    })
    assert [key for key, _ in part_problems(config, LTX2)] == ["data.cache.latents"]
    assert part_problems(config.model_copy(update={"data": config.data.model_copy(update={"cache": config.data.cache.model_copy(update={"latents": True})})}), LTX2) == []


def test_the_draw_pages_clip_carries_the_sound_the_pipeline_drew(tiny_ltx2, tmp_path):
    """The UI's Draw page (families.diffusion.draw) muxes LTX2Pipeline's waveform into the mp4, as training's samples do."""
    import av
    from diffusers import LTX2Pipeline

    from zeropipe.export.generate import LoadedModel, ModelSource
    from zeropipe.families.diffusion.draw import draw

    pipeline = LTX2Pipeline.from_pretrained(str(tiny_ltx2))
    pipeline.set_progress_bar_config(disable=True)
    loaded = LoadedModel(pipeline, None, ModelSource("hf", tiny_ltx2, family="diffusion"), CPU)
    row = draw(loaded, tmp_path / "draw", "a red ball", "", 32, 32, steps=1, guidance=1.0, seed=0, frames=9)[0]
    with av.open(str(tmp_path / "draw" / row["file"])) as clip:
        assert len(clip.streams.video) == 1 and len(clip.streams.audio) == 1, "the drawn clip has no audio stream"
        audio = clip.streams.audio[0]
        assert audio.rate == pipeline.vocoder.config.output_sampling_rate
        samples = [frame.to_ndarray() for frame in clip.decode(audio)]
    assert samples and max(abs(s).max() for s in samples) > 0 and row["audio_dbfs"] is not None
    # What the pipeline refuses (a size not divisible by 32 here; an input image an edit or image-to-video pipeline needs) is one
    # message naming the pipeline and its reason, the Draw page's 400, not an internal error (a 500 before).
    from zeropipe.errors import ZeroPipeError

    with pytest.raises(ZeroPipeError, match=r"LTX2Pipeline could not draw from a prompt alone at 40x40 in 1 steps: ValueError: .*divisible by 32"):
        draw(loaded, tmp_path / "refused", "a red ball", "", 40, 40, steps=1, guidance=1.0, seed=0, frames=9)
    assert not (tmp_path / "refused").exists(), "a refused drawing leaves no folder behind"


@pytest.mark.parametrize("architecture", ["ltx-2.5", "minimax-h3"])
def test_draw_refuses_a_modular_pipelines_export_before_loading_it_and_says_where_its_samples_are(tmp_path, architecture):
    """LTX-2.5's and MiniMax-H3's modular pipelines have no prompt-taking call: Draw answered 500 (TypeError from the sampler)."""
    import json

    from zeropipe.errors import ZeroPipeError
    from zeropipe.export.generate import ModelSource
    from zeropipe.families.diffusion.draw import load_for_drawing

    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "zeropipe_export.json").write_text(json.dumps({"architecture": architecture}))  # no weights: refused before any load
    with pytest.raises(ZeroPipeError, match=rf"{architecture} runs through diffusers' modular pipeline \w+ModularPipeline, which Draw does not drive yet.*generate.prompts.*Sample now"):
        load_for_drawing(ModelSource("hf", folder, family="diffusion"), CPU, torch.float32)


# LTX-2.3's layout in diffusers 0.42, tiny: the connectors project per modality (no caption projection in the transformer),
# gated attention and cross-attention modulation (transformer_ltx2.py / connectors.py mark them "LTX-2.3").
LTX2_3_OVERRIDES = {
    "transformer": {"use_prompt_embeddings": False, "gated_attn": True, "cross_attn_mod": True, "audio_gated_attn": True, "audio_cross_attn_mod": True},
    "connectors": {
        "per_modality_projections": True, "video_hidden_dim": 16, "audio_hidden_dim": 8, "video_connector_num_attention_heads": 2,
        "audio_connector_num_attention_heads": 2, "audio_connector_attention_head_dim": 4, "video_gated_attn": True, "audio_gated_attn": True,
    },
}


def test_the_ltx2_3_layout_is_called_and_prepared_as_its_pipeline_does(tmp_path):
    """LTX-2.3 is a config of the same classes: the one entry's prompt encoding and joint call match LTX2Pipeline's on it."""
    folder = tmp_path / "ltx2.3"
    build_tiny_pipeline({"pipeline": "tiny-ltx2", **LTX2_3_OVERRIDES}, folder, seed=1)
    test_the_denoiser_and_the_prompts_are_called_and_prepared_as_ltx2_pipeline_does(folder)


def test_the_ltx2_5_layout_saved_as_ltx2pipeline_is_called_and_prepared_as_its_pipeline_does(tmp_path):
    """LTX-2.5 as published (Lightricks/LTX-2.5-Diffusers: an LTX2Pipeline folder) is a config of this entry: Gemma 4 and 2.5's transformer deltas."""
    preset = architecture_named("ltx-2.5").record.preset
    overrides = {
        "transformer": {**LTX2_3_OVERRIDES["transformer"], "perturbed_attn": True, "ff_bias": False, "use_keyframes_abs_pos_embedding": True},
        "connectors": dict(preset["connectors"]),
        "text_encoder": {**preset["text_encoder"], "vision_config": None, "mm_tokens_per_image": None},
    }
    folder = tmp_path / "ltx2.5"
    build_tiny_pipeline({"pipeline": "tiny-ltx2", **overrides}, folder, seed=1)
    test_the_denoiser_and_the_prompts_are_called_and_prepared_as_ltx2_pipeline_does(folder)
