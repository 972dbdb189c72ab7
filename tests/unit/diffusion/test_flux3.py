"""FLUX.3's denoiser call held to Flux3ModularPipeline's own denoiser block (``Flux3LoopDenoiser``) on a tiny transformer.

The block is given what the pipeline's earlier blocks give it (packed image tokens, ``img_ids`` from
``Flux3PrepareLatentsStep``, the prompt window and ``txt_ids`` from ``Flux3TextRoPEInputsStep``), classifier-free
guidance off (one transformer call); the entry's call, given the latents and the cached (padded, masked) prompts,
must return the same velocity, for a batch of one window and for prompts of different windows.
"""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.core import PredictContext
from zeropipe.families.diffusion.bases.flux3 import Flux3Call
from zeropipe.families.diffusion.modular import run_block, run_loop_block

CPU = torch.device("cpu")
TINY = {
    "in_channels": 8, "cond_in_channels": 8, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
    "joint_attention_dim": 24, "timestep_channels": 32, "axes_dims_rope": (4, 4, 4, 4),
}


@pytest.fixture(scope="module")
def tiny():
    from diffusers import ClassifierFreeGuidance, Flux3ModularPipeline, Flux3Transformer2DModel

    torch.manual_seed(0)
    transformer = Flux3Transformer2DModel(**TINY).eval()
    pipeline = Flux3ModularPipeline()
    pipeline.update_components(transformer=transformer, guider=ClassifierFreeGuidance(guidance_scale=3.5, enabled=False))
    return pipeline, transformer


def block_velocity(pipeline, latents, t, embeds):
    """The denoiser block's velocity, its inputs made by the pipeline's own latents and text-ids blocks."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3PrepareLatentsStep, Flux3TextRoPEInputsStep
    from diffusers.modular_pipelines.flux3.denoise import Flux3LoopDenoiser

    height, width = (side * pipeline.vae_scale_factor * 2 for side in latents.shape[2:])
    prepared = run_block(pipeline, Flux3PrepareLatentsStep(), ("latents", "img_ids"), latents=latents, height=height, width=width, batch_size=1, num_images_per_prompt=1, dtype=torch.float32)
    ids = run_block(pipeline, Flux3TextRoPEInputsStep(), ("txt_ids",), prompt_embeds=embeds)
    fields = {"prompt_embeds": embeds, "txt_ids": ids["txt_ids"], "img_ids": prepared["img_ids"]}
    state = run_loop_block(pipeline, Flux3LoopDenoiser(), 0, t, latents=prepared["latents"], denoiser_input_fields=fields, num_inference_steps=1)
    return state.noise_pred.transpose(1, 2).reshape(latents.shape)


@pytest.mark.parametrize("windows", [(80, 80), (80, 160)])
def test_predict_is_the_denoiser_blocks_output(tiny, windows):
    pipeline, transformer = tiny
    torch.manual_seed(1)
    latents, t = torch.randn(2, 8, 4, 6), torch.tensor(700.0)
    prompts = [torch.randn(1, window, TINY["joint_attention_dim"]) for window in windows]
    longest = max(windows)
    condition = {
        "prompt_embeds": torch.cat([torch.nn.functional.pad(p, [0, 0, 0, longest - p.shape[1]]) for p in prompts]),
        "prompt_embeds_mask": torch.stack([torch.arange(longest) < window for window in windows]).long(),
    }
    ours = Flux3Call().predict(transformer, latents, t.expand(2), condition, PredictContext(CPU, torch.float32, 8, 1.0))
    expected = torch.cat([block_velocity(pipeline, latents[i : i + 1], t, prompts[i]) for i in range(2)])
    assert torch.allclose(ours, expected, atol=1e-5), (ours - expected).abs().max()
