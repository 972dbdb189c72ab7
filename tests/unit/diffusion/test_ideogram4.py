"""Ideogram 4: the entry's denoiser call, sampling loop and codec are its pipeline's own, and its ComfyUI LoRA converts back.

``Ideogram4Pipeline`` takes no prompt features (it always runs its text encoder) and guides with a
second transformer; the entry caches the features its ``encode_prompt`` returns and samples with
the pipeline's loop unguided. Each is checked against one run of the pipeline as a user runs it (a
prompt string, guidance 1: the blend ``1 * conditional + 0 * unconditional``).
"""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_named
from zeropipe.families.diffusion.parts.latents import patchify, unpatchify
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, denormalize_latents, encode_prompts, latent_scaling, stack_padded, text_pipeline, vae_scale_factor

CPU = torch.device("cpu")
PROMPT = "a red circle on a sign"
SIZE = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny pipeline folder, its VAE given batch-norm statistics that are not 0 and 1 (so their channel order matters)."""
    from diffusers import AutoencoderKLFlux2

    folder = tmp_path_factory.mktemp("ideogram4") / "pipeline"
    arch = build_tiny_pipeline({"pipeline": "tiny-ideogram4"}, folder, seed=1)
    vae = AutoencoderKLFlux2.from_pretrained(str(folder / "vae"))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(vae.bn.running_mean.shape, generator=generator))
        vae.bn.running_var.copy_(torch.rand(vae.bn.running_var.shape, generator=generator) + 0.5)
    vae.save_pretrained(str(folder / "vae"))
    pipeline = arch.pipeline().from_pretrained(str(folder))
    pipeline.set_progress_bar_config(disable=True)
    encoders = text_pipeline(folder, arch, torch.float32, CPU)
    return arch, folder, pipeline, encoders


def conditioning(arch, encoders, prompts):
    """What the text cache holds for these captions, stacked as a micro-batch."""
    rows = encode_prompts(encoders, arch, prompts, CPU)
    return {key: stack_padded([row[key] for row in rows]) for key in rows[0]}


def test_predict_sampling_and_decoding_are_the_pipelines_own(tiny):
    arch, folder, pipeline, encoders = tiny
    scheduler, step = pipeline.scheduler, pipeline.scheduler.step
    first = []

    def record(model_output, timestep, sample, *args, **more):
        if not first:
            first.append((model_output.clone(), sample.clone(), torch.as_tensor(timestep).clone()))
        return step(model_output, timestep, sample, *args, **more)

    final = {}
    scheduler.step = record
    try:
        images = pipeline(
            prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=3, guidance_scale=1.0, guidance_schedule=None, max_sequence_length=64,
            generator=torch.Generator().manual_seed(0), output_type="pt", return_dict=False,
            callback_on_step_end=lambda pipe, i, t, kwargs: final.update(kwargs) or {}, callback_on_step_end_tensor_inputs=["latents"],
        )[0]
    finally:
        del scheduler.step
    velocity, latents, timestep = first[0]
    factor = vae_scale_factor(folder)
    condition = conditioning(arch, encoders, [PROMPT])
    context = PredictContext(CPU, torch.float32, factor, 1.0)

    # The denoiser call: the cached conditioning, the latents in the entry's layout, the scheduler's timestep.
    with torch.no_grad():
        ours = arch.call.predict(pipeline.transformer, arch.sampling.unpack_latents(pipeline, latents, SIZE, factor), timestep.reshape(1).float(), condition, context)
    expected = arch.sampling.unpack_latents(pipeline, velocity, SIZE, factor)
    assert expected.abs().mean() > 1e-3
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)

    # The sampling loop on the cached conditioning: the same noise, sigmas and steps as the pipeline's own call.
    kwargs = {
        **arch.sampling.sample_kwargs(condition, conditioning(arch, encoders, [""]), 1.0, 1.0), "height": SIZE, "width": SIZE, "num_inference_steps": 3,
        "generator": torch.Generator().manual_seed(0), "output_type": "latent", "return_dict": False,
    }
    drawn = arch.sampling.draw(pipeline, kwargs)
    torch.testing.assert_close(drawn, final["latents"], rtol=1e-4, atol=1e-5)

    # The codec decodes those latents (unpatched in Ideogram's channel order, the VAE's statistics undone) into the pipeline's image.
    shift, scale = latent_scaling(folder, arch)
    with torch.no_grad():
        decoded = arch.record.codec.decode(pipeline.vae, denormalize_latents(arch.sampling.unpack_latents(pipeline, drawn, SIZE, factor), shift, scale))
    torch.testing.assert_close((decoded / 2 + 0.5).clamp(0, 1), images, rtol=1e-4, atol=1e-4)
    packed = torch.randn(2, 16, 4, 6)
    assert torch.equal(patchify(unpatchify(packed)), packed)


def test_a_caption_longer_than_the_pipeline_takes_is_refused_by_name(tiny, monkeypatch):
    from zeropipe.families.diffusion.entries import ideogram4
    from zeropipe.errors import ConfigError

    arch, _, _, encoders = tiny
    monkeypatch.setattr(ideogram4, "MAX_TEXT_TOKENS", 40)  # the real limit is 2048 tokens; the tiny tokenizer has one per character
    with pytest.raises(ConfigError, match=r"a caption is \d+ tokens .* more than its 40 .*shorten it \('a long caption"):
        encode_prompts(encoders, arch, ["short", "a long caption " * 3], CPU)


def test_a_captions_prediction_does_not_depend_on_its_batchs_padding(tiny):
    """Captions are cached alone and stacked per micro-batch; the packed sequence left-pads them as the pipeline does."""
    arch, folder, pipeline, encoders = tiny
    alone = conditioning(arch, encoders, ["a red circle"])
    both = conditioning(arch, encoders, ["a red circle", "a small green square on a white background, seen from above"])
    context = PredictContext(CPU, torch.float32, vae_scale_factor(folder), 1.0)
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = arch.call.predict(pipeline.transformer, latents, torch.tensor([700.0]), alone, context)
        batch = arch.call.predict(pipeline.transformer, latents.repeat(2, 1, 1, 1), torch.tensor([700.0, 700.0]), both, context)
    torch.testing.assert_close(batch[:1], reference, rtol=1e-4, atol=1e-5)
    assert (batch[0] - batch[1]).abs().max() > 1e-5


def test_lora_in_ai_toolkits_layout_converts_back_with_diffusers_to_the_trained_change():
    """``diffusion_model.layers.N.attention.qkv`` (fused, block-diagonal), ``attention.o``, ``feed_forward.w*``: diffusers' converter recovers each module's change."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ideogram4_lora_to_diffusers

    from tests.unit.diffusion.test_image_architectures import deltas, random_lora

    inner, hidden = 4608, 12288  # Ideogram 4: 18 heads x 256, SwiGLU of 12288
    shapes = {f"layers.0.attention.{name}": (inner, inner) for name in ("to_q", "to_k", "to_v", "to_out.0")}
    shapes |= {"layers.0.feed_forward.w1": (hidden, inner), "layers.0.feed_forward.w3": (hidden, inner), "layers.33.feed_forward.w2": (inner, hidden)}
    shapes |= {"layers.33.attention.to_q": (inner, inner)}  # q alone: k and v keep zero rows
    rank, alpha = 4, 16.0
    layers = random_lora(shapes, rank)
    original = architecture_named("ideogram4").layouts.original_lora_layout(layers, alpha)
    assert "diffusion_model.layers.0.attention.qkv.lora_A.weight" in original and not any(key.endswith(".alpha") for key in original)
    assert original["diffusion_model.layers.0.attention.qkv.lora_B.weight"].shape == (3 * inner, 3 * rank)
    converted = _convert_non_diffusers_ideogram4_lora_to_diffusers(dict(original))
    recovered = {key.removeprefix("transformer."): value for key, value in deltas(converted, 1.0).items()}
    expected = deltas(layers, alpha / rank)
    for module, change in expected.items():
        torch.testing.assert_close(recovered[module], change, rtol=1e-4, atol=1e-3)
    assert all(value.abs().max() == 0 for key, value in recovered.items() if key not in expected)


def test_diffusion_pipes_ideogram4_type_converts_to_the_entry():
    """diffusion-pipe's [model] type = 'ideogram4' (models/ideogram4.py there) used to convert as CANNOT TRAIN YET."""
    from zeropipe.convert.diffusion_pipe import trainable_architecture

    assert trainable_architecture("ideogram4") == "ideogram4"
