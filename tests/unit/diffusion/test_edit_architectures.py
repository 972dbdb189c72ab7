"""The edit entries (Qwen-Image-Edit, Flux Kontext) call their transformer as their pipelines do: the control image's tokens appended, only the target's predicted."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from zeropipe.families.diffusion.entries import PredictContext
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, vae_scale_factor

SIZE = 32


def control_image(colour=(200, 40, 40)) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), (20, 20, 120))
    ImageDraw.Draw(image).ellipse((6, 6, 26, 26), fill=colour)
    return image


def pipeline_call(pipeline, arch, latents, control_latents, timestep, condition):
    """One denoising step's transformer output as the pipeline's own __call__ computes it (its lines for this architecture)."""
    t = timestep.expand(1)
    if arch.record.name == "qwen-image-edit":
        grid = (1, latents.shape[-2] // 2, latents.shape[-1] // 2)
        packed, control = (pipeline._pack_latents(x, 1, x.shape[1], x.shape[-2], x.shape[-1]) for x in (latents, control_latents))
        out = pipeline.transformer(
            hidden_states=torch.cat([packed, control], dim=1), timestep=t / 1000, guidance=None, encoder_hidden_states_mask=condition["prompt_embeds_mask"],
            encoder_hidden_states=condition["prompt_embeds"], img_shapes=[[grid, grid]], return_dict=False,
        )[0]
    else:
        packed, control = (pipeline._pack_latents(x, 1, x.shape[1], x.shape[-2], x.shape[-1]) for x in (latents, control_latents))
        latent_ids = pipeline._prepare_latent_image_ids(1, latents.shape[-2] // 2, latents.shape[-1] // 2, latents.device, latents.dtype)
        image_ids = latent_ids.clone()
        image_ids[..., 0] = 1
        out = pipeline.transformer(
            hidden_states=torch.cat([packed, control], dim=1), timestep=t / 1000, guidance=None, pooled_projections=condition["pooled_prompt_embeds"],
            encoder_hidden_states=condition["prompt_embeds"], txt_ids=torch.zeros(condition["prompt_embeds"].shape[1], 3), img_ids=torch.cat([latent_ids, image_ids]),
            return_dict=False,
        )[0]
    return pipeline._unpack_latents(out[:, : packed.shape[1]], SIZE, SIZE, pipeline.vae_scale_factor)


@pytest.mark.parametrize("preset", ["tiny-qwen-image-edit", "tiny-flux-kontext"])
def test_an_edit_entrys_prediction_is_the_pipelines_and_depends_on_the_control_image(tmp_path, preset):
    arch = build_tiny_pipeline({"pipeline": preset}, tmp_path / "pipeline", seed=1)
    kwargs = {"processor": None} if arch.record.text.processors else {}
    pipeline = arch.pipeline().from_pretrained(str(tmp_path / "pipeline"), **kwargs)
    pipeline.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    if arch.record.name == "qwen-image-edit":
        condition = {"prompt_embeds": torch.randn(1, 7, 32, generator=generator), "prompt_embeds_mask": torch.ones(1, 7, dtype=torch.long)}
    else:
        condition = {"prompt_embeds": torch.randn(1, 9, 64, generator=generator), "pooled_prompt_embeds": torch.randn(1, 32, generator=generator)}
    # The pipeline's own encoding of the control image (prepare_latents: VAE mode, normalised, packed), unpacked to the grid predict takes.
    pixels = pipeline.image_processor.preprocess(control_image(), SIZE, SIZE)
    pixels = arch.record.codec.vae_pixels(pixels)
    channels = pipeline.transformer.config.in_channels // 4
    _, packed_control, *_ = pipeline.prepare_latents(pixels, 1, channels, SIZE, SIZE, torch.float32, torch.device("cpu"), generator)
    control = arch.record.codec.vae_pixels(pipeline._unpack_latents(packed_control, SIZE, SIZE, pipeline.vae_scale_factor))
    latents = torch.randn(control.shape, generator=generator)
    timestep = torch.tensor([600.0])
    context = PredictContext(torch.device("cpu"), torch.float32, vae_scale_factor(tmp_path / "pipeline"), 1.0)
    with torch.no_grad():
        mine = arch.call.predict(pipeline.transformer, latents, timestep, {**condition, "control_latents": control}, context)
        reference = pipeline_call(pipeline, arch, latents, control, timestep, condition)
        other = arch.call.predict(pipeline.transformer, latents, timestep, {**condition, "control_latents": torch.randn(control.shape, generator=generator)}, context)
    assert mine.shape == latents.shape
    torch.testing.assert_close(mine, reference.reshape(mine.shape), rtol=1e-5, atol=1e-6)
    assert (other - mine).abs().max() > 1e-3


def test_qwen_image_edit_samples_as_its_pipeline_draws_where_the_control_image_is_the_pipelines_size(tmp_path):
    """The entry runs QwenImageEditPipeline's loop itself (the pipeline would resize the control image to about a megapixel):
    at 1024 px, where the two agree on the control image's size, the latents are the pipeline's own, true CFG included."""
    # A VAE of four halvings keeps 1024 px at 32x32 tokens (the tiny preset's two would make 16k).
    vae = {"base_dim": 8, "dim_mult": [1, 1, 1, 1, 1], "temperal_downsample": [False, True, True, True]}
    arch = build_tiny_pipeline({"pipeline": "tiny-qwen-image-edit", "vae": vae}, tmp_path / "pipeline", seed=2)
    pipeline = arch.pipeline().from_pretrained(str(tmp_path / "pipeline"), processor=None)
    pipeline.set_progress_bar_config(disable=True)
    image = control_image().resize((1024, 1024))
    generator = torch.Generator().manual_seed(0)
    condition = {"prompt_embeds": torch.randn(1, 9, 32, generator=generator), "prompt_embeds_mask": torch.ones(1, 9, dtype=torch.long)}
    negative = {"prompt_embeds": torch.randn(1, 9, 32, generator=generator), "prompt_embeds_mask": torch.ones(1, 9, dtype=torch.long)}
    kwargs = {"height": 1024, "width": 1024, "num_inference_steps": 2, "output_type": "latent", "return_dict": False, **arch.sampling.sample_kwargs(condition, negative, 3.0, 1.0)}
    with torch.no_grad():
        mine = arch.sampling.draw(pipeline, {**kwargs, "generator": torch.Generator().manual_seed(5), "image": image})
        reference = pipeline(image=image, **kwargs, generator=torch.Generator().manual_seed(5))[0]
    assert mine.shape == (1, 32 * 32, 64)
    torch.testing.assert_close(mine, reference)
