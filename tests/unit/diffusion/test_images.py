"""The image data layer: scanning folders, buckets, loading at a bucket's size, micro-batches per rank."""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from zeropipe.data.images import (
    COLOURS,
    SHAPES,
    generate_shapes_dataset,
    load_image_for_bucket,
    scan_image_folder,
    shape_prompts,
)
from zeropipe.families.diffusion.buckets import assign_bucket, epoch_micro_batches, make_buckets, micro_batches_per_rank
from zeropipe.errors import DataError

CAPTION_PATTERN = r"a (\w+) (\w+) on a (\w+) background"


def write_image(path: Path, size=(40, 30), colour=(200, 30, 30), mode="RGB") -> Path:
    """A small solid image at ``path`` (format from the suffix), creating folders on the way."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path)
    return path


def noise_image(path: Path, size=(64, 48)) -> Path:
    """Random pixels (format from the suffix): they compress badly, so cutting the file in half really truncates the pixel data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def by_name(scan):
    return {item.path.name: item for item in scan.items}


# ---------------------------------------------------------------------------------------------
# scan_image_folder


def test_kohya_folders_give_repeats_and_the_concept_as_missing_caption(tmp_path):
    write_image(tmp_path / "10_sks dog" / "a.png", size=(40, 30))
    (tmp_path / "10_sks dog" / "a.txt").write_text("sks dog on a beach\n")
    write_image(tmp_path / "10_sks dog" / "b.jpg", size=(30, 50))  # no caption file
    write_image(tmp_path / "2_cat" / "c.webp")
    (tmp_path / "2_cat" / "c.txt").write_text("a cat")

    scan = scan_image_folder(tmp_path)

    assert scan.layout == "kohya"
    assert scan.bad == [] and scan.bad_lines == []
    items = by_name(scan)
    assert (items["a.png"].caption, items["a.png"].repeats) == ("sks dog on a beach", 10)
    assert (items["b.jpg"].caption, items["b.jpg"].repeats) == ("sks dog", 10)
    assert (items["c.webp"].caption, items["c.webp"].repeats) == ("a cat", 2)
    assert (items["a.png"].width, items["a.png"].height) == (40, 30)
    assert (items["b.jpg"].width, items["b.jpg"].height) == (30, 50)
    assert all(item.path.is_absolute() for item in scan.items)
    assert [item.path for item in scan.items] == sorted(item.path for item in scan.items)


def test_kohya_reports_images_outside_repeat_folders_instead_of_dropping_them_silently(tmp_path):
    write_image(tmp_path / "5_shapes" / "a.png")
    stray = write_image(tmp_path / "extras" / "b.png")

    scan = scan_image_folder(tmp_path)

    assert [item.path.name for item in scan.items] == ["a.png"]
    assert [problem.path for problem in scan.bad] == [stray]
    assert "<repeats>_<concept>" in scan.bad[0].reason


def test_metadata_jsonl_keeps_good_lines_and_reports_broken_line_and_missing_file(tmp_path):
    write_image(tmp_path / "a.png")
    write_image(tmp_path / "sub" / "b.png", size=(20, 60))
    write_image(tmp_path / "c.png")
    lines = [
        json.dumps({"file_name": "a.png", "text": "first"}),
        '{"file_name": "broken.png", "text": ',
        json.dumps({"file_name": "sub/b.png", "caption": "second"}),
        json.dumps({"file_name": "gone.png", "text": "missing"}),
        json.dumps({"file_name": "c.png", "prompt": "third"}),
    ]
    (tmp_path / "metadata.jsonl").write_text("\n".join(lines) + "\n")

    scan = scan_image_folder(tmp_path)

    assert scan.layout == "metadata"
    assert {name: item.caption for name, item in by_name(scan).items()} == {"a.png": "first", "b.png": "second", "c.png": "third"}
    assert (by_name(scan)["b.png"].width, by_name(scan)["b.png"].height) == (20, 60)
    assert len(scan.bad_lines) == 1
    assert "metadata.jsonl line 2" in scan.bad_lines[0]
    assert [(problem.path.name, problem.reason) for problem in scan.bad] == [("gone.png", "listed in metadata.jsonl but missing")]


def test_metadata_line_without_caption_names_the_accepted_keys(tmp_path):
    write_image(tmp_path / "a.png")
    write_image(tmp_path / "b.png")
    (tmp_path / "metadata.jsonl").write_text(
        json.dumps({"file_name": "a.png", "text": "ok"}) + "\n" + json.dumps({"file_name": "b.png", "description": "x"}) + "\n"
    )

    scan = scan_image_folder(tmp_path)

    assert [item.path.name for item in scan.items] == ["a.png"]
    assert "line 2" in scan.bad_lines[0] and '"text"' in scan.bad_lines[0]


def test_metadata_csv(tmp_path):
    write_image(tmp_path / "a.png")
    (tmp_path / "metadata.csv").write_text('file_name,text\na.png,"a red, round thing"\n')

    scan = scan_image_folder(tmp_path)

    assert scan.layout == "metadata"
    assert [(item.path.name, item.caption) for item in scan.items] == [("a.png", "a red, round thing")]


def test_truncated_and_fake_images_are_reported_and_the_good_ones_kept(tmp_path):
    good = write_image(tmp_path / "good.png")
    (tmp_path / "good.txt").write_text("fine")
    truncated = noise_image(tmp_path / "truncated.png")
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    # A JPEG too: its header parses fine, only decoding every pixel finds the missing half.
    truncated_jpeg = noise_image(tmp_path / "truncated.jpg")
    truncated_jpeg.write_bytes(truncated_jpeg.read_bytes()[: truncated_jpeg.stat().st_size // 2])
    fake = tmp_path / "notes.JPG"  # upper-case suffix: still picked up as an image
    fake.write_text("this is a text file, not a photo")
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")

    scan = scan_image_folder(tmp_path)

    assert scan.layout == "flat"
    assert [item.path for item in scan.items] == [good]
    reasons = {problem.path: problem.reason for problem in scan.bad}
    assert set(reasons) == {truncated, truncated_jpeg, fake, empty}
    assert "truncated" in reasons[truncated] and "truncated" in reasons[truncated_jpeg]
    assert "not an image" in reasons[fake]
    assert "empty" in reasons[empty]


def test_flat_layout_gives_missing_captions_the_empty_caption_and_lists_them(tmp_path):
    write_image(tmp_path / "a.png")
    (tmp_path / "a.caption").write_text("  a caption with a custom suffix \n")
    uncaptioned = write_image(tmp_path / "deeper" / "b.bmp")
    write_image(tmp_path / ".hidden" / "c.png")  # hidden folders are not data

    scan = scan_image_folder(tmp_path, caption_ext=".caption")

    assert {name: item.caption for name, item in by_name(scan).items()} == {"a.png": "a caption with a custom suffix", "b.bmp": ""}
    assert all(item.repeats == 1 for item in scan.items)
    assert scan.missing_captions == [uncaptioned]


def test_folder_without_images_names_the_folder_and_the_layouts(tmp_path):
    (tmp_path / "readme.txt").write_text("nothing to see")
    with pytest.raises(DataError) as raised:
        scan_image_folder(tmp_path)
    message = str(raised.value)
    assert str(tmp_path.resolve()) in message
    assert "kohya" in message and "metadata.jsonl" in message and "flat" in message


def test_missing_folder_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        scan_image_folder(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
# Buckets


@pytest.mark.parametrize(("resolution", "step"), [(32, 8), (64, 16), (1024, 64)])
def test_buckets_include_the_square_and_respect_area_aspect_and_step(resolution, step):
    buckets = make_buckets(resolution, step=step, max_aspect=2.0)

    assert (resolution, resolution) in buckets
    assert len(buckets) == len(set(buckets)) and buckets == sorted(buckets)
    assert any(width > height for width, height in buckets) and any(width < height for width, height in buckets)
    for width, height in buckets:
        assert width % step == 0 and height % step == 0
        assert width * height <= resolution * resolution
        assert 0.5 <= width / height <= 2.0
        assert (height, width) in buckets


def test_assign_bucket_matches_the_image_shape():
    buckets = make_buckets(64, step=8)
    landscape = assign_bucket(900, 600, buckets)
    portrait = assign_bucket(600, 900, buckets)
    assert landscape[0] > landscape[1]
    assert portrait == (landscape[1], landscape[0])
    assert assign_bucket(500, 500, buckets) == (64, 64)
    # Closest on a log scale: a 3:2 photo goes to the bucket nearest 1.5, not merely some wide one.
    best = min(abs(math.log(width / height) - math.log(1.5)) for width, height in buckets)
    assert abs(math.log(landscape[0] / landscape[1]) - math.log(1.5)) == best


# ---------------------------------------------------------------------------------------------
# load_image_for_bucket


def test_loaded_image_has_the_bucket_shape_values_in_range_and_sdxl_sizes(tmp_path):
    path = noise_image(tmp_path / "wide.png", size=(90, 40))

    prepared = load_image_for_bucket(path, (40, 24))

    assert prepared.pixels.shape == (3, 24, 40)
    assert prepared.pixels.dtype == torch.float32
    assert prepared.pixels.min() >= -1 and prepared.pixels.max() <= 1
    assert prepared.pixels.min() < -0.5 and prepared.pixels.max() > 0.5  # noise spans the range, not squashed
    assert prepared.original_size == (40, 90)
    assert prepared.target_size == (24, 40)
    # Resized to cover 40x24: height 40 -> 24 makes the width 54, so 14 pixels are cropped, 7 each side.
    assert prepared.crop_top_left == (0, 7)


def test_flip_mirrors_the_pixels(tmp_path):
    path = tmp_path / "half.png"
    pixels = np.zeros((32, 32, 3), dtype=np.uint8)
    pixels[:, :16] = (255, 0, 0)  # left half red, right half black
    Image.fromarray(pixels).save(path)

    plain = load_image_for_bucket(path, (32, 32))
    flipped = load_image_for_bucket(path, (32, 32), flip=True)

    assert torch.equal(flipped.pixels, torch.flip(plain.pixels, dims=[2]))
    assert plain.pixels[0, 0, 0] == 1 and flipped.pixels[0, 0, 0] == -1


def test_random_crop_is_reproducible_and_needs_a_generator(tmp_path):
    path = noise_image(tmp_path / "tall.png", size=(40, 120))
    first = load_image_for_bucket(path, (32, 32), crop="random", rng=random.Random(3))
    again = load_image_for_bucket(path, (32, 32), crop="random", rng=random.Random(3))
    assert torch.equal(first.pixels, again.pixels) and first.crop_top_left == again.crop_top_left
    tops = {load_image_for_bucket(path, (32, 32), crop="random", rng=random.Random(seed)).crop_top_left[0] for seed in range(10)}
    assert len(tops) > 1
    with pytest.raises(ValueError, match="rng"):
        load_image_for_bucket(path, (32, 32), crop="random")


@pytest.mark.parametrize(
    ("mode", "colour"),
    [("RGBA", (255, 0, 0, 0)), ("LA", (0, 0)), ("L", 128), ("P", 3), ("I;16", 65535)],
)
def test_unusual_modes_load_as_rgb(tmp_path, mode, colour):
    path = write_image(tmp_path / f"{mode.replace(';', '')}.png", size=(16, 16), colour=colour, mode=mode)

    prepared = load_image_for_bucket(path, (16, 16))

    assert prepared.pixels.shape == (3, 16, 16)
    assert prepared.pixels.min() >= -1 and prepared.pixels.max() <= 1
    if mode in ("RGBA", "LA"):  # fully transparent: the white background shows, not black
        assert torch.all(prepared.pixels == 1)
    if mode == "I;16":  # 16-bit white stays white
        assert torch.all(prepared.pixels == 1)


def test_palette_image_with_transparency_composites_on_white(tmp_path):
    path = tmp_path / "palette.png"
    image = Image.new("P", (8, 8), 0)
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * (256 * 3 - 6))
    image.putpixel((0, 0), 1)
    image.save(path, transparency=0)  # palette entry 0 (black) is transparent

    pixels = load_image_for_bucket(path, (8, 8)).pixels

    assert pixels[:, 0, 0].tolist() == [1, -1, -1]  # the one red pixel
    assert torch.all(pixels[:, 4, 4] == 1)  # transparent black shows as white


def test_undecodable_image_is_a_data_error_naming_the_path(tmp_path):
    path = tmp_path / "fake.png"
    path.write_text("not a png")
    with pytest.raises(DataError) as raised:
        load_image_for_bucket(path, (32, 32))
    assert str(path) in str(raised.value)


# ---------------------------------------------------------------------------------------------
# epoch_micro_batches


BUCKETS_OF_ITEMS = [(32, 32)] * 13 + [(40, 24)] * 7 + [(24, 40)] * 5
REPEATS = [1] * 10 + [3] * 3 + [1] * 7 + [2] * 5


def test_micro_batches_are_single_bucket_equal_per_rank_and_disjoint():
    result = epoch_micro_batches(BUCKETS_OF_ITEMS, REPEATS, micro_batch_size=2, world_size=3, seed=0, epoch=0)

    assert len(result) == 3
    counts = {len(batches) for batches in result}
    assert counts == {micro_batches_per_rank(BUCKETS_OF_ITEMS, REPEATS, micro_batch_size=2, world_size=3)}
    assert counts.pop() > 0
    slots = []
    for batches in result:
        for batch in batches:
            assert len(batch) == 2
            assert len({BUCKETS_OF_ITEMS[index] for index in batch}) == 1
            slots.append(tuple(batch))
    # Disjoint: over all ranks no image appears more often than its repeat count.
    used = Counter(index for batch in slots for index in batch)
    assert all(used[index] <= REPEATS[index] for index in used)


def test_micro_batches_are_deterministic_and_change_with_the_epoch():
    arguments = dict(micro_batch_size=2, world_size=2, seed=7)
    first = epoch_micro_batches(BUCKETS_OF_ITEMS, REPEATS, epoch=0, **arguments)
    again = epoch_micro_batches(BUCKETS_OF_ITEMS, REPEATS, epoch=0, **arguments)
    next_epoch = epoch_micro_batches(BUCKETS_OF_ITEMS, REPEATS, epoch=1, **arguments)
    other_seed = epoch_micro_batches(BUCKETS_OF_ITEMS, REPEATS, epoch=0, micro_batch_size=2, world_size=2, seed=8)
    assert first == again
    assert first != next_epoch and first != other_seed
    assert len(first[0]) == len(next_epoch[0])


def test_repeats_multiply_how_often_an_image_is_seen():
    buckets = [(32, 32)] * 4
    repeats = [1, 1, 1, 5]
    result = epoch_micro_batches(buckets, repeats, micro_batch_size=1, world_size=1, seed=0, epoch=0)
    seen = Counter(index for batch in result[0] for index in batch)
    assert seen == Counter({0: 1, 1: 1, 2: 1, 3: 5})


def test_count_per_rank_is_the_same_every_epoch_and_partial_batches_are_dropped():
    for world_size, micro_batch_size in [(1, 1), (2, 3), (3, 4), (4, 2)]:
        expected = micro_batches_per_rank(BUCKETS_OF_ITEMS, REPEATS, micro_batch_size, world_size)
        for epoch in range(4):
            result = epoch_micro_batches(BUCKETS_OF_ITEMS, REPEATS, micro_batch_size, world_size, seed=1, epoch=epoch)
            assert [len(batches) for batches in result] == [expected] * world_size
    # 3 images in a bucket with micro-batches of 4: nothing can be formed.
    assert micro_batches_per_rank([(8, 8)] * 3, [1] * 3, micro_batch_size=4, world_size=1) == 0
    assert epoch_micro_batches([(8, 8)] * 3, [1] * 3, micro_batch_size=4, world_size=2, seed=0, epoch=0) == [[], []]


# ---------------------------------------------------------------------------------------------
# The synthetic shapes dataset


def test_shapes_dataset_is_deterministic_and_scans_cleanly(tmp_path):
    first = generate_shapes_dataset(tmp_path / "a", examples=12, seed=5, resolution=32)
    again = generate_shapes_dataset(tmp_path / "b", examples=12, seed=5, resolution=32)
    other = generate_shapes_dataset(tmp_path / "c", examples=12, seed=6, resolution=32)

    def contents(root):
        return {path.relative_to(root): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}

    assert contents(first) == contents(again)
    assert contents(first) != contents(other)

    scan = scan_image_folder(first)
    assert scan.layout == "kohya" and scan.bad == [] and len(scan.items) == 12
    shapes_seen = set()
    for item in scan.items:
        match = re.fullmatch(CAPTION_PATTERN, item.caption)
        assert match, item.caption
        colour, shape, background = match.groups()
        assert shape in SHAPES and colour in COLOURS and background in COLOURS and colour != background
        shapes_seen.add(shape)
        # The background is the colour the caption names: the shape is smaller than the image, so some corner shows it.
        with Image.open(item.path) as image:
            right, bottom = image.width - 1, image.height - 1
            corners = [image.getpixel(corner) for corner in [(0, 0), (right, 0), (0, bottom), (right, bottom)]]
        assert tuple(COLOURS[background]) in corners
    assert len(shapes_seen) > 1
    buckets = make_buckets(32, step=8)
    assert {assign_bucket(item.width, item.height, buckets) for item in scan.items} == {(32, 32), (40, 24), (24, 40)}


def test_regenerating_with_fewer_examples_leaves_no_stale_files(tmp_path):
    generate_shapes_dataset(tmp_path, examples=6, seed=0, resolution=16)
    generate_shapes_dataset(tmp_path, examples=2, seed=0, resolution=16)
    assert len(scan_image_folder(tmp_path).items) == 2


def test_shape_prompts_have_the_training_caption_form():
    prompts = shape_prompts(20, seed=0)
    assert prompts == shape_prompts(20, seed=0) and len(prompts) == 20
    for prompt in prompts:
        match = re.fullmatch(CAPTION_PATTERN, prompt)
        assert match and match[2] in SHAPES and match[1] != match[3]
