"""Kandinsky 5 T2I, Krea 2 and ERNIE-Image against their own diffusers pipelines.

For each entry: the pipeline itself draws from a prompt (its own prompt encoding, latent
preparation and denoiser call, captured by a hook on its transformer), and the entry's
``encode_prompts`` + ``predict`` on the same latents and timestep give the same denoiser output
(in the entry's latent layout). Then the latent normalisation the codec trains with is the one
the pipeline decodes with.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_named

PROMPT = "a red circle"


def captured_call(pipeline, denoiser: str, **call):
    """The first denoiser call of a pipeline run: its keyword arguments and its output."""
    seen: dict = {}

    def hook(module, args, kwargs, output):
        if not seen:
            seen["kwargs"], seen["output"] = dict(kwargs), output
        return output

    handle = getattr(pipeline, denoiser).register_forward_hook(hook, with_kwargs=True)
    try:
        pipeline(**call)
    finally:
        handle.remove()
    return seen["kwargs"], seen["output"]


def first(output):
    return output[0] if isinstance(output, (tuple, list)) else output.sample


# Per entry: (pipeline call arguments beyond the prompt and size, the pipeline's denoiser input -> (the entry's latents, timesteps),
# the pipeline's denoiser output -> the entry's layout).
def kandinsky_case(pipeline):
    from zeropipe.families.diffusion.bases.kandinsky5_t2i import channels_first

    pipeline.resolutions.append((32, 32))  # the pipeline snaps other sizes to its 1024-pixel ones
    return (
        {"guidance_scale": 1.0},
        lambda kwargs: (channels_first(kwargs["hidden_states"]), kwargs["timestep"]),
        lambda output: channels_first(first(output)),
    )


def krea2_case(pipeline):
    from zeropipe.families.diffusion.entries.krea2 import unpack

    side = 32 // pipeline.vae_scale_factor
    return (
        {"guidance_scale": 0.0},  # Krea 2's convention: 0 is no guidance
        lambda kwargs: (unpack(kwargs["hidden_states"], side, side), kwargs["timestep"] * 1000),
        lambda output: unpack(first(output), side, side),
    )


def ernie_case(pipeline):
    return ({"guidance_scale": 1.0, "use_pe": False}, lambda kwargs: (kwargs["hidden_states"], kwargs["timestep"]), first)


CASES = {"kandinsky5-t2i": kandinsky_case, "krea2": krea2_case, "ernie-image": ernie_case}


@pytest.fixture(scope="module")
def tiny_pipelines(tmp_path_factory):
    from zeropipe.families.diffusion.pipelines import build_tiny_pipeline

    root = tmp_path_factory.mktemp("pipelines")
    built = {}

    def build(name):
        if name not in built:
            arch = architecture_named(name)
            build_tiny_pipeline({"pipeline": arch.record.preset_name}, root / name, seed=1)
            built[name] = root / name
        return built[name]

    return build


@pytest.mark.parametrize("name", sorted(CASES))
def test_predict_is_the_pipelines_own_denoiser_call_on_its_own_prompt_encoding_and_latents(tiny_pipelines, name):
    from zeropipe.families.diffusion.pipelines import vae_scale_factor

    arch = architecture_named(name)
    folder: Path = tiny_pipelines(name)
    pipeline = arch.pipeline().from_pretrained(str(folder), **arch.record.pipeline_kwargs)
    pipeline.set_progress_bar_config(disable=True)
    extra, to_entry_input, to_entry_output = CASES[name](pipeline)
    kwargs, output = captured_call(
        pipeline, arch.record.denoiser, prompt=PROMPT, height=32, width=32, num_inference_steps=2, output_type="latent",
        generator=torch.Generator().manual_seed(0), **extra,
    )
    latents, timesteps = to_entry_input(kwargs)
    cpu = torch.device("cpu")
    with torch.no_grad():
        condition = arch.prompts.encode_prompts(pipeline, [PROMPT], cpu)
        context = PredictContext(cpu, torch.float32, vae_scale_factor(folder), 1.0)
        predicted = arch.call.predict(getattr(pipeline, arch.record.denoiser), latents, timesteps, condition, context)
    expected = to_entry_output(output)
    assert predicted.shape == latents.shape, f"{name}: predict returned {tuple(predicted.shape)} for latents {tuple(latents.shape)}"
    torch.testing.assert_close(predicted, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: predict differs from the pipeline's denoiser call: {m}")


# Per entry: a VAE config as the real checkpoint has it, and the (shift, scale) its pipeline decodes with (latents / scale + shift).
DECODED_WITH = {
    # Kandinsky5T2IPipeline: latents / scaling_factor, although the Flux VAE's config has a shift factor.
    "kandinsky5-t2i": ({"scaling_factor": 0.3611, "shift_factor": 0.1159, "block_out_channels": [128, 256, 512, 512]}, (0.0, 0.3611)),
    # ErnieImagePipeline: latents x sqrt(running_var + 1e-5) + running_mean, with eps 1e-5 whatever the config says (no VAE folder: mean 0, var 1).
    "ernie-image": ({"latent_channels": 32, "batch_norm_eps": 1e-4, "block_out_channels": [128, 256, 512, 512]}, (0.0, 1 / (1 + 1e-5) ** 0.5)),
}


@pytest.mark.parametrize("name", sorted(DECODED_WITH))
def test_the_codec_normalises_latents_as_the_pipeline_decodes_them(name):
    config, (shift, scale) = DECODED_WITH[name]
    got_shift, got_scale = architecture_named(name).record.codec.normalization(config)
    torch.testing.assert_close(torch.as_tensor(got_shift).float(), torch.full_like(torch.as_tensor(got_shift).float(), shift))
    torch.testing.assert_close(torch.as_tensor(got_scale).float(), torch.full_like(torch.as_tensor(got_scale).float(), scale))


@pytest.mark.parametrize("theirs,ours", [("kandinsky5", "kandinsky5-t2i"), ("krea2", "krea2"), ("ernie_image", "ernie-image")])
def test_diffusion_pipes_type_converts_to_the_entry(theirs, ours):
    """diffusion-pipe's [model] type (models/*.py there); the architecture itself is read from model.path's model_index.json."""
    from zeropipe.convert.diffusion_pipe import trainable_architecture

    assert trainable_architecture(theirs) == ours


def test_krea2_lora_in_krea_names_converts_back_with_diffusers_to_the_same_updates():
    """The original layout (no alpha keys: diffusers' Krea 2 converter refuses any) recovers each module's B @ A x alpha / r."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_krea2_lora_to_diffusers

    modules = [f"transformer_blocks.{block}.{name}" for block in (0, 27) for name in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0", "ff.gate", "ff.up", "ff.down")]
    generator = torch.Generator().manual_seed(0)
    rank, alpha = 4, 16.0
    layers = {}
    for module in modules:
        layers[f"{module}.lora_A.weight"] = torch.randn(rank, 24, generator=generator)
        layers[f"{module}.lora_B.weight"] = torch.randn(24, rank, generator=generator)
    original = architecture_named("krea2").layouts.original_lora_layout(layers, alpha)
    assert "diffusion_model.blocks.27.attn.wq.lora_A.weight" in original and "diffusion_model.blocks.0.mlp.down.lora_B.weight" in original
    converted = _convert_non_diffusers_krea2_lora_to_diffusers(dict(original))
    for module in modules:
        expected = layers[f"{module}.lora_B.weight"] @ layers[f"{module}.lora_A.weight"] * (alpha / rank)
        got = converted[f"transformer.{module}.lora_B.weight"] @ converted[f"transformer.{module}.lora_A.weight"]
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_captions_prediction_does_not_depend_on_the_other_captions_of_its_batch(tiny_pipelines, name):
    """Captions are cached one by one and padded per micro-batch: each row predicts as it does alone (masks, lengths, or one call per length)."""
    from zeropipe.families.diffusion.pipelines import encode_prompts, stack_padded, text_pipeline, vae_scale_factor

    arch = architecture_named(name)
    folder = tiny_pipelines(name)
    cpu = torch.device("cpu")
    encoders = text_pipeline(folder, arch, torch.float32, cpu)
    rows = [encode_prompts(encoders, arch, [prompt], cpu)[0] for prompt in (PROMPT, "a small green square on a white background, seen from above")]
    batch = {key: stack_padded([row[key] for row in rows]) for key in rows[0]}
    model = arch.model_class().from_pretrained(str(folder / arch.record.denoiser)).eval()
    context = PredictContext(cpu, torch.float32, vae_scale_factor(folder), 1.0)
    shape = (2, 16, 1, 8, 8) if arch.record.codec.vae_class == "AutoencoderKLQwenImage" else (2, 16 if arch.record.codec.vae_class == "AutoencoderKLFlux2" else 4, 8, 8)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([700.0, 300.0])
    with torch.no_grad():
        together = arch.call.predict(model, latents, timesteps, batch, context)
        for index, row in enumerate(rows):
            alone = arch.call.predict(model, latents[index : index + 1], timesteps[index : index + 1], {key: value[None] for key, value in row.items()}, context)
            torch.testing.assert_close(together[index : index + 1], alone, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: row {index} differs in a batch: {m}")
