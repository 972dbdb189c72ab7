"""Cosmos 3 Omni (``bases/cosmos3.py``, the ``cosmos3`` entry) held to its pipelines on a tiny model.

The denoiser call is held to Cosmos3OmniModularPipeline's own blocks on a tiny transformer:

The blocks are run as the pipeline runs them for text-to-video: ``Cosmos3PrepareTextSegmentsStep`` (the prompt's token ids),
``Cosmos3VisionPackSequenceStep`` and ``Cosmos3VisionDenoiseInputStep`` (the packed sequence and its mRoPE ids), then one
iteration of the loop's ``Cosmos3VisionLoopPrepareStep`` and ``Cosmos3LoopDenoiser`` with guidance off (its conditional pass);
the call, given the latents and the padded prompt ids with their mask, must return the same velocity, for prompts of
different lengths in one batch.

The prompt part (``PromptPerClip``) and the samples are held to ``Cosmos3OmniPipeline.__call__`` on the entry's tiny preset:
the token ids cached per (caption, clip shape) and the negative prompt's, drawn through ``sampler.denoise`` with guidance, give
the latents the pipeline's own call draws from the prompt strings; the ids carry the clip's shape (other shape, other ids and key).
The codec's normalised latents are the pipeline's ``_encode_video``; the Draw page writes the clip the pipeline returns.
"""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.bases.cosmos3 import ARCHITECTURE, Cosmos3Call
from zeropipe.families.diffusion.core import PredictContext
from zeropipe.families.diffusion.modular import run_block, run_loop_block

CONTEXT = PredictContext(torch.device("cpu"), torch.float32, 16, 1.0)
TINY = {
    "head_dim": 16, "hidden_size": 32, "intermediate_size": 64, "latent_channel": 4, "patch_latent_dim": 16, "num_attention_heads": 2,
    "num_hidden_layers": 2, "num_key_value_heads": 1, "vocab_size": 300, "rope_axes_dim": [4, 2, 2], "dtype": "float32",
}


@pytest.fixture(scope="module")
def tiny():
    from diffusers import Cosmos3OmniModularPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler

    torch.manual_seed(0)
    transformer = Cosmos3OmniTransformer(**TINY).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    scheduler.set_timesteps(4)
    pipeline = Cosmos3OmniModularPipeline()
    pipeline.update_components(transformer=transformer, scheduler=scheduler)
    return pipeline, transformer


def block_velocity(pipeline, latents, t, ids, fps):
    from diffusers.modular_pipelines.cosmos.before_denoise import (
        Cosmos3PrepareTextSegmentsStep,
        Cosmos3VisionDenoiseInputStep,
        Cosmos3VisionPackSequenceStep,
    )
    from diffusers.modular_pipelines.cosmos.denoise import Cosmos3LoopDenoiser, Cosmos3VisionLoopPrepareStep

    text = run_block(pipeline, Cosmos3PrepareTextSegmentsStep(), ("cond_text_segment", "uncond_text_segment"), cond_input_ids=ids, uncond_input_ids=ids)
    vision = run_block(pipeline, Cosmos3VisionPackSequenceStep(), ("cond_vision_segment", "uncond_vision_segment"), **text, latents=latents, fps_vision=fps,
                       vision_condition_indexes_for_pack=[])
    sequence = run_block(pipeline, Cosmos3VisionDenoiseInputStep(), ("cond_position_ids", "uncond_position_ids", "cond_sequence_length", "uncond_sequence_length"),
                         **text, **vision)
    fields = {**text, **vision, **sequence}
    state = run_loop_block(pipeline, [Cosmos3VisionLoopPrepareStep(), Cosmos3LoopDenoiser()], 0, t, latents=latents, cond_vision_segment=vision["cond_vision_segment"],
                           denoiser_input_fields=fields, guidance_scale=1.0, vision_condition_mask=torch.zeros(latents.shape[2], 1, 1))
    return state.velocity_vision


def test_predict_is_the_loop_denoisers_conditional_pass(tiny):
    pipeline, transformer = tiny
    torch.manual_seed(1)
    latents = torch.randn(2, 4, 3, 4, 6)
    t = pipeline.scheduler.timesteps[1]
    prompts = [[5, 17, 40, 41, 42, 99, 7], [8, 9, 10, 11]]
    longest = max(len(p) for p in prompts)
    condition = {
        "input_ids": torch.tensor([p + [0] * (longest - len(p)) for p in prompts]),
        "input_ids_mask": torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in prompts]),
        "fps": torch.tensor([24.0, 16.0]),
    }
    ours = Cosmos3Call().predict(transformer, latents, t.expand(2), condition, CONTEXT)
    expected = torch.cat([block_velocity(pipeline, latents[i : i + 1], t, prompts[i], float(condition["fps"][i])) for i in range(2)])
    assert ours.shape == latents.shape
    assert torch.allclose(ours, expected, atol=1e-5), (ours - expected).abs().max()
    # The frame rate and the prompt are inputs the call reads (fps modulation of the mRoPE ids; the text pathway).
    swapped = Cosmos3Call().predict(transformer, latents, t.expand(2), {**condition, "fps": torch.tensor([12.0, 16.0])}, CONTEXT)
    assert not torch.allclose(swapped[0], ours[0], atol=1e-5) and torch.allclose(swapped[1], ours[1], atol=1e-6)
    other = Cosmos3Call().predict(transformer, latents[:1], t.expand(1), {"input_ids": condition["input_ids"][1:], "input_ids_mask": condition["input_ids_mask"][1:]}, CONTEXT)
    assert not torch.allclose(other, ours[:1], atol=1e-5)


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
    from diffusers import Cosmos3OmniPipeline

    from zeropipe.families.diffusion.pipelines import build_tiny_pipeline

    folder = tmp_path_factory.mktemp("cosmos3") / "pipeline"
    build_tiny_pipeline({"pipeline": ARCHITECTURE.record.preset_name}, folder, seed=1)
    return Cosmos3OmniPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)


def test_the_prompt_part_tokenizes_per_clip_shape_with_the_pipelines_templates(tiny_pipeline):
    from zeropipe.families.diffusion.parts.clip_prompt import NEGATIVE, clip_text_key

    part, tokenizer = ARCHITECTURE.record.text, tiny_pipeline.text_tokenizer
    entries = [["k1", "a red ball", 64, 32, 9, 24.0], ["k2", "a red ball", 32, 32, 1, 24.0], ["k3", NEGATIVE, 64, 32, 9, 24.0]]
    video, image, negative = part.encode_clips(ARCHITECTURE, tiny_pipeline, entries)
    assert video["input_ids"].dtype == torch.long and video["input_ids_mask"].sum() == len(video["input_ids"])
    expected_cond, expected_uncond = tiny_pipeline.tokenize_prompt("a red ball", "", num_frames=9, height=32, width=64, fps=24.0)
    assert video["input_ids"].tolist() == expected_cond and negative["input_ids"].tolist() == expected_uncond
    def said(ids):  # the tiny tokenizer's decoding drops the spaces
        return tokenizer.decode(ids).replace(" ", "")

    text = said(video["input_ids"])
    assert "0.4secondslong" in text and "24FPS" in text and "32x64resolution" in text and "generatevideos" in text, text
    assert "generateimages" in said(image["input_ids"]) and "notof32x64" in said(negative["input_ids"])
    # The cache key holds what the ids depend on: the same caption on another clip shape is another entry.
    assert len({clip_text_key("a red ball", "fp", shape) for shape in [(64, 32, 9, 24.0), (32, 32, 9, 24.0), (64, 32, 5, 24.0), (64, 32, 9, 16.0)]}) == 4


def test_samples_are_the_pipelines_own_call_on_the_cached_ids(tiny_pipeline):
    from zeropipe.families.diffusion.parts.clip_prompt import NEGATIVE
    from zeropipe.families.diffusion.pipelines import stack_padded

    prompts, size, frames, fps, steps, scale = ["a red ball", "two blue squares move left"], 32, 5, 24.0, 2, 4.0
    generator = torch.Generator().manual_seed(3)
    expected = torch.cat([
        tiny_pipeline(prompt=prompt, negative_prompt="", num_frames=frames, height=size, width=size, fps=fps, num_inference_steps=steps,
                      guidance_scale=scale, generator=generator, output_type="latent", return_dict=False)[0]
        for prompt in prompts
    ])
    part = ARCHITECTURE.record.text

    def rows(texts):
        encoded = part.encode_clips(ARCHITECTURE, tiny_pipeline, [["k", text, size, size, frames, fps] for text in texts])
        out = {name: stack_padded([row[name] for row in encoded]) for name in ("input_ids", "input_ids_mask")}
        return {**out, "fps": torch.full((len(texts),), fps)}

    kwargs = {
        "height": size, "width": size, "num_frames": frames, "num_inference_steps": steps, "generator": torch.Generator().manual_seed(3),
        "output_type": "latent", "return_dict": False, **ARCHITECTURE.sampling.sample_kwargs(rows(prompts), rows([NEGATIVE] * 2), scale, 1.0),
    }
    ours = ARCHITECTURE.sampling.draw(tiny_pipeline, kwargs)
    assert ours.shape == expected.shape == (2, 48, 2, 2, 2)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    unguided = ARCHITECTURE.sampling.draw(tiny_pipeline, {**kwargs, "guidance_scale": 1.0, "generator": torch.Generator().manual_seed(3)})
    assert not torch.allclose(unguided, ours, atol=1e-4)  # the guidance's unconditional pass is taken


def test_the_draw_page_writes_the_clip_the_pipeline_draws(tiny_pipeline, tmp_path):
    """The UI's Draw page (families.diffusion.draw) gives the prompt string; Cosmos3OmniPipeline returns its clip as ``video``."""
    from zeropipe.export.generate import LoadedModel, ModelSource
    from zeropipe.families.diffusion.draw import draw

    loaded = LoadedModel(tiny_pipeline, None, ModelSource("hf", tmp_path, family="diffusion"), torch.device("cpu"))
    row = draw(loaded, tmp_path / "draw", "a red ball", "", 32, 32, steps=1, guidance=1.0, seed=0, frames=5)[0]
    assert row["kind"] == "video" and row["frames"] == 5 and (row["width"], row["height"]) == (32, 32), row
    assert (tmp_path / "draw" / row["file"]).stat().st_size > 0


def test_the_codec_normalises_latents_as_the_pipelines_own_encoder(tiny_pipeline):
    """The cached distribution's mean, normalised by the codec, is ``Cosmos3OmniPipeline._encode_video`` (per-channel stats not 0/1)."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline

    from zeropipe.families.diffusion.pipelines import normalize_latents

    generator = torch.Generator().manual_seed(0)
    channels = ARCHITECTURE.record.preset["transformer"]["latent_channel"]
    stats = {"latents_mean": torch.randn(channels, generator=generator).tolist(), "latents_std": (torch.rand(channels, generator=generator) + 0.5).tolist()}
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**{**ARCHITECTURE.record.preset["vae"], **stats}).eval()
    pipeline = Cosmos3OmniPipeline(transformer=tiny_pipeline.transformer, text_tokenizer=tiny_pipeline.text_tokenizer, vae=vae, scheduler=tiny_pipeline.scheduler,
                                   enable_safety_checker=False)
    pixels = torch.rand(1, 3, 5, 32, 32, generator=generator) * 2 - 1
    codec = ARCHITECTURE.record.codec
    with torch.no_grad():
        mean, _ = codec.encode(vae, codec.vae_pixels(pixels))
        expected = pipeline._encode_video(pixels)
    shift, scale = codec.normalization(dict(vae.config))
    torch.testing.assert_close(normalize_latents(codec.from_vae(mean), shift, scale), expected, rtol=1e-5, atol=1e-5)
