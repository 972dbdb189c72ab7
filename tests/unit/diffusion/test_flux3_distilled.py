"""FLUX.3 [distilled]: its flow-map call held to Flux3DistilledModularPipeline's blocks on a tiny transformer, and the flow-map objective.

- the entry's call, given a jump-to timestep, is ``Flux3DistilledLoopDenoiser``'s output (its inputs made by the pipeline's own
  latents and text-ids blocks), for one window and for prompts of different windows;
- the entry's sampling (the shared sampler) ends on the latents ``Flux3DistilledDenoiseStep`` ends on, from the same noise, on
  ``Flux3SetTimestepsStep``'s timesteps (each step jumping to the next, no guidance);
- the flow-map objective's jump term is zero for an exact flow map and positive for one that does not compose (Euler's).
"""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.bases.flux3 import TARGET, Flux3DistilledCall
from zeropipe.families.diffusion.core import PredictContext
from zeropipe.families.diffusion.modular import run_block, run_loop_block
from zeropipe.families.diffusion.parts.flow_map import flow_map_loss

CPU = torch.device("cpu")
CONTEXT = PredictContext(CPU, torch.float32, 8, 1.0)
TINY = {
    "in_channels": 8, "cond_in_channels": 8, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
    "joint_attention_dim": 24, "timestep_channels": 32, "axes_dims_rope": (4, 4, 4, 4), "flow_map": True,
}


@pytest.fixture(scope="module")
def tiny():
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux3DistilledModularPipeline, Flux3Transformer2DModel

    torch.manual_seed(0)
    transformer = Flux3Transformer2DModel(**TINY).eval()
    pipeline = Flux3DistilledModularPipeline()
    pipeline.update_components(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False))
    return pipeline, transformer


def prepared(pipeline, latents, embeds):
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3DistilledTextRoPEInputsStep, Flux3PrepareLatentsStep

    height, width = (side * pipeline.vae_scale_factor * 2 for side in latents.shape[2:])
    out = run_block(pipeline, Flux3PrepareLatentsStep(), ("latents", "img_ids"), latents=latents, height=height, width=width, batch_size=1, num_images_per_prompt=1, dtype=torch.float32)
    ids = run_block(pipeline, Flux3DistilledTextRoPEInputsStep(), ("txt_ids",), prompt_embeds=embeds)
    return out["latents"], {"prompt_embeds": embeds, "txt_ids": ids["txt_ids"], "img_ids": out["img_ids"]}


def block_velocity(pipeline, latents, timesteps, step, embeds):
    """Flux3DistilledLoopDenoiser's output at ``step`` of ``timesteps`` (it jumps to the next one)."""
    from diffusers.modular_pipelines.flux3.denoise import Flux3DistilledLoopDenoiser

    packed, fields = prepared(pipeline, latents, embeds)
    state = run_loop_block(pipeline, Flux3DistilledLoopDenoiser(), step, timesteps[step], latents=packed, denoiser_input_fields=fields, timesteps=timesteps, num_inference_steps=len(timesteps))
    return state.noise_pred.transpose(1, 2).reshape(latents.shape)


def padded(prompts):
    longest = max(p.shape[1] for p in prompts)
    return {
        "prompt_embeds": torch.cat([torch.nn.functional.pad(p, [0, 0, 0, longest - p.shape[1]]) for p in prompts]),
        "prompt_embeds_mask": torch.stack([torch.arange(longest) < p.shape[1] for p in prompts]).long(),
    }


@pytest.mark.parametrize("windows", [(80, 80), (80, 160)])
def test_predict_is_the_distilled_denoiser_blocks_output(tiny, windows):
    pipeline, transformer = tiny
    torch.manual_seed(1)
    latents, timesteps = torch.randn(2, 8, 4, 6), torch.tensor([900.0, 600.0, 250.0])
    prompts = [torch.randn(1, window, TINY["joint_attention_dim"]) for window in windows]
    for step in (0, 2):  # a jump to the next timestep, and the last one's to 0
        following = timesteps[step + 1] if step + 1 < len(timesteps) else torch.tensor(0.0)
        condition = {**padded(prompts), TARGET: following.expand(2)}
        ours = Flux3DistilledCall().predict(transformer, latents, timesteps[step].expand(2), condition, CONTEXT)
        expected = torch.cat([block_velocity(pipeline, latents[i : i + 1], timesteps, step, prompts[i]) for i in range(2)])
        assert torch.allclose(ours, expected, atol=1e-5), (step, (ours - expected).abs().max())
    # The jump-to time is an input the map reads: the diagonal (no target) is another output.
    diagonal = Flux3DistilledCall().predict(transformer, latents, timesteps[0].expand(2), padded(prompts), CONTEXT)
    assert not torch.allclose(diagonal, ours, atol=1e-4)


def test_the_entrys_samples_are_the_distilled_denoise_steps(tiny):
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3SetTimestepsStep
    from diffusers.modular_pipelines.flux3.denoise import Flux3DistilledDenoiseStep

    from zeropipe.families.diffusion.entries import architecture_named

    pipeline, _ = tiny
    pipeline.zeropipe_vae_factor = 8
    arch = architecture_named("flux3-distilled")
    embeds = torch.randn(1, 80, TINY["joint_attention_dim"], generator=torch.Generator().manual_seed(2))
    condition = padded([embeds])
    steps, height, width = 3, 64, 96
    kwargs = arch.sampling.sample_kwargs(condition, condition, 1.0, 1.0)
    kwargs.update(height=height, width=width, num_inference_steps=steps, generator=torch.Generator().manual_seed(3))
    ours = arch.sampling.draw(pipeline, kwargs)

    noise = torch.randn(ours.shape, generator=torch.Generator().manual_seed(3))
    schedule = run_block(pipeline, Flux3SetTimestepsStep(num_inference_steps=steps), ("timesteps", "num_inference_steps"), num_inference_steps=steps)
    packed, fields = prepared(pipeline, noise, embeds)
    out = run_block(pipeline, Flux3DistilledDenoiseStep(), ("latents",), latents=packed, timesteps=schedule["timesteps"], num_inference_steps=schedule["num_inference_steps"],
                    groups={"denoiser_input_fields": fields})
    expected = out["latents"].transpose(1, 2).reshape(ours.shape)
    assert torch.allclose(ours, expected, atol=1e-5), (ours - expected).abs().max()


def test_the_flow_map_objective_holds_the_jumps_of_a_map_that_composes():
    """For dx/dsigma = a x the exact map is x_t (exp(a tau) - 1) / tau (tau = (s - t) / 1000): its jump term is zero; Euler's is not."""
    from types import SimpleNamespace

    a = 1.5

    def exact(latents, t, s, condition):
        tau = ((s - t) / 1000).view(-1, 1, 1, 1)
        ratio = torch.where(tau == 0, torch.full_like(tau, a), torch.expm1(a * tau) / torch.where(tau == 0, torch.ones_like(tau), tau))
        return latents * ratio

    def euler(latents, t, s, condition):
        return a * latents

    latents = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(4))
    noised = SimpleNamespace(model_input=latents, timesteps=torch.tensor([900.0, 500.0, 200.0]), target=a * latents, weights=None)
    jump_to = torch.tensor([0.0, 0.3, 0.6])
    assert flow_map_loss(exact, noised, {}, jump_to).item() < 1e-10  # the diagonal is the velocity, the jumps compose
    assert flow_map_loss(euler, noised, {}, jump_to).item() > 1e-3  # right diagonal, jumps that do not compose


def test_the_catalog_entry_is_flux3s_transformer_built_as_a_flow_map():
    """No size is published: the count is FLUX.3's catalog transformer plus the target-timestep embedder, nothing else differs."""
    import json

    from zeropipe.plan.model_spec import CATALOG_DIR, _build_component, catalog_names

    assert "flux3-distilled" in catalog_names()
    distilled, base = (json.loads((CATALOG_DIR / f"{name}.json").read_text()) for name in ("flux3-distilled", "flux3"))
    assert distilled["architecture"] == "flux3-distilled" and distilled["source"] and distilled["trained"]["config"]["flow_map"] is True
    assert {**distilled["trained"]["config"], "flow_map": False} == base["trained"]["config"] and distilled["frozen"] == base["frozen"]
    built = _build_component(distilled["trained"])
    embedder = sum(p.numel() for p in built.target_timestep_embedder.parameters())
    assert sum(p.numel() for p in built.parameters()) == sum(p.numel() for p in _build_component(base["trained"]).parameters()) + embedder == 5_548_681_984
