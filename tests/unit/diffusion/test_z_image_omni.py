"""Z-Image Omni (``z-image-omni``): its ``predict`` is ``ZImageOmniPipeline``'s own denoiser step, text-to-image.

The pipeline is run as a user runs it (a prompt string, guidance off: one transformer call per step); the velocity
it hands its scheduler at the first step and the latents that step starts from are recorded. The entry, given those
latents and that timestep, and the prompt's conditioning as its text part caches it, must return the same velocity
(the omni path's nested lists, the reversed time and the sign in one comparison). A caption's prediction does not
depend on the padding its micro-batch adds.
"""

from __future__ import annotations

import pytest
import torch

from zeropipe.families.diffusion.entries import PredictContext, architecture_of
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, encode_prompts, stack_padded, text_pipeline, vae_scale_factor

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("omni") / "pipeline"
    arch = build_tiny_pipeline({"pipeline": "tiny-z-image-omni"}, folder, seed=1)
    return arch, folder


def test_predict_is_the_omni_pipelines_denoiser_step_and_ignores_its_batchs_padding(tiny):
    arch, folder = tiny
    assert architecture_of(folder) is arch and arch.record.name == "z-image-omni"
    pipeline = arch.pipeline().from_pretrained(str(folder))
    pipeline.set_progress_bar_config(disable=True)
    assert pipeline.transformer.config.siglip_feat_dim  # the omni transformer: its SigLIP embedder is built
    seen = []
    step = pipeline.scheduler.step

    def record(model_output, timestep, sample, *args, **kwargs):
        if not seen:
            seen.append((model_output.clone(), sample.clone(), torch.as_tensor(timestep).clone()))
        return step(model_output, timestep, sample, *args, **kwargs)

    pipeline.scheduler.step = record
    prompt = "a red circle on a blue square"
    pipeline(prompt=prompt, height=64, width=64, num_inference_steps=2, guidance_scale=0.0, generator=torch.Generator().manual_seed(0), output_type="latent")
    velocity, latents, timestep = seen[0]

    factor = vae_scale_factor(folder)
    encoders = text_pipeline(folder, arch, torch.float32, CPU)
    rows = encode_prompts(encoders, arch, [prompt, "a small green square on a white background, seen from above"], CPU)
    context = PredictContext(CPU, torch.float32, factor, 1.0)
    alone = {key: value[None] for key, value in rows[0].items()}
    batch = {key: stack_padded([row[key] for row in rows]) for key in rows[0]}
    with torch.no_grad():
        out = arch.call.predict(pipeline.transformer, latents, timestep.reshape(1).float(), alone, context)
        both = arch.call.predict(pipeline.transformer, latents.repeat(2, 1, 1, 1), timestep.reshape(1).float().repeat(2), batch, context)
    assert out.shape == latents.shape and velocity.abs().mean() > 1e-3
    torch.testing.assert_close(out, velocity.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(both[:1], out, rtol=1e-4, atol=1e-5)
    assert (both[0] - both[1]).abs().max() > 1e-6  # the caption reaches the denoiser
