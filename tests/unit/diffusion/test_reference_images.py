"""Multi-reference edit training (Qwen-Image-Edit-Plus, FLUX.2 reference images): the data layouts, the cache keys, and the entries' denoiser calls against their pipelines'."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from zeropipe.config.schema import RunConfig
from zeropipe.families.diffusion import cache
from zeropipe.families.diffusion.entries import PredictContext, architecture_named
from zeropipe.families.diffusion.parts.reference_images import attach_reference_images, find_reference_images
from zeropipe.families.diffusion.parts.reference_prompt import references_text_key
from zeropipe.families.diffusion.parts import Encoding, Inputs
from zeropipe.families.diffusion.pipelines import build_tiny_pipeline, latent_scaling, normalize_latents, vae_scale_factor
from zeropipe.errors import DataError
from zeropipe.families.diffusion import FAMILY

SIZE = 32


def picture(path: Path, colour=(200, 30, 30), size=(24, 16)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def drawing(colour, size=SIZE) -> Image.Image:
    image = Image.new("RGB", (size, size), (20, 20, 120))
    ImageDraw.Draw(image).ellipse((size // 5, size // 5, 4 * size // 5, 4 * size // 5), fill=colour)
    return image


def config(tmp_path: Path, pipeline: str, **data) -> RunConfig:
    return RunConfig.model_validate({"model": {"config": {"pipeline": pipeline}, "lora": {"r": 4}}, "data": {"path": str(tmp_path), **data}})


# ------------------------------------------------------------------ the data
def test_references_are_found_in_musubis_suffixes_diffusion_pipes_folders_and_metadata_control_path_keys(tmp_path):
    data = tmp_path / "data"
    a, b, c = picture(data / "1_x" / "a.png"), picture(data / "1_x" / "b.png"), picture(data / "1_x" / "c.png")
    # musubi-tuner's control_directory: NAME.* first, then NAME_0, NAME_1, ... by number (NAME_10 after NAME_2).
    single = tmp_path / "single"
    a0, a1 = picture(single / "1_x" / "a_0.png"), picture(single / "1_x" / "a_1.jpg")
    b_self, b0 = picture(single / "b.webp"), picture(single / "b_0.png")
    c0, c2, c10 = picture(single / "c_0.png"), picture(single / "c_2.png"), picture(single / "c_10.png")
    found, problems = find_reference_images([a, b, c], data, str(single), None)
    assert problems == []
    assert found == [[a0.resolve(), a1.resolve()], [b_self.resolve(), b0.resolve()], [c0.resolve(), c2.resolve(), c10.resolve()]]
    # diffusion-pipe's control_paths: a folder per reference, same file names.
    first, second = tmp_path / "first", tmp_path / "second"
    pairs = [(picture(first / f"{name}.png"), picture(second / f"{name}.jpg")) for name in ("a", "b")]
    found, problems = find_reference_images([a, b], data, None, [str(first), str(second)])
    assert problems == [] and found == [[x.resolve(), y.resolve()] for x, y in pairs]
    # musubi-tuner's JSONL keys in metadata.jsonl: control_path first, then control_path_0, control_path_1 ...; relative to the data folder.
    meta = tmp_path / "meta"
    target = picture(meta / "t.png")
    r1, r2 = picture(meta / "refs" / "one.png"), picture(meta / "refs" / "two.png")
    (meta / "metadata.jsonl").write_text(json.dumps({"file_name": "t.png", "text": "x", "control_path_1": "refs/two.png", "control_path_0": "refs/one.png"}) + "\n")
    found, problems = find_reference_images([target], meta, None, None)
    assert problems == [] and found == [[r1.resolve(), r2.resolve()]]


def test_missing_broken_and_uneven_references_are_each_named_before_any_rank_starts(tmp_path):
    data, first, second = tmp_path / "data", tmp_path / "first", tmp_path / "second"
    targets = [picture(data / f"{name}.png") for name in ("a", "b", "c")]
    for name in ("a", "b", "c"):
        picture(first / f"{name}.png")
    picture(second / "a.png")
    (second / "b.png").write_bytes(b"not an image")
    items = [{"path": str(target), "caption": "x"} for target in targets]
    with pytest.raises(DataError) as raised:
        attach_reference_images(config(data, "tiny-qwen-image-edit-plus", control_paths=[str(first), str(second)]), None, data, items, [])
    message = str(raised.value)
    assert f"{data / 'b.png'}: its control image {second.resolve() / 'b.png'} cannot be used (not an image" in message
    assert f"reference 2: {data / 'c.png'}: no control image {second.resolve() / 'c'}.*" in message
    assert message.endswith("give every target the same number of readable reference images, or remove those targets from data.path")
    # musubi's layout where one target has one reference and the others two: the odd one is named.
    single = tmp_path / "single"
    for name, count in (("a", 2), ("b", 1), ("c", 2)):
        for number in range(count):
            picture(single / f"{name}_{number}.png")
    with pytest.raises(DataError, match=rf"{data / 'b.png'}: 1 reference image\(s\), the others 2"):
        attach_reference_images(config(data, "tiny-qwen-image-edit-plus", control_path=str(single)), None, data, items, [])


def test_the_settings_are_checked_per_entry(tmp_path):
    assert FAMILY.config_problems(config(tmp_path, "tiny-qwen-image-edit-plus", control_paths=[str(tmp_path)])) == []
    assert FAMILY.config_problems(config(tmp_path, "tiny-flux2")) == []  # FLUX.2 without references: text-to-image
    assert FAMILY.config_problems(config(tmp_path, "tiny-flux2", control_paths=[str(tmp_path)], images={"resolution": 64})) == []
    # Flux2Pipeline's image processor refuses reference images under 64 px, which samples would give it.
    assert dict(FAMILY.config_problems(config(tmp_path, "tiny-flux2", control_paths=[str(tmp_path)], images={"resolution": 32})))["data.images.resolution"].startswith(
        "the flux2 pipeline takes reference images of 64 px or more"
    )
    problems = dict(FAMILY.config_problems(config(tmp_path, "tiny-qwen-image-edit-plus")))
    assert "set data.path and data.control_paths" in problems["data.control_paths"]
    problems = dict(FAMILY.config_problems(config(tmp_path, "tiny-qwen-image-edit-plus", control_paths=[str(tmp_path / "nowhere")], cache={"latents": False})))
    assert problems["data.control_paths[0]"].endswith("is not a folder: point it at a folder of reference images (same file names as the targets)")
    assert "set data.cache.latents and data.cache.text to true" in problems["data.cache"]
    assert FAMILY.config_problems(config(tmp_path, "tiny-qwen-image-edit", control_path=str(tmp_path), control_paths=[str(tmp_path)])) == [
        ("data.control_paths", "this qwen-image-edit pipeline takes no reference images: remove data.control_paths, or train a multi-reference edit model (qwen-image-edit-plus, flux2)")
    ]


def test_changing_the_second_reference_changes_that_targets_latent_and_text_keys_only(tmp_path):
    arch = architecture_named("qwen-image-edit-plus")
    (condition,) = arch.record.conditions
    items = [{"path": str(picture(tmp_path / f"t{n}.png")), "references": [str(picture(tmp_path / f"t{n}_{r}.png")) for r in range(2)]} for n in range(2)]

    def keys():
        return [
            (cache.latent_key(Path(item["path"]), (32, 32), "center-references", "vae", files=condition.key_files(item)), references_text_key("x", "te", item["references"], (32, 32)))
            for item in items
        ]

    before = keys()
    picture(Path(items[0]["references"][1]), colour=(0, 0, 200), size=(30, 16))
    os.utime(items[0]["references"][1], ns=(1, 2))
    after = keys()
    assert after[0][0] != before[0][0] and after[0][1] != before[0][1]
    assert after[1] == before[1]
    # The order of the references is part of the keys: swapping them is another conditioning.
    assert references_text_key("x", "te", items[1]["references"][::-1], (32, 32)) != before[1][1]


# ------------------------------------------------------------------ the entries against their pipelines
def qwen_plus_reference(pipeline, latents, references, timestep, condition):
    """One denoising step's transformer output as QwenImageEditPlusPipeline.__call__ computes it: the references' tokens after the target's, every grid in img_shapes."""
    grid = (1, latents.shape[-2] // 2, latents.shape[-1] // 2)
    packed = [pipeline._pack_latents(x, 1, x.shape[1], x.shape[-2], x.shape[-1]) for x in (latents, *references)]
    out = pipeline.transformer(
        hidden_states=torch.cat(packed, dim=1), timestep=timestep.expand(1) / 1000, guidance=None, encoder_hidden_states_mask=condition["prompt_embeds_mask"],
        encoder_hidden_states=condition["prompt_embeds"], img_shapes=[[grid] * (1 + len(references))], return_dict=False,
    )[0]
    return pipeline._unpack_latents(out[:, : packed[0].shape[1]], SIZE, SIZE, pipeline.vae_scale_factor)


def flux2_reference(pipeline, latents, references, timestep, condition, guidance):
    """Flux2Pipeline.__call__'s step: prepare_image_latents' packed references and ids (time 10, 20) after the target's."""
    ids = pipeline._prepare_latent_ids(latents)
    image_ids = pipeline._prepare_image_ids(list(references))
    out = pipeline.transformer(
        hidden_states=torch.cat([pipeline._pack_latents(latents), *(pipeline._pack_latents(r) for r in references)], dim=1), timestep=timestep.expand(1) / 1000,
        guidance=guidance, encoder_hidden_states=condition["prompt_embeds"], txt_ids=pipeline._prepare_text_ids(condition["prompt_embeds"]),
        img_ids=torch.cat([ids, image_ids], dim=1), return_dict=False,
    )[0]
    return out[:, : latents.shape[-2] * latents.shape[-1]]


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """The tiny pipelines, built once for the tests below."""
    root = tmp_path_factory.mktemp("pipelines")
    return {preset: (build_tiny_pipeline({"pipeline": preset}, root / preset, seed=1), root / preset) for preset in ("tiny-qwen-image-edit-plus", "tiny-flux2")}


@pytest.mark.parametrize("preset", ["tiny-qwen-image-edit-plus", "tiny-flux2"])
def test_an_entrys_prediction_is_its_pipelines_denoiser_call_and_the_second_reference_changes_it(tiny_folders, preset):
    arch, folder = tiny_folders[preset]
    pipeline = arch.pipeline().from_pretrained(str(folder), **({"processor": None} if arch.record.text.processors else {}))
    generator = torch.Generator().manual_seed(0)
    # The pipelines' own encoding of two reference images (VAE mode, normalised; FLUX.2's patched), as the entries' normalised references.
    if arch.record.name == "qwen-image-edit-plus":
        condition = {"prompt_embeds": torch.randn(1, 7, 32, generator=generator), "prompt_embeds_mask": torch.ones(1, 7, dtype=torch.long)}
        pixels = [pipeline.image_processor.preprocess(drawing(c), SIZE, SIZE).unsqueeze(2) for c in ((200, 40, 40), (40, 200, 40))]
        references = [pipeline._encode_vae_image(p, generator) for p in pixels]
    else:
        condition = {"prompt_embeds": torch.randn(1, 9, 48, generator=generator)}
        pixels = [pipeline.image_processor.preprocess(drawing(c), SIZE, SIZE) for c in ((200, 40, 40), (40, 200, 40))]
        references = [pipeline._encode_vae_image(p, generator) for p in pixels]
    # The reference images part gives predict what the pipeline's own encoding gives: encoded (with the VAE's mean) and normalised as the target.
    (part,) = arch.record.conditions
    shift, scale = latent_scaling(folder, arch)
    item = torch.cat([p.squeeze(2) for p in pixels])  # one item's two references, (2, 3, H, W), as the part's load gives them
    values = part.encode(Encoding(pipeline.vae, item[:1], [item], None, arch.record.codec, torch.device("cpu")))
    given = part.inputs(values, Inputs(torch.device("cpu"), torch.float32, lambda x: normalize_latents(arch.record.codec.from_vae(x), shift, scale)))["reference_latents"]
    torch.testing.assert_close(given, torch.stack(references, dim=1), rtol=1e-4, atol=1e-5)
    latents = torch.randn(references[0].shape, generator=generator)
    timestep = torch.tensor([600.0])
    context = PredictContext(torch.device("cpu"), torch.float32, vae_scale_factor(folder), 3.5)

    def mine(refs):
        return arch.call.predict(pipeline.transformer, latents, timestep, {**condition, "reference_latents": torch.stack(refs, dim=1)}, context)

    with torch.no_grad():
        ours = mine(references)
        if arch.record.name == "qwen-image-edit-plus":
            theirs = qwen_plus_reference(pipeline, latents, references, timestep, condition)
        else:
            theirs = flux2_reference(pipeline, latents, references, timestep, condition, torch.tensor([3.5]))
        changed = mine([references[0], torch.randn(references[1].shape, generator=generator)])
    assert ours.shape == latents.shape
    torch.testing.assert_close(ours, theirs.reshape(ours.shape) if arch.record.name != "flux2" else theirs.permute(0, 2, 1).reshape(ours.shape), rtol=1e-5, atol=1e-6)
    assert (changed - ours).abs().max() > 1e-3  # the second reference conditions the prediction


def test_qwen_image_edit_plus_samples_as_its_pipeline_draws_from_prompts_and_two_references(tiny_folders, monkeypatch):
    """The entry's text encoding of the prompt with both references (encode_prompts_with_images) and its sampling loop give the
    pipeline's own latents, true CFG included, where the pipeline takes the references at the sample size. Its call resizes them
    to VAE_IMAGE_SIZE (a megapixel, which the entry's loop replaces by the sample size): set to the sample size here, which saves
    four 1024 px VAE encodings."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    from zeropipe.families.diffusion.pipelines import text_pipeline

    size = 64
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", size * size)
    arch, folder = tiny_folders["tiny-qwen-image-edit-plus"]
    encoders = text_pipeline(folder, arch, torch.float32, torch.device("cpu"))
    pipeline = arch.pipeline().from_pretrained(str(folder), processor=encoders.processor)
    pipeline.set_progress_bar_config(disable=True)
    images = [drawing((200, 40, 40), size), drawing((40, 200, 40), size)]
    prompt = "Put the cup of Picture 1 on the table of Picture 2."
    with torch.no_grad():
        condition, negative = (arch.prompts.encode_prompts_with_images(encoders, [text], [images], torch.device("cpu")) for text in (prompt, " "))
        kwargs = {"height": size, "width": size, "num_inference_steps": 2, "output_type": "latent", "return_dict": False, **arch.sampling.sample_kwargs(condition, negative, 3.0, 1.0)}
        ours = arch.sampling.draw(pipeline, {**kwargs, "generator": torch.Generator().manual_seed(5), "image": images})
        theirs = pipeline(image=images, prompt=prompt, negative_prompt=" ", true_cfg_scale=3.0, height=size, width=size, num_inference_steps=2,
                          output_type="latent", return_dict=False, generator=torch.Generator().manual_seed(5))[0]
    assert ours.shape == (1, (size // 8) ** 2, 64)
    torch.testing.assert_close(ours, theirs)


def test_the_qwen_image_edit_2509_catalog_entry_is_traced_with_two_references_appended():
    """Its catalog entry names the plus entry, whose trace inputs hold the target's and two references' tokens (the planner's activations)."""
    from types import SimpleNamespace

    from zeropipe.plan.model_spec import CATALOG_DIR, catalog_names

    assert "qwen-image-edit-2509" in catalog_names() and json.loads((CATALOG_DIR / "qwen-image-edit-2509.json").read_text())["architecture"] == "qwen-image-edit-plus"
    inputs = architecture_named("qwen-image-edit-plus").call.trace_inputs(SimpleNamespace(in_channels=64, joint_attention_dim=3584), 128, 1, 20, torch.float32)
    assert inputs["hidden_states"].shape == (1, 3 * 64 * 64, 64) and inputs["img_shapes"] == [[(1, 64, 64)] * 3]
