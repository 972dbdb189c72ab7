"""Lumina 2, HiDream-I1, AuraFlow, HunyuanImage 2.1: each entry's ``predict`` is its pipeline's own denoiser step (Qwen-Image 2.1's: test_qwen_image21.py).

The pipeline is run as a user runs it (a prompt string, its own latents and timesteps); the
velocity it hands its scheduler at the first step, and the latents that step starts from, are
recorded. The entry, given those latents and timestep in its own layout and the prompt's
conditioning as its text part encodes it (what the text cache holds), must return the same
velocity: that checks the prompt's preparation, the latents' layout and packing, the timestep's
convention and the output's sign in one comparison.
"""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_of
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, stack_padded, text_pipeline, vae_scale_factor

CPU = torch.device("cpu")
PROMPT = 'a red circle on a sign that says "open"'  # the quoted text is HunyuanImage's glyph prompt
# preset -> (the pipeline call's arguments that turn classifier-free guidance off: one denoiser call per step, the latents of a 64-pixel image).
PRESETS = {
    "tiny-lumina2": ({"guidance_scale": 1.0}, (4, 8, 8)),
    "tiny-hidream": ({"guidance_scale": 1.0}, (4, 32, 32)),
    "tiny-auraflow": ({"guidance_scale": 1.0}, (4, 32, 32)),
    "tiny-hunyuan-image": ({}, (16, 16, 16)),  # no guider in the folder: the pipeline's default (off)
}


@pytest.fixture(scope="module", params=list(PRESETS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param) / "pipeline"
    arch = build_tiny_pipeline({"pipeline": request.param}, folder, seed=1)
    return request.param, arch, folder


def first_step(arch, pipeline, **kwargs):
    """(velocity, latents, timestep) the pipeline, called as sampling calls it, hands its scheduler at its first step."""
    scheduler = pipeline.scheduler
    seen = []
    step = scheduler.step

    def record(model_output, timestep, sample, *args, **more):
        if not seen:
            seen.append((model_output.clone(), sample.clone(), torch.as_tensor(timestep).clone()))
        return step(model_output, timestep, sample, *args, **more)

    scheduler.step = record
    try:
        arch.sampling.draw(pipeline, kwargs)
    finally:
        del scheduler.step
    return seen[0]


def test_predict_is_the_pipelines_denoiser_step_on_its_own_prompt_preparation(tiny):
    preset, arch, folder = tiny
    assert architecture_of(folder) is arch and arch.record.preset_name == preset
    pipeline = arch.pipeline().from_pretrained(str(folder), **arch.record.pipeline_kwargs)
    pipeline.set_progress_bar_config(disable=True)
    size = 64
    velocity, latents, timestep = first_step(
        arch, pipeline, prompt=PROMPT, height=size, width=size, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent", return_dict=False,
        **PRESETS[preset][0],
    )
    factor = vae_scale_factor(folder)
    ours_latents = arch.sampling.unpack_latents(pipeline, latents, size, factor)
    expected = arch.sampling.unpack_latents(pipeline, velocity, size, factor)

    encoders = text_pipeline(folder, arch, torch.float32, CPU)
    rows = encode_prompts(encoders, arch, [PROMPT], CPU)  # what the text cache holds for the caption
    condition = {key: stack_padded([row[key] for row in rows]) for key in rows[0]}
    context = PredictContext(CPU, torch.float32, factor, 1.0)
    with torch.no_grad():
        out = arch.call.predict(pipeline.transformer, ours_latents, timestep.reshape(1).float(), condition, context)
    assert out.shape == ours_latents.shape and expected.abs().mean() > 1e-3  # a zero output would match any call
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_a_captions_prediction_does_not_depend_on_the_padding_its_batch_adds(tiny):
    """Captions are cached alone and stacked per micro-batch: a longer neighbour must not change a caption's prediction."""
    preset, arch, folder = tiny
    encoders = text_pipeline(folder, arch, torch.float32, CPU)
    alone = encode_prompts(encoders, arch, ["a red circle"], CPU)[0]
    with_long = encode_prompts(encoders, arch, ["a red circle", "a small green square on a white background, seen from above"], CPU)
    batch = {key: stack_padded([row[key] for row in with_long]) for key in alone}
    model = arch.model_class().from_pretrained(str(folder / arch.record.denoiser)).eval()
    factor = vae_scale_factor(folder)
    context = PredictContext(CPU, torch.float32, factor, 1.0)
    latents = torch.randn(1, *PRESETS[preset][1], generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([700.0])
    with torch.no_grad():
        reference = arch.call.predict(model, latents, timesteps, {key: value[None] for key, value in alone.items()}, context)
        both = arch.call.predict(model, latents.repeat(2, *[1] * (latents.dim() - 1)), timesteps.repeat(2), batch, context)
    torch.testing.assert_close(both[:1], reference, rtol=1e-4, atol=1e-5)
    assert (both[0] - both[1]).abs().max() > 1e-6  # the caption reaches the denoiser (weakly, in a random tiny AuraFlow)


def test_hidream_trains_on_the_prediction_the_pipeline_samples_with(tmp_path):
    """In training mode HiDream's transformer returns its output patch-major (padded to its longest sequence for a
    non-square image) and routes experts by another path: the entry's prediction must be the eval-mode one, square or not."""
    from zeropipe.families.diffusion.entries import architecture_named

    arch = architecture_named("hidream")
    build_tiny_pipeline({"pipeline": "tiny-hidream"}, tmp_path / "pipeline", seed=2)
    encoders = text_pipeline(tmp_path / "pipeline", arch, torch.float32, CPU)
    rows = encode_prompts(encoders, arch, ["a red circle", "a blue square"], CPU)
    condition = {key: stack_padded([row[key] for row in rows]) for key in rows[0]}
    model = arch.model_class().from_pretrained(str(tmp_path / "pipeline" / "transformer"))
    context = PredictContext(CPU, torch.float32, 2, 1.0)
    for shape in ((2, 4, 16, 16), (2, 4, 12, 20)):
        latents = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        timesteps = torch.tensor([800.0, 250.0])
        with torch.no_grad():
            model.eval()
            sampled = arch.call.predict(model, latents, timesteps, condition, context)
            model.train()
            trained = arch.call.predict(model, latents, timesteps, condition, context)
        assert trained.shape == latents.shape
        torch.testing.assert_close(trained, sampled, rtol=1e-4, atol=1e-5)


def test_hidream_lora_in_comfyui_names_converts_back_with_diffusers_to_the_trained_change():
    """``diffusion_model.`` names with alpha / r folded into lora_B: diffusers' HiDream converter gives back every module's change at scale 1."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_hidream_lora_to_diffusers

    from tests.unit.diffusion.test_image_architectures import deltas, random_lora
    from zeropipe.families.diffusion.entries import architecture_named

    inner = 2560  # HiDream-I1: 20 heads x 128
    shapes = {f"double_stream_blocks.0.block.attn1.{name}": (inner, inner) for name in ("to_q", "to_k", "to_v", "to_out", "to_q_t", "to_out_t")}
    shapes |= {f"single_stream_blocks.31.block.attn1.{name}": (inner, inner) for name in ("to_q", "to_v")}
    rank, alpha = 4, 16.0
    layers = random_lora(shapes, rank)
    original = architecture_named("hidream").layouts.original_lora_layout(layers, alpha)
    assert "diffusion_model.double_stream_blocks.0.block.attn1.to_q_t.lora_A.weight" in original and not any(key.endswith(".alpha") for key in original)
    converted = _convert_non_diffusers_hidream_lora_to_diffusers(dict(original))
    recovered = {key.removeprefix("transformer."): value for key, value in deltas(converted, 1.0).items()}
    expected = deltas(layers, alpha / rank)
    assert set(recovered) == set(expected)
    for module, delta in expected.items():
        torch.testing.assert_close(recovered[module], delta, rtol=1e-4, atol=1e-3)


def test_hunyuan_image_trains_with_gradient_checkpointing_as_without():
    """HunyuanImage's transformer hands attention_mask= to the checkpointing function, which diffusers' default cannot take:
    the rank's function passes it on, and the gradients are those of a run without checkpointing."""
    from zeropipe.families.diffusion.entries import architecture_named
    from zeropipe.families.diffusion.task import checkpoint_with_keywords

    arch = architecture_named("hunyuan-image")
    generator = torch.Generator().manual_seed(0)
    # Short captions (the transformer takes any length): 12 Qwen tokens and 8 glyph bytes, the second caption padded.
    condition = {
        "prompt_embeds": torch.randn(2, 12, 32, generator=generator), "prompt_embeds_mask": torch.tensor([[1.0] * 12, [1.0] * 7 + [0.0] * 5]),
        "prompt_embeds_2": torch.randn(2, 8, 64, generator=generator), "prompt_embeds_mask_2": torch.tensor([[1.0] * 3 + [0.0] * 5, [0.0] * 8]),
    }
    context = PredictContext(CPU, torch.float32, 4, 1.0)
    latents = torch.randn(2, 16, 8, 8, generator=generator)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(1)
        model = arch.model_class()(**arch.record.preset["transformer"]).train()
        if checkpointing:
            model.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint_with_keywords)
        arch.call.predict(model, latents, torch.tensor([900.0, 300.0]), condition, context).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
