"""Cosmos-Predict2 text-to-image: ``predict`` is the pipeline's own transformer call, ZeRO-Pipe's sampling loop is the pipeline's
``__call__``, and the guardrail NVIDIA's licence requires is left where it is: in every pipeline a user loads.

``Cosmos2TextToImagePipeline`` runs only with a safety checker (``cosmos_guardrail``, which downloads its
models). To run the pipeline's own ``__call__`` as the reference, these tests give it a checker that lets
everything through, as diffusers' own fast tests of this pipeline do (their ``DummyCosmosSafetyChecker``);
it lives in this test file only.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_of
from zeropipe.families.diffusion.bases.cosmos_predict2 import GuardrailRequired, draw_latents
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, stack_padded, text_pipeline, vae_scale_factor

CPU = torch.device("cpu")
PROMPT = "a red circle on a blue square"
SIZE = 32


class PassingChecker:
    """A stand-in for NVIDIA's checker that passes every prompt and frame (diffusers' tests' DummyCosmosSafetyChecker): test-only."""

    def to(self, *args, **kwargs):
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, frames: np.ndarray) -> np.ndarray:
        return frames


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cosmos") / "pipeline"
    arch = build_tiny_pipeline({"pipeline": "tiny-cosmos-predict2"}, folder, seed=1)
    pipeline = arch.pipeline().from_pretrained(str(folder), safety_checker=PassingChecker())
    pipeline.set_progress_bar_config(disable=True)
    return arch, folder, pipeline


@pytest.fixture(scope="module")
def encoder(tiny):
    arch, folder, _ = tiny
    return text_pipeline(folder, arch, torch.float32, CPU)  # ZeRO-Pipe's own text pipeline, as the node's cache filling builds it


def cached_condition(arch, encoder, prompts):
    """The prompts' conditioning as the text cache holds it, stacked as a micro-batch."""
    rows = encode_prompts(encoder, arch, prompts, CPU)
    return {key: stack_padded([row[key] for row in rows]) for key in rows[0]}


def test_predict_is_the_pipelines_transformer_call_on_its_own_prompt_preparation(tiny, encoder):
    arch, folder, pipeline = tiny
    assert architecture_of(folder) is arch and arch.record.name == "cosmos-predict2"
    calls = []
    forward = pipeline.transformer.forward

    def record(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(({key: value.clone() if torch.is_tensor(value) else value for key, value in kwargs.items()}, out[0].clone()))
        return out

    pipeline.transformer.forward = record
    try:
        pipeline(prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=3, guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="latent")
    finally:
        del pipeline.transformer.forward
    inputs, expected = calls[1]  # a middle step: neither the first nor the last noise level
    # The flow objective's timesteps are noise levels times 1000; the pipeline tells the transformer t = sigma / (sigma + 1) in 0..1.
    timesteps = inputs["timestep"].float() * 1000
    context = PredictContext(CPU, torch.float32, vae_scale_factor(folder), 1.0)
    with torch.no_grad():
        out = arch.call.predict(pipeline.transformer, inputs["hidden_states"], timesteps, cached_condition(arch, encoder, [PROMPT]), context)
    assert 0.05 < float(inputs["timestep"][0]) < 0.95 and expected.abs().mean() > 1e-3  # a zero output would match any call
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_the_sampling_loop_draws_what_the_pipelines_own_call_draws(tiny, encoder):
    arch, _, pipeline = tiny
    condition = cached_condition(arch, encoder, [PROMPT, "a green square"])
    negative = cached_condition(arch, encoder, ["", ""])
    kwargs = {
        "height": SIZE, "width": SIZE, "num_inference_steps": 2, "output_type": "latent", "return_dict": False,
        **arch.sampling.sample_kwargs(condition, negative, 3.0, 1.0),
    }
    theirs = pipeline(**kwargs, generator=torch.Generator().manual_seed(7))[0]
    ours = draw_latents(pipeline, **kwargs, generator=torch.Generator().manual_seed(7))
    assert ours.shape == (2, 16, 1, SIZE // 8, SIZE // 8) and theirs.abs().mean() > 1e-3
    torch.testing.assert_close(ours[:, :, 0], theirs, rtol=1e-5, atol=1e-6)


def test_zeropipes_pipelines_refuse_to_generate_and_what_a_user_loads_keeps_nvidias_guardrail(tiny, encoder):
    arch, folder, _ = tiny
    # The folder (and so every export of it) saves no checker: model_index.json says [null, null], as NVIDIA's published folders do.
    assert json.loads((folder / "model_index.json").read_text())["safety_checker"] == [None, None]
    # The pipelines ZeRO-Pipe assembles (prompt encoding, sampling) hold no guardrail and refuse to generate, naming the fix.
    with pytest.raises(GuardrailRequired, match=r"without NVIDIA's guardrail.*Cosmos2TextToImagePipeline.from_pretrained"):
        encoder(prompt=PROMPT, height=SIZE, width=SIZE, num_inference_steps=1)
    # Loaded as a user loads it, the pipeline builds NVIDIA's checker: here, without the package, diffusers' own error says to install it.
    if importlib.util.find_spec("cosmos_guardrail") is None:
        with pytest.raises(ImportError, match="cosmos_guardrail"):
            arch.pipeline().from_pretrained(str(folder))
        # The UI's Draw page loads an export so too, and says why it cannot, with the fix diffusers names.
        from zeropipe.errors import ZeroPipeError
        from zeropipe.export.generate import ModelSource
        from zeropipe.families.diffusion.draw import EXPORT_INFO, load_for_drawing

        (folder / EXPORT_INFO).write_text(json.dumps({"architecture": arch.record.name, "kind": "full"}))
        with pytest.raises(ZeroPipeError, match=r"cannot be built here: `cosmos_guardrail` is not installed.*pip install cosmos_guardrail"):
            load_for_drawing(ModelSource("hf", folder, "diffusion"), CPU, torch.float32)


def test_the_original_lora_layout_is_nvidias_module_names_that_diffusers_converter_maps_back(tiny):
    arch, _, pipeline = tiny
    from peft import LoraConfig, get_peft_model_state_dict

    from zeropipe.models.common import resolve_lora_targets  # noqa: F401  (the export adapts these same targets)

    transformer = arch.model_class().from_config(pipeline.transformer.config)
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=8, target_modules=list(arch.record.lora_targets)))
    layers = get_peft_model_state_dict(transformer)
    original = arch.layouts.original_lora_layout(layers, 8.0)
    assert "diffusion_model.blocks.1.cross_attn.q_proj.lora_A.weight" in original
    assert "diffusion_model.blocks.0.self_attn.output_proj.lora_B.weight" in original
    assert "diffusion_model.blocks.1.mlp.layer2.alpha" in original and float(original["diffusion_model.blocks.1.mlp.layer2.alpha"]) == 8.0
    # Every adapted layer of both blocks, and nothing else: 8 attention projections and 2 MLP layers each, A, B and alpha.
    assert len(layers) == 2 * 10 * 2 and len(original) == 2 * 10 * 3
    with pytest.raises(ValueError, match="no name in Cosmos-Predict2's original layout"):
        arch.layouts.original_lora_layout({"time_embed.t_embedder.linear_1.lora_A.weight": torch.ones(1)}, 8.0)


def test_a_transformer_that_needs_torchvision_is_refused_before_anything_starts_where_it_is_missing(tiny, tmp_path):
    """The published checkpoints concatenate a padding-mask channel, which diffusers resizes with torchvision."""
    from zeropipe.config.load import validate_config
    from zeropipe.families.diffusion.parts import part_problems

    arch, folder, _ = tiny
    missing = importlib.util.find_spec("torchvision") is None

    def problems(model: dict) -> list:
        return part_problems(validate_config({"model": model, "data": {"path": str(tmp_path)}}), arch)

    assert problems({"path": str(folder)}) == []  # the tiny preset's transformer pads nothing
    padded = problems({"config": {"pipeline": "tiny-cosmos-predict2", "transformer": {"concat_padding_mask": True}}})
    assert bool(padded) == missing
    if missing:
        assert padded[0][0] == "model.path" and "pip install torchvision" in padded[0][1]


def test_a_single_file_in_nvidias_layout_is_read_over_the_folder_by_diffusers_converter(tiny, tmp_path):
    """model.diffusion.denoiser_file: NVIDIA's checkpoint names (``net.blocks.0.self_attn.q_proj.weight``, as model.pt holds them) rename onto the transformer."""
    from safetensors.torch import save_file

    from zeropipe.families.diffusion.pipelines import single_file_renamer

    arch, _, pipeline = tiny
    ours = {key: value.contiguous() for key, value in pipeline.transformer.state_dict().items()}
    to_original = {"transformer_blocks.": "blocks.", "attn1.": "self_attn.", "attn2.": "cross_attn.", "to_q.": "q_proj.", "to_k.": "k_proj.", "to_v.": "v_proj.",
                   "to_out.0.": "output_proj.", "norm_q.": "q_norm.", "norm_k.": "k_norm.", "ff.net.0.proj.": "mlp.layer1.", "ff.net.2.": "mlp.layer2.",
                   "norm1.linear_": "adaln_modulation_self_attn.", "norm2.linear_": "adaln_modulation_cross_attn.", "norm3.linear_": "adaln_modulation_mlp.",
                   "time_embed.t_embedder.": "t_embedder.1.", "time_embed.norm.": "t_embedding_norm.", "patch_embed.proj.": "x_embedder.proj.1.",
                   "norm_out.linear_": "final_layer.adaln_modulation.", "proj_out.": "final_layer.linear."}

    def original(key: str) -> str:
        for diffusers_name, nvidia_name in to_original.items():
            key = key.replace(diffusers_name, nvidia_name)
        return "net." + key

    save_file({original(key): value for key, value in ours.items()}, str(tmp_path / "model.safetensors"))
    rename = single_file_renamer(arch.record.denoiser_class, tmp_path / "model.safetensors")
    assert sorted(rename(original(key)) for key in ours) == sorted(ours)


# ---------------------------------------------------------------------------------------------------- Video2World
@pytest.fixture(scope="module")
def tiny_v2w(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cosmos-v2w") / "pipeline"
    arch = build_tiny_pipeline({"pipeline": "tiny-cosmos-predict2-video2world"}, folder, seed=2)
    pipeline = arch.pipeline().from_pretrained(str(folder), safety_checker=PassingChecker())
    pipeline.set_progress_bar_config(disable=True)
    return arch, folder, pipeline, text_pipeline(folder, arch, torch.float32, CPU)


def first_frame():
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (30, 60, 200))
    ImageDraw.Draw(image).ellipse((6, 6, 24, 24), fill=(220, 30, 30))
    return image


def test_video2world_predict_is_the_pipelines_call_with_the_given_frame_clean_and_its_own_timestep(tiny_v2w):
    arch, folder, pipeline, encoder = tiny_v2w
    assert architecture_of(folder) is arch and arch.record.name == "cosmos-predict2-video2world"
    calls = []
    forward = pipeline.transformer.forward

    def record(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(({key: value.clone() if torch.is_tensor(value) else value for key, value in kwargs.items()}, out[0].clone()))
        return out

    pipeline.transformer.forward = record
    try:
        pipeline(image=first_frame(), prompt=PROMPT, height=SIZE, width=SIZE, num_frames=9, num_inference_steps=3, guidance_scale=1.0,
                 generator=torch.Generator().manual_seed(0), output_type="latent")
    finally:
        del pipeline.transformer.forward
    inputs, expected = calls[1]
    hidden = inputs["hidden_states"]
    assert hidden.shape[2] == 3 and float(inputs["timestep"][0, 0, 0]) < 1e-3 < float(inputs["timestep"][0, 0, 1])  # the given frame at its own level
    # What training gives predict: the clip's noised latents (the first frame's slot is replaced) and the first frame's latents, cached.
    noised = torch.cat([torch.randn_like(hidden[:, :, :1]), hidden[:, :, 1:]], dim=2)
    condition = {**cached_condition(arch, encoder, [PROMPT]), "first_frame_latents": hidden[:, :, :1]}
    timesteps = inputs["timestep"][:, 0, 1, 0, 0].float() * 1000
    context = PredictContext(CPU, torch.float32, vae_scale_factor(folder), 1.0)
    with torch.no_grad():
        out = arch.call.predict(pipeline.transformer, noised, timesteps, condition, context)
    assert expected.abs().mean() > 1e-3
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    prediction, target = arch.call.loss_region(out, torch.zeros_like(out))
    assert prediction.shape[2] == target.shape[2] == 2  # the given frame is never denoised: not in the loss


def test_video2world_sampling_loop_draws_what_the_pipelines_own_call_draws(tiny_v2w):
    from zeropipe.families.diffusion.entries.cosmos_predict2_video2world import draw_video_latents

    arch, _, pipeline, encoder = tiny_v2w
    kwargs = {
        "image": first_frame(), "height": SIZE, "width": SIZE, "num_frames": 5, "num_inference_steps": 2, "output_type": "latent", "return_dict": False,
        **arch.sampling.sample_kwargs(cached_condition(arch, encoder, [PROMPT]), cached_condition(arch, encoder, [""]), 3.0, 1.0),
    }
    theirs = pipeline(**kwargs, generator=torch.Generator().manual_seed(7))[0]
    ours = draw_video_latents(pipeline, **kwargs, generator=torch.Generator().manual_seed(7))
    assert ours.shape == (1, 16, 2, SIZE // 8, SIZE // 8) and theirs.abs().mean() > 1e-3
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    with pytest.raises(GuardrailRequired):
        text_pipeline(tiny_v2w[1], arch, torch.float32, CPU)(image=first_frame(), prompt=PROMPT, height=SIZE, width=SIZE, num_frames=5)
