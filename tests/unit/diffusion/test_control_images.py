"""Edit training's door: control images matched to targets by file name, the cache keys that depend on them, and the refusals before anything starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from zeropipe.config.schema import RunConfig
from zeropipe.families.diffusion import cache
from zeropipe.data.images import match_control_images
from zeropipe.errors import DataError
from zeropipe.families.diffusion import FAMILY


def picture(path: Path, colour=(200, 30, 30), size=(24, 16)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def test_a_control_image_is_found_by_stem_at_the_same_relative_path_or_at_the_top(tmp_path):
    data, controls = tmp_path / "data", tmp_path / "controls"
    kohya = picture(data / "10_cups" / "a.png")
    flat = picture(data / "10_cups" / "b.png")
    same_path = picture(controls / "10_cups" / "a.jpg")  # any image type: matched by stem
    at_top = picture(controls / "b.webp")
    picture(controls / "unused.png")  # a control image without a target is not an error

    found, problems = match_control_images([kohya, flat], data, controls)

    assert problems == []
    assert found == [same_path.resolve(), at_top.resolve()]


def test_targets_without_a_usable_control_image_are_each_named_with_what_was_looked_for(tmp_path):
    data, controls = tmp_path / "data", tmp_path / "controls"
    missing = picture(data / "cup.png")
    broken = picture(data / "plate.png")
    twice = picture(data / "bowl.png")
    (controls).mkdir()
    (controls / "plate.png").write_bytes(b"not an image")
    picture(controls / "bowl.png")
    picture(controls / "bowl.jpg")

    found, problems = match_control_images([missing, broken, twice], data, controls)

    assert found == [None, None, None]
    assert problems[0] == f"{missing}: no control image {controls.resolve() / 'cup'}.* (or {controls.resolve() / 'cup'}.*)"
    assert problems[1].startswith(f"{broken}: its control image {controls.resolve() / 'plate.png'} cannot be used (not an image")
    assert problems[2] == f"{twice}: several control images have its name (bowl.jpg, bowl.png): keep one"


def test_a_control_path_that_is_not_a_folder_says_so(tmp_path):
    with pytest.raises(DataError, match="data.control_path .* is not a folder"):
        match_control_images([], tmp_path, tmp_path / "nowhere")


def test_a_changed_control_image_changes_its_targets_latent_and_text_keys_only(tmp_path):
    target, control = picture(tmp_path / "t.png"), picture(tmp_path / "c.png")
    latent = cache.latent_key(target, (32, 32), "center-control", "vae", control=control)
    text = cache.control_text_key("make it red", "text-encoder", control, (32, 32))
    plain = cache.latent_key(target, (32, 32), "center", "vae")

    picture(control, colour=(0, 0, 200), size=(30, 16))  # a new file: another size and modification time
    os.utime(control, ns=(1, 2))

    assert cache.latent_key(target, (32, 32), "center-control", "vae", control=control) != latent
    assert cache.control_text_key("make it red", "text-encoder", control, (32, 32)) != text
    assert cache.latent_key(target, (32, 32), "center", "vae") == plain  # a target without a control image keys as before
    # The text entry also depends on the bucket the text encoder saw the control image at.
    assert cache.control_text_key("make it red", "text-encoder", control, (48, 32)) != cache.control_text_key("make it red", "text-encoder", control, (32, 32))


def config(tmp_path: Path, pipeline: str, **data) -> RunConfig:
    return RunConfig.model_validate({"model": {"config": {"pipeline": pipeline}, "lora": {"r": 4}}, "data": {"path": str(tmp_path), **data}})


def test_control_images_for_a_model_that_takes_none_are_refused_naming_the_key(tmp_path):
    problems = FAMILY.config_problems(config(tmp_path, "tiny-qwen-image", control_path=str(tmp_path)))
    assert problems == [("data.control_path", "this qwen-image pipeline takes no control image: remove data.control_path, or point model.path at an edit "
                                              "model's pipeline folder: FLUX.1 Kontext (FluxKontextPipeline, flux-kontext) or Qwen-Image-Edit "
                                              "(QwenImageEditPipeline, qwen-image-edit)")]


def test_an_edit_model_without_control_images_or_caches_or_with_flips_is_refused_with_each_fix(tmp_path):
    assert FAMILY.config_problems(config(tmp_path, "tiny-qwen-image-edit", control_path=str(tmp_path))) == []

    problems = dict(FAMILY.config_problems(config(tmp_path, "tiny-qwen-image-edit")))
    assert "set data.path and data.control_path" in problems["data.control_path"]

    problems = dict(FAMILY.config_problems(config(tmp_path, "tiny-qwen-image-edit", control_path=str(tmp_path / "nowhere"))))
    assert problems["data.control_path"].endswith("is not a folder: point it at the folder of control images (one per target image, same file name)")

    problems = dict(FAMILY.config_problems(config(tmp_path, "tiny-qwen-image-edit", control_path=str(tmp_path), cache={"text": False}, images={"flip": 0.5})))
    assert "set data.cache.latents and data.cache.text to true" in problems["data.cache"]
    assert "set flip: 0" in problems["data.images.flip"]


def test_prepare_refuses_targets_without_control_images_before_any_rank_starts(tmp_path):
    """The launcher's data step lists the targets that lack a control image (the first three) and the fix."""
    from zeropipe.families.diffusion.entries import architecture_named
    from zeropipe.families.diffusion.parts.control_image import attach_control_images

    data, controls = tmp_path / "data", tmp_path / "controls"
    items = [{"path": str(picture(data / f"{i}.png")), "caption": "c"} for i in range(5)]
    picture(controls / "0.png")
    with pytest.raises(DataError) as raised:
        attach_control_images(config(data, "tiny-qwen-image-edit", control_path=str(controls)), architecture_named("qwen-image-edit"), data, items, [])
    message = str(raised.value)
    assert message.startswith(f"4 of 5 target image(s) have no usable control image in {controls}")
    assert f"{data / '1.png'}: no control image" in message and " ...)" in message
    assert message.endswith("add a control image with the target's file name for each, or remove those targets from data.path")
