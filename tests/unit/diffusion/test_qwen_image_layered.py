"""Qwen-Image-Layered (``qwen-image-layered``): the entry's denoiser call and samples are its pipeline's own, on a tiny preset.

``QwenImageLayeredPipeline`` (diffusers 0.42) is the reference: its ``__call__`` denoises the image's stack (the image
and its layers) with the image's latents appended, and the entry's sampling loop must give the same latents; the
entry's ``predict`` must be the transformer call that loop makes; the image layers part must encode an image and its
RGBA layers as the pipeline encodes its image (VAE mode, normalised) and keep the layers' alpha.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import pytest
import torch
from PIL import Image, ImageDraw

from zeropipe.families.diffusion.entries import PredictContext, architecture_named
from zeropipe.families.diffusion.parts import Encoding, Inputs
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, latent_scaling, normalize_latents

SIZE = 32


def composite(size: int = SIZE) -> Image.Image:
    image = Image.new("RGBA", (size, size), (230, 230, 240, 255))
    ImageDraw.Draw(image).ellipse((size // 4, size // 4, 3 * size // 4, 3 * size // 4), fill=(200, 30, 30, 255))
    return image


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipelines") / "tiny-qwen-image-layered"
    arch = build_tiny_pipeline({"pipeline": "tiny-qwen-image-layered"}, folder, seed=1)
    pipeline = arch.pipeline().from_pretrained(str(folder), **arch.record.pipeline_kwargs)
    pipeline.set_progress_bar_config(disable=True)
    return arch, folder, pipeline


def test_samples_are_the_pipelines_own_decomposition_and_predict_is_its_transformer_call(tiny, monkeypatch, tmp_path):
    """The entry's sampling loop gives the latents QwenImageLayeredPipeline's call ends with (two layers, true CFG), where the call
    takes the image at the sample size: its calculate_dimensions (640 or 1024 px whatever the size) is set to the sample size here."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered

    arch, _, pipeline = tiny
    monkeypatch.setattr(pipeline_qwenimage_layered, "calculate_dimensions", lambda area, ratio: (SIZE, SIZE))
    cpu = torch.device("cpu")
    with torch.no_grad():
        condition, negative = (arch.prompts.encode_prompts(pipeline, [text], cpu) for text in ("split the red circle from the background", " "))
    kwargs = {"height": SIZE, "width": SIZE, "num_inference_steps": 2, "output_type": "latent", "return_dict": False, **arch.sampling.sample_kwargs(condition, negative, 3.0, 1.0)}
    ours, outputs = arch.sampling.sample_outputs(pipeline, {**kwargs, "generator": torch.Generator().manual_seed(5), "image": composite(), "layers": 2})

    ends: list[torch.Tensor] = []
    pipeline(
        image=composite(), prompt="x", prompt_embeds=condition["prompt_embeds"], prompt_embeds_mask=condition["prompt_embeds_mask"],
        negative_prompt_embeds=negative["prompt_embeds"], negative_prompt_embeds_mask=negative["prompt_embeds_mask"], true_cfg_scale=3.0,
        layers=2, resolution=640, num_inference_steps=2, generator=torch.Generator().manual_seed(5), output_type="pt",
        callback_on_step_end=lambda pipe, step, t, tensors: ends.append(tensors["latents"]) or {}, callback_on_step_end_tensor_inputs=["latents"],
    )
    theirs = pipeline._unpack_latents(ends[-1], SIZE, SIZE, 2, pipeline.vae_scale_factor)  # (1, C, 3, h, w): the image, then two layers
    latent = SIZE // pipeline.vae_scale_factor
    assert ours.shape == (1, 16, 1, latent, latent) and outputs["layer_latents"].shape == (1, 16, 2, latent, latent)
    torch.testing.assert_close(ours, theirs[:, :, :1])
    config = pipeline.vae.config
    mean, std = (torch.tensor(values).view(1, -1, 1, 1, 1) for values in (config.latents_mean, config.latents_std))
    torch.testing.assert_close(outputs["layer_latents"], theirs[:, :, 1:] * std + mean)

    # The drawn layers written beside the sample as RGBA PNGs: the pipeline's own decoding of its last two frames, alpha kept.
    from zeropipe.families.diffusion.parts import Sampling

    folder = tmp_path / "samples" / "step_00000002"
    folder.mkdir(parents=True)
    rows = [{"file": "step_00000002/00.png"}]
    (part,) = arch.record.conditions
    part.add_to_samples(Sampling(["p"], SIZE, (SIZE, SIZE), None, None, cpu, None, lambda: pipeline.vae), outputs, rows, folder)
    assert rows[0]["layers"] == ["step_00000002/00_layer0.png", "step_00000002/00_layer1.png"]
    with torch.no_grad():
        decoded = pipeline.vae.decode((theirs[:, :, 1:] * std + mean).permute(0, 2, 1, 3, 4).reshape(2, 16, 1, latent, latent), return_dict=False)[0][:, :, 0]
    for number, name in enumerate(rows[0]["layers"]):
        with Image.open(tmp_path / "samples" / name) as written:
            assert written.mode == "RGBA" and written.size == (SIZE, SIZE)
            expected = ((decoded[number] / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)
            assert (torch.from_numpy(np.asarray(written)).int() - expected.int()).abs().max() <= 1

    # predict: the transformer as the loop calls it on a stack (the image's condition frame appended, is_rgb 0), one output frame per input frame.
    generator = torch.Generator().manual_seed(0)
    pixels = pipeline.image_processor.preprocess(composite(), SIZE, SIZE).unsqueeze(2)
    image = pipeline._encode_vae_image(pixels, generator)
    stack = torch.randn(1, 16, 3, latent, latent, generator=generator)
    given = {**condition, "image_latents": image}
    t = torch.tensor([600.0])
    with torch.no_grad():
        mine = arch.call.predict(pipeline.transformer, stack, t, given, PredictContext(cpu, torch.float32, pipeline.vae_scale_factor, 1.0))
        tokens = pipeline._pack_latents(stack.permute(0, 2, 1, 3, 4), 1, 16, latent, latent, 3)
        image_tokens = pipeline._pack_latents(image.permute(0, 2, 1, 3, 4), 1, 16, latent, latent, 1)
        grid = (1, latent // 2, latent // 2)
        out = pipeline.transformer(
            hidden_states=torch.cat([tokens, image_tokens], dim=1), timestep=t / 1000, encoder_hidden_states=condition["prompt_embeds"],
            encoder_hidden_states_mask=condition["prompt_embeds_mask"], img_shapes=[[grid] * 4], additional_t_cond=torch.zeros(1, dtype=torch.long), return_dict=False,
        )[0][:, : tokens.shape[1]]
    torch.testing.assert_close(mine, pipeline._unpack_latents(out, SIZE, SIZE, 2, pipeline.vae_scale_factor))


def test_the_layers_part_encodes_the_image_as_the_pipeline_does_and_keeps_each_layers_alpha(tiny, tmp_path):
    from zeropipe.families.diffusion.parts.image_layers import load_rgba_for_bucket

    arch, folder, pipeline = tiny
    layer = tmp_path / "layer.png"
    half = Image.new("RGBA", (SIZE, SIZE), (0, 0, 0, 0))
    ImageDraw.Draw(half).rectangle((0, 0, SIZE // 2 - 1, SIZE - 1), fill=(20, 200, 20, 255))
    half.save(layer)
    pixels = load_rgba_for_bucket(Path(layer), (SIZE, SIZE), flip=False).pixels
    assert pixels.shape == (4, SIZE, SIZE)
    assert pixels[3, :, : SIZE // 2].min() == 1 and pixels[3, :, SIZE // 2 :].max() == -1  # opaque left half, transparent right half

    (part,) = arch.record.conditions
    image = pipeline.image_processor.preprocess(composite(), SIZE, SIZE)  # (1, 4, H, W): the RGBA image the pipeline encodes
    item = torch.cat([image, pixels.unsqueeze(0)])  # as the part's load gives an item: the image, then its layers
    values = part.encode(Encoding(pipeline.vae, item[:1], [item], None, arch.record.codec, torch.device("cpu")))
    shift, scale = latent_scaling(folder, arch)
    given = part.inputs(values, Inputs(torch.device("cpu"), torch.float32, lambda x: normalize_latents(arch.record.codec.from_vae(x), shift, scale)))
    generator = torch.Generator().manual_seed(0)
    torch.testing.assert_close(given["image_latents"], pipeline._encode_vae_image(image.unsqueeze(2), generator), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(given["layer_latents"][:, 0], pipeline._encode_vae_image(pixels[None, :, None], generator), rtol=1e-5, atol=1e-5)


def test_the_catalog_entry_counts_qwen_image_layereds_published_size_and_is_traced_with_four_layers():
    import json
    from types import SimpleNamespace

    from zeropipe.plan.model_spec import CATALOG_DIR, catalog_names

    assert "qwen-image-layered" in catalog_names()
    entry = json.loads((CATALOG_DIR / "qwen-image-layered.json").read_text())
    assert entry["architecture"] == "qwen-image-layered"
    from diffusers import QwenImageTransformer2DModel

    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**{k: v for k, v in entry["trained"]["config"].items() if not k.startswith("_")})
    assert sum(p.numel() for p in model.parameters()) == entry["published_params"]
    inputs = architecture_named("qwen-image-layered").call.trace_inputs(SimpleNamespace(in_channels=64, joint_attention_dim=3584), 80, 1, 20, torch.float32)
    assert inputs["hidden_states"].shape == (1, 6 * 40 * 40, 64) and inputs["img_shapes"] == [[(1, 40, 40)] * 6]


def test_images_with_other_numbers_of_layers_are_refused_naming_each_and_the_fix(tmp_path):
    """Every image needs as many layers as the others (they are denoised as one stack): the data step names each that differs."""
    from types import SimpleNamespace

    from zeropipe.errors import DataError
    from zeropipe.families.diffusion.parts import Planning

    images, layers = tmp_path / "images", [tmp_path / f"layer{number}" for number in range(2)]
    for folder in (images, *layers):
        folder.mkdir()
    for name in ("a", "b", "c"):
        composite().save(images / f"{name}.png")
        for folder in layers[: 1 if name == "c" else 2]:  # c has one layer, a and b two
            composite().save(folder / f"{name}.png")
    (part,) = architecture_named("qwen-image-layered").record.conditions
    data = SimpleNamespace(control_path=None, control_paths=[str(folder) for folder in layers])
    items = [{"path": str(images / f"{name}.png"), "caption": name} for name in ("a", "b", "c")]
    planning = Planning(SimpleNamespace(data=data), None, None, images, tmp_path, items, [], [], None)
    with pytest.raises(DataError) as refused:
        part.attach(planning)
    message = str(refused.value)
    assert message.startswith("1 problem(s) with the layers of 3 image(s)") and f"layer 1: {images / 'c.png'}: no layer file {layers[1] / 'c'}.*" in message
    assert "a.png" not in message and message.endswith("give every image the same number of readable layer files, or remove those images from data.path")

    items = items[:2]
    planning = Planning(SimpleNamespace(data=data), None, None, images, tmp_path, items, [], [], None)
    part.attach(planning)
    assert [Path(path).parent.name for path in items[0]["layers"]] == ["layer0", "layer1"]
    assert planning.notes == [f"layer decomposition training: 2 image(s), each split into 2 RGBA layer(s) from {layers[0]}, {layers[1]}"]
