"""Kandinsky 6: the fused video and audio call held to Kandinsky6TI2VAPipeline's transformer call, the prompts to its own encoding,
the samples (one prompt per call, cut to its length) to its own call with a prompt string, and the audio track's latents and sound."""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.bases.kandinsky6 import TEMPLATE_TOKENS, audio_latent_count, channels_first, template_tokenizer
from zeropipe.families.diffusion.entries import PredictContext, architecture_named, architecture_of
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, text_pipeline

K6 = architecture_named("kandinsky6")
CPU = torch.device("cpu")
CONTEXT = PredictContext(CPU, torch.float32, 8, 1.0)


@pytest.fixture(scope="module")
def tiny_kandinsky6(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kandinsky6") / "pipeline"
    build_tiny_pipeline({"pipeline": "tiny-kandinsky6"}, folder, seed=1)
    return folder


def one_step(pipeline, seed: int = 0, **kwargs):
    """A one-step latent draw of a 9-frame 32x32 clip (with its sound), the transformer's call and output remembered."""
    seen = {}
    hook = pipeline.transformer.register_forward_hook(lambda module, args, called, output: seen.update(kwargs=called, output=output), with_kwargs=True)
    try:
        drawn = pipeline(num_frames=9, height=32, width=32, num_inference_steps=1, output_type="latent", return_dict=False,
                         generator=torch.Generator().manual_seed(seed), **kwargs)
    finally:
        hook.remove()
    return drawn, seen


def test_the_call_the_prompts_and_the_samples_are_the_pipelines_own(tiny_kandinsky6):
    from diffusers import Kandinsky6TI2VAPipeline
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import _PROMPT_TEMPLATE

    assert architecture_of(tiny_kandinsky6) is K6
    # The tiny tokenizer cuts where the real one does: the template before the prompt is 129 tokens, so the prompt reaches the model.
    assert len(template_tokenizer(300)(_PROMPT_TEMPLATE.split("{}")[0])["input_ids"]) == TEMPLATE_TOKENS
    pipeline = Kandinsky6TI2VAPipeline.from_pretrained(str(tiny_kandinsky6))
    pipeline.set_progress_bar_config(disable=True)
    (video, audio), seen = one_step(pipeline, prompt=["a red ball"], guidance_scale=1.0, max_sequence_length=128)
    called = seen["kwargs"]

    # The text cache's entry is what the pipeline conditions its transformer on: the padded prompt and its mask, CLIP's pooled output.
    condition = {name: value[None] for name, value in encode_prompts(text_pipeline(tiny_kandinsky6, K6, torch.float32, CPU), K6, ["a red ball"], CPU)[0].items()}
    assert torch.allclose(condition["prompt_embeds"], called["encoder_hidden_states"], atol=1e-5)
    assert torch.allclose(condition["pooled_prompt_embeds"], called["pooled_projections"], atol=1e-5)
    assert torch.equal(condition["prompt_attention_mask"].bool(), called["encoder_attention_mask"])
    length = int(condition["prompt_attention_mask"].sum())
    assert 0 < length < 128  # "a red ball<|im_end|>": the prompt itself, then padding

    # The entry's call on the same latents gives the transformer's output of the pipeline's loop, video and audio.
    hidden = called["hidden_states"]
    assert hidden.shape[-1] == 33 and not hidden[..., 16:].any()  # [latents | zero condition | zero mask]
    latents = channels_first(hidden[..., :16])
    with torch.no_grad():
        video_out, audio_out = K6.call.joint_predict(pipeline.transformer, latents, called["audio_hidden_states"], called["timestep"], condition, CONTEXT)
    torch.testing.assert_close(video_out, channels_first(seen["output"][0]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(audio_out, seen["output"][1], atol=1e-5, rtol=1e-5)
    # One Euler step from sigma 1 to 0 is latents - velocity: the pipeline steps on what the call gives, both streams.
    torch.testing.assert_close(video, latents - video_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(audio.transpose(1, 2), called["audio_hidden_states"] - audio_out, atol=1e-5, rtol=1e-5)
    # The audio track caches as many latents as the pipeline draws for the clip: 9 frames at 24 fps, 16 kHz, 128 samples a latent.
    config = pipeline.audio_vae.config
    assert called["audio_hidden_states"].shape[1] == audio_latent_count(9, 24.0, int(config.sample_rate), pipeline.audio_vae.latent_hop_length) == 47

    # Samples: the cached (padded) conditioning, one prompt per call cut to its length, is the pipeline's own draw of the prompt string.
    negative = {name: value[None] for name, value in encode_prompts(text_pipeline(tiny_kandinsky6, K6, torch.float32, CPU), K6, [""], CPU)[0].items()}
    kwargs = K6.sampling.sample_kwargs(condition, negative, 1.0, 1.0)
    drawn, outputs = K6.sampling.sample_outputs(pipeline, {**kwargs, "num_frames": 9, "height": 32, "width": 32, "num_inference_steps": 1,
                                                           "generator": torch.Generator().manual_seed(0)})
    torch.testing.assert_close(drawn, video, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs["audio_latents"], audio.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_the_audio_track_encodes_a_clips_sound_as_the_transformers_rows_and_decodes_it_into_the_sample(tiny_kandinsky6, tmp_path):
    """A tone through the audio part: (count, channels) rows scaled by the VAE's factor; decoded rows become a mono waveform in the mp4."""
    import av
    import numpy as np

    from diffusers import MMAudioVAE

    from zeropipe.families.diffusion.parts.base import Encoding

    part = K6.record.conditions[0]
    vae = MMAudioVAE.from_pretrained(str(tiny_kandinsky6 / "audio_vae"))
    t = torch.arange(6000) / 16000
    tone = 0.4 * torch.sin(2 * torch.pi * 440 * t)
    rows = part.encode(Encoding(None, torch.zeros(0), [{"waveform": tone, "latents": 47}], vae, None, CPU))[0]
    with torch.no_grad():
        mean = vae.encode(tone[None]).latent_dist.mean
    assert rows.shape == (47, 8)
    torch.testing.assert_close(rows[: mean.shape[2]], mean[0].T * 0.5302)  # 46 whole latents; the 47th, past the sound, is zero
    assert not rows[mean.shape[2] :].any()

    from types import SimpleNamespace

    from zeropipe.data.videos import write_video
    from zeropipe.families.diffusion.pipelines import PipelineFolder

    write_video(tmp_path / "clip.mp4", np.zeros((9, 32, 32, 3), np.uint8), 24.0)
    sampling = SimpleNamespace(folder=PipelineFolder(tiny_kandinsky6, K6), device=CPU)
    written = [{"video": "samples/clip.mp4"}]
    (tmp_path / "samples").mkdir()
    (tmp_path / "clip.mp4").rename(tmp_path / "samples" / "clip.mp4")
    part.add_to_samples(sampling, {"audio_latents": rows[None]}, written, tmp_path / "samples")
    with av.open(str(tmp_path / "samples" / "clip.mp4")) as container:
        assert container.streams.audio and container.streams.audio[0].rate == 16000 and container.streams.audio[0].channels == 1
    assert np.isfinite(written[0]["audio_dbfs"])


def test_the_comfyui_layout_names_the_modules_as_comfyuis_native_kandinsky6_model_does():
    """Keys as ComfyUI's native model (comfy.ldm.kandinsky6) holds them: its detection's diffusers-to-native table, pair by pair."""
    layers = {f"{module}.lora_{side}.weight": torch.ones(2, 2) for module in (
        "video_text_transformer_blocks.0.attn.to_key", "visual_transformer_blocks.3.video_dec_block.self_attention.to_query",
        "visual_transformer_blocks.3.audio_dec_block.feed_forward.net.2", "visual_transformer_blocks.0.video_dec_block.feed_forward.net.0.proj",
        "visual_transformer_blocks.1.va_cross_attention.out_layer") for side in "AB"}
    original = K6.layouts.original_lora_layout(layers, 4.0)
    assert sorted(key.removesuffix(".lora_A.weight") for key in original if key.endswith(".lora_A.weight")) == [
        "diffusion_model.video_text_transformer_blocks.0.self_attention.to_key", "diffusion_model.visual_blocks.0.videoT.feed_forward.in_layer",
        "diffusion_model.visual_blocks.1.va_cross_attention.out_layer", "diffusion_model.visual_blocks.3.audioT.feed_forward.out_layer",
        "diffusion_model.visual_blocks.3.videoT.self_attention.to_query",
    ]
    assert float(original["diffusion_model.visual_blocks.1.va_cross_attention.out_layer.alpha"]) == 4.0


def test_image_to_video_is_the_pipelines_own_call_with_the_reference_frame_appended_and_its_samples_the_pipelines_draw(tmp_path):
    """kandinsky6-i2v: a folder saying zeropipe_task image-to-video is the i2v entry; its call, on the latents and reference frame the
    pipeline's loop gave the transformer, is that call's output (video and audio); its samples with the data's first frame are the
    pipeline's own draw of the prompt string and the image."""
    import random

    from diffusers import Kandinsky6TI2VAPipeline

    from zeropipe.data.images import first_frame_image
    from zeropipe.data.videos import moving_shape_frames

    i2v = architecture_named("kandinsky6-i2v")
    folder = tmp_path / "pipeline"
    build_tiny_pipeline({"pipeline": "tiny-kandinsky6-i2v"}, folder, seed=1)
    assert architecture_of(folder) is i2v and [part.entry for part in i2v.record.conditions] == ["audio", "condition"]
    # The release's folder does not say its task (one checkpoint draws both ways): model.diffusion.task chooses, and a task the
    # folder's pipeline has no entry for is refused naming the key.
    import json
    import shutil

    from zeropipe.errors import ConfigError
    from zeropipe.families.diffusion.entries import task_problem

    release = tmp_path / "release"
    shutil.copytree(folder, release)
    index = json.loads((release / "model_index.json").read_text())
    del index["zeropipe_task"]
    (release / "model_index.json").write_text(json.dumps(index))
    assert architecture_of(release).record.name == "kandinsky6" and architecture_of(release, "image-to-video") is i2v
    assert task_problem(architecture_named("kandinsky6"), "Kandinsky6TI2VAPipeline", "auto") is None
    wan = task_problem(architecture_named("wan"), "WanPipeline", "image-to-video")
    assert wan.startswith("image-to-video: a WanPipeline has no image-to-video entry") and "Kandinsky6TI2VAPipeline" in wan and "remove the key" in wan
    with pytest.raises(ConfigError, match="model.diffusion.task"):
        index["_class_name"] = "Kandinsky5T2VPipeline"  # a pipeline whose image-to-video model has its own folder
        (release / "model_index.json").write_text(json.dumps(index))
        architecture_of(release, "image-to-video")
    pipeline = Kandinsky6TI2VAPipeline.from_pretrained(str(folder))
    pipeline.set_progress_bar_config(disable=True)
    frames = moving_shape_frames("circle", "red", "blue", "left", (32, 32), 9, random.Random(0))
    clip = torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)
    image = first_frame_image(clip)
    (video, audio), seen = one_step(pipeline, prompt=["a red ball"], image=image, guidance_scale=1.0, max_sequence_length=128)
    called = seen["kwargs"]

    # The pipeline's input: the 3 latent frames and the image's latents as a 4th, the mask 1 on it only, the condition channels zero.
    hidden = called["hidden_states"]
    assert hidden.shape[1] == 4 and hidden[..., 32].eq(torch.tensor([0.0, 0.0, 0.0, 1.0])[None, :, None, None]).all() and not hidden[..., 16:32].any()
    latents, given = channels_first(hidden[:, :-1, ..., :16]), channels_first(hidden[:, -1:, ..., :16])
    condition = {name: value[None] for name, value in encode_prompts(text_pipeline(folder, i2v, torch.float32, CPU), i2v, ["a red ball"], CPU)[0].items()}
    condition["first_frame_latents"] = given
    with torch.no_grad():
        video_out, audio_out = i2v.call.joint_predict(pipeline.transformer, latents, called["audio_hidden_states"], called["timestep"], condition, CONTEXT)
        plain, _ = K6.call.joint_predict(pipeline.transformer, latents, called["audio_hidden_states"], called["timestep"], condition, CONTEXT)
    torch.testing.assert_close(video_out, channels_first(seen["output"][0][:, :-1]), atol=1e-5, rtol=1e-5)  # the reference frame's output dropped
    torch.testing.assert_close(audio_out, seen["output"][1], atol=1e-5, rtol=1e-5)
    assert (video_out - plain).abs().max() > 1e-3  # the reference frame conditions the clip: the text-to-video call differs
    torch.testing.assert_close(video, latents - video_out, atol=1e-5, rtol=1e-5)  # one Euler step on what the call gives, tail dropped

    # The cache's first frame (FirstFrameAlone through the codec, normalised as the clip's) is the pipeline's encoding of the image,
    # the distribution's mode where the pipeline draws from it with its generator.
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import retrieve_latents

    from zeropipe.families.diffusion.parts.base import Encoding
    from zeropipe.families.diffusion.pipelines import latent_scaling, normalize_latents

    with torch.no_grad():
        cached = i2v.record.conditions[1].encode(Encoding(pipeline.vae, clip[None], [None], None, i2v.record.codec, CPU))[0]
        pixels = pipeline.video_processor.preprocess(image, height=32, width=32, resize_mode="crop").unsqueeze(2)
        theirs = retrieve_latents(pipeline.vae.encode(pixels), sample_mode="argmax") * pipeline.vae.config.scaling_factor
    torch.testing.assert_close(normalize_latents(cached[None], *latent_scaling(folder, i2v)), theirs, atol=1e-4, rtol=1e-4)

    # Samples: the data's first frame as the pipeline's image (FirstFrameAlone's sample input), drawn as the pipeline draws the prompt string.
    negative = {name: value[None] for name, value in encode_prompts(text_pipeline(folder, i2v, torch.float32, CPU), i2v, [""], CPU)[0].items()}
    kwargs = {**i2v.sampling.sample_kwargs(condition, negative, 1.0, 1.0), "image": image}
    drawn, outputs = i2v.sampling.sample_outputs(pipeline, {**kwargs, "num_frames": 9, "height": 32, "width": 32, "num_inference_steps": 1,
                                                            "generator": torch.Generator().manual_seed(0)})
    torch.testing.assert_close(drawn, video, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs["audio_latents"], audio.transpose(1, 2), atol=1e-5, rtol=1e-5)
