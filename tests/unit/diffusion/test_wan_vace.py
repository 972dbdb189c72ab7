"""Wan VACE's pieces held to diffusers' own Wan 2.2 VACE blocks (``Wan22VaceBlocks``) on a tiny transformer and VAE:
the control branch's input built from a control video, its mask and a reference image is ``WanVaceEncoderStep``'s, and the
entry's call is ``Wan22LoopDenoiser``'s (``transformer_cls=WanVACETransformer3DModel``) denoiser output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zeropipe.families.diffusion.bases.wan import ARCHITECTURE as WAN
from zeropipe.families.diffusion.bases.wan_vace import WanVaceCall
from zeropipe.families.diffusion.core import Architecture
from zeropipe.families.diffusion.modular import run_block, run_loop_block
from zeropipe.families.diffusion.parts.vace_context import control_hidden_states
from zeropipe.families.diffusion.roles import PredictContext

CPU = torch.device("cpu")
TINY = {**WAN.record.preset["transformer"], "vace_layers": [0, 1], "vace_in_channels": 96}


@pytest.fixture(scope="module")
def tiny():
    from diffusers import AutoencoderKLWan, ClassifierFreeGuidance, Wan22VaceModularPipeline, WanVACETransformer3DModel

    torch.manual_seed(0)
    vae_fields = dict(WAN.record.preset["vae"])
    vae_fields.update(latents_mean=[0.1 * i for i in range(16)], latents_std=[0.5 + 0.1 * i for i in range(16)])  # not the identity
    vae = AutoencoderKLWan(**{key: value for key, value in vae_fields.items() if key not in ("scale_factor_spatial", "scale_factor_temporal")}).eval()
    transformer = WanVACETransformer3DModel(**TINY).eval()
    pipeline = Wan22VaceModularPipeline()
    pipeline.update_components(
        vae=vae, transformer=transformer, transformer_2=transformer,
        guider=ClassifierFreeGuidance(guidance_scale=4.0, enabled=False), guider_2=ClassifierFreeGuidance(guidance_scale=3.0, enabled=False),
    )
    return pipeline, vae, transformer


def _inputs():
    """A 5-frame 32x32 control video (frames as PIL images), a mask keeping its left half, a 24x16 reference image."""
    from PIL import Image

    rng = np.random.default_rng(0)
    video = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(5)]
    mask_pixels = np.zeros((32, 32, 3), dtype=np.uint8)
    mask_pixels[:, 16:] = 255  # white: generate; black: keep
    mask = [Image.fromarray(mask_pixels) for _ in range(5)]
    reference = Image.fromarray(rng.integers(0, 256, (24, 16, 3), dtype=np.uint8))
    return video, mask, reference


def test_the_control_input_is_the_vace_encoder_blocks(tiny):
    from diffusers.modular_pipelines.wan.encoders import WanVaceEncoderStep

    pipeline, vae, _ = tiny
    video, mask, reference = _inputs()
    expected = run_block(
        pipeline, WanVaceEncoderStep(), ("control_hidden_states", "num_reference_images"),
        video=video, mask=mask, reference_images=[reference], height=32, width=32, num_frames=5,
    )
    # The same pixels as the block preprocesses them: the clip in [-1, 1], the mask in [0, 1], the reference letterboxed on white.
    pixels, masks, references = WanVaceEncoderStep.preprocess_conditions(pipeline, video, mask, [reference], 32, 32, 5, torch.float32, CPU)
    ours = control_hidden_states(vae, pixels, masks, references[0])
    assert expected["num_reference_images"] == 1
    assert ours.shape == expected["control_hidden_states"].shape == (1, 96, 1 + 2, 4, 4)
    assert torch.allclose(ours, expected["control_hidden_states"], atol=1e-5), (ours - expected["control_hidden_states"]).abs().max()
    # What is kept and what is reworked differ: the mask reached the VAE's two inputs.
    assert not torch.allclose(ours[:, :16, 1:], ours[:, 16:32, 1:])


@pytest.mark.parametrize("t", [900.0, 300.0])
def test_predict_is_the_wan22_vace_denoiser_blocks_output(tiny, t):
    from diffusers import WanVACETransformer3DModel
    from diffusers.modular_pipelines.wan.denoise import Wan22LoopDenoiser
    from diffusers.modular_pipelines.wan.encoders import WanVaceEncoderStep

    pipeline, _, transformer = tiny
    video, mask, reference = _inputs()
    control = run_block(pipeline, WanVaceEncoderStep(), ("control_hidden_states", "control_hidden_states_scale"), video=video, mask=mask, reference_images=[reference], height=32, width=32, num_frames=5)
    torch.manual_seed(1)
    latents, embeds = torch.randn(1, 16, 3, 4, 4), torch.randn(1, 8, TINY["text_dim"])
    timestep = torch.tensor(t)
    block = Wan22LoopDenoiser(transformer_cls=WanVACETransformer3DModel)
    state = run_loop_block(
        pipeline, block, 0, timestep, latent_model_input=latents, dtype=torch.float32, num_inference_steps=1, attention_kwargs=None,
        prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), denoiser_input_fields=dict(control),
    )
    entry = Architecture(record=WAN.record, call=WanVaceCall())
    condition = {"prompt_embeds": embeds, "vace_context": control["control_hidden_states"], "vace_scale": control["control_hidden_states_scale"]}
    ours = entry.call.predict(transformer, latents, timestep.expand(1), condition, PredictContext(CPU, torch.float32, 8, 1.0))
    assert torch.allclose(ours, state.noise_pred, atol=1e-6), (ours - state.noise_pred).abs().max()
    # Without the scale the transformer takes 1 per control layer, as conditioning_scale=1.0 does; the control input matters.
    unscaled = entry.call.predict(transformer, latents, timestep.expand(1), {**condition, "vace_scale": None}, PredictContext(CPU, torch.float32, 8, 1.0))
    assert torch.equal(unscaled, ours)
    blank = entry.call.predict(transformer, latents, timestep.expand(1), {**condition, "vace_context": torch.zeros_like(condition["vace_context"])}, PredictContext(CPU, torch.float32, 8, 1.0))
    assert not torch.allclose(blank, ours)


def test_the_catalog_counts_wan22_vace_fun_from_its_published_configs():
    """17.34B per expert: the 34.7 GB of bf16 weights in linoyts/Wan2.2-VACE-Fun-14B-diffusers' transformer/ (Wan 2.2 A14B's 14.29B
    expert and 8 control blocks); UMT5-XXL and the Wan VAE frozen; the trace (stored) at 81 frames of 640 px through the control branch."""
    import zeropipe.families.diffusion  # noqa: F401 - registers the diffusion family's spec builders with the planner
    from zeropipe.plan.model_spec import catalog_names, spec_from_catalog

    assert "wan2.2-vace-fun-a14b" in catalog_names()
    spec = spec_from_catalog("wan2.2-vace-fun-a14b", None)
    assert spec.total_params == pytest.approx(17.34e9, rel=0.005) and spec.family == "diffusion_transformer"
    frozen = {model.name.split(" ")[0]: model.params for model in spec.frozen_models}
    assert frozen["text_encoder"] == pytest.approx(5.68e9, rel=0.01) and frozen["vae"] == pytest.approx(126.9e6, rel=0.01)
    trace = spec.activation_trace
    assert trace is not None and trace.frames == 81 and trace.resolution == 640
