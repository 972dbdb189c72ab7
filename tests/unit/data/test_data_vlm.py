"""Image-text data: every reader, bad images reported by path, and examples turned into model inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from zeropipe.data.tokenize import IGNORE_INDEX
from zeropipe.errors import ConfigError, DataError
from zeropipe.families.vlm.data import (
    IMAGE_MARKER,
    VlmEncoder,
    caption_messages,
    collate_vlm,
    load_rgb,
    load_vlm_data,
    read_vlm_data,
)

CAPTIONS = ["a red circle on a blue background", "a green square on a white background", "a black triangle on a yellow background"]

TINY_LLAVA = {
    "model_type": "llava",
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "projection_dim": 32},
    "text_config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "max_position_embeddings": 128},
}
TINY_GEMMA3 = {
    "model_type": "gemma3",
    "mm_tokens_per_image": 4,
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "vision_use_head": False},
    "text_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 8, "max_position_embeddings": 128, "sliding_window": 32},
}


@pytest.fixture
def images(tmp_path) -> Path:
    """Three good PNGs, a file that is not an image, and no file for missing.png."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    for index, colour in enumerate([(200, 0, 0), (0, 200, 0), (0, 0, 200)]):
        Image.new("RGB", (40, 30), colour).save(folder / f"{index}.png")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return folder


def user_text(example) -> str:
    return next(m["content"] for m in example.messages if m["role"] == "user")


def test_flickr8k_token_file_gives_one_example_per_caption(tmp_path, images):
    path = images / "Flickr8k.token.txt"
    path.write_text("0.png#0\ta red circle\n0.png#1\ta round red thing\n1.png#0\ta green square\nnot a caption line\n")
    data = read_vlm_data(path)
    assert [ex.messages[-1]["content"] for ex in data.examples] == ["a red circle", "a round red thing", "a green square"]
    assert data.examples[0].images == [str(images / "0.png")]
    assert user_text(data.examples[0]) == f"{IMAGE_MARKER}\nDescribe the image."
    assert [b.line_number for b in data.bad_records] == [4] and data.records == 4


def test_kaggle_captions_csv_with_unquoted_commas_and_an_images_subfolder(tmp_path, images):
    root = tmp_path / "flickr8k"
    root.mkdir()
    images.rename(root / "Images")
    path = root / "captions.txt"  # the Kaggle file: a CSV with a .txt name
    path.write_text('image,caption\n0.png,a red circle, seen from above\n1.png,"a green square, small"\n2.png,\n')
    data = read_vlm_data(path, caption_prompt="What is this?")
    assert [ex.messages[-1]["content"] for ex in data.examples] == ["a red circle, seen from above", "a green square, small"]
    assert data.examples[0].images == [str((root / "Images" / "0.png").resolve())]
    assert user_text(data.examples[0]) == f"{IMAGE_MARKER}\nWhat is this?"
    assert len(data.bad_records) == 1 and data.bad_records[0].line_number == 4


def test_csv_without_image_and_caption_columns_names_what_it_found(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("picture,words\na.png,hello\n")
    with pytest.raises(DataError, match="picture, words"):
        read_vlm_data(path)


def test_jsonl_caption_records_and_an_explicit_image_root(tmp_path, images, write_jsonl):
    path = write_jsonl(tmp_path / "captions.jsonl", [
        {"image": "0.png", "caption": "a red circle"},
        {"image": "1.png", "text": ["a green square", "green, four corners"]},
        {"caption": "no image here"},
        "{broken json",
    ])
    data = read_vlm_data(path, image_root=images)
    assert [ex.messages[-1]["content"] for ex in data.examples] == ["a red circle", "a green square", "green, four corners"]
    assert data.examples[1].images == [str(images / "1.png")]
    reasons = {b.line_number: b.reason for b in data.bad_records}
    assert set(reasons) == {3, 4} and "no image" in reasons[3] and "JSON" in reasons[4]


def test_chat_records_with_markers_content_parts_and_llava_conversations(tmp_path, images, write_jsonl):
    path = write_jsonl(tmp_path / "chat.jsonl", [
        # markers where the user put them
        {"messages": [{"role": "user", "content": "Compare <image> and <image>."}, {"role": "assistant", "content": "red vs green"}],
         "images": ["0.png", "1.png"]},
        # OpenAI-style content parts
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "blue"}]}], "images": ["2.png"]},
        # LLaVA's own format, no marker: the image goes before the first user message
        {"conversations": [{"from": "human", "value": "What shape?"}, {"from": "gpt", "value": "a circle"}], "image": "0.png"},
        # two markers, one image
        {"messages": [{"role": "user", "content": "<image> <image>"}, {"role": "assistant", "content": "x"}], "images": ["0.png"]},
        # text only
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ])
    data = read_vlm_data(path)
    assert len(data.examples) == 3
    assert user_text(data.examples[0]) == "Compare <image> and <image>." and len(data.examples[0].images) == 2
    assert data.examples[1].messages == [{"role": "user", "content": "<image>\nColour?"}, {"role": "assistant", "content": "blue"}]
    assert data.examples[2].messages[0] == {"role": "user", "content": "<image>\nWhat shape?"}
    assert data.examples[2].messages[1]["role"] == "assistant"
    reasons = {b.line_number: b.reason for b in data.bad_records}
    assert "2 <image> marker(s) but 1 image(s)" in reasons[4] and "no image" in reasons[5]


def test_image_folder_with_caption_files(tmp_path):
    from zeropipe.data.images import generate_shapes_dataset

    generate_shapes_dataset(tmp_path / "shapes", 6, seed=1, resolution=32)
    data = read_vlm_data(tmp_path / "shapes")
    assert len(data.examples) == 6 and "kohya" in data.layout
    caption = data.examples[0].messages[-1]["content"]
    assert caption.startswith("a ") and caption.endswith(" background")


def test_unreadable_images_are_skipped_and_reported_by_path(tmp_path, images):
    path = images / "captions.token"
    lines = [f"{i % 3}.png#0\tcaption {i}" for i in range(98)] + ["broken.png#0\tbroken", "missing.png#0\tgone"]
    path.write_text("\n".join(lines) + "\n")
    data = load_vlm_data(path, max_bad_fraction=0.05)
    assert len(data.examples) == 98 and data.skipped == 2
    reported = {str(b.path): b.reason for b in data.bad_images}
    assert "cannot be decoded" in reported[str(images / "broken.png")]
    assert reported[str(images / "missing.png")] == "file not found"


def test_too_many_unreadable_images_refuse_the_data_naming_them(tmp_path, images):
    path = images / "captions.token"
    path.write_text("0.png#0\tfine\n1.png#0\tfine\nbroken.png#0\tbad\n")
    with pytest.raises(DataError) as info:
        load_vlm_data(path, max_bad_fraction=0.01)
    message = str(info.value)
    assert "broken.png" in message and "data.max_bad_fraction" in message and "1 of 3" in message
    # The same data passes with a count that tolerates it.
    assert len(load_vlm_data(path, max_bad_records=1).examples) == 2


def test_load_rgb_composites_transparency_on_white(tmp_path):
    path = tmp_path / "clear.png"
    Image.new("RGBA", (4, 4), (255, 0, 0, 0)).save(path)
    assert load_rgb(path).getpixel((0, 0)) == (255, 255, 255)


# ---------------------------------------------------------------------------------------------
# Encoding (what the ranks do)


@pytest.fixture(scope="module")
def llava_processor(tmp_path_factory):
    from zeropipe.families.vlm.model import build_processor

    return build_processor(TINY_LLAVA, CAPTIONS * 10 + ["Describe the image."], 300, tmp_path_factory.mktemp("llava-processor"))


@pytest.fixture(scope="module")
def gemma3_processor(tmp_path_factory):
    from zeropipe.families.vlm.model import build_processor

    return build_processor(TINY_GEMMA3, CAPTIONS * 10 + ["Describe the image."], 300, tmp_path_factory.mktemp("gemma3-processor"))


def test_llava_example_has_loss_on_the_caption_only_and_one_token_per_patch(llava_processor):
    encoder = VlmEncoder(llava_processor)
    image = Image.new("RGB", (48, 40), (200, 0, 0))
    example = encoder.encode(caption_messages("Describe the image.", CAPTIONS[0]), [image])
    ids, labels = example["input_ids"].tolist(), example["labels"].tolist()
    image_id = llava_processor.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == (32 // 8) ** 2  # CLIP's class token is dropped by the "default" strategy
    learned = [token for token, label in zip(ids, labels) if label != IGNORE_INDEX]
    tokenizer = llava_processor.tokenizer
    assert tokenizer.decode(learned, skip_special_tokens=True) == CAPTIONS[0]
    assert learned[-1] == tokenizer.eos_token_id
    assert example["images"]["pixel_values"].shape == (1, 3, 32, 32)

    # Generation renders the same prompt, up to where the answer starts.
    prompt = encoder.encode(caption_messages("Describe the image."), [image], for_generation=True)["input_ids"].tolist()
    first_learned = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    assert prompt == ids[:first_learned]


def test_gemma3_example_marks_its_image_tokens_for_bidirectional_attention(gemma3_processor):
    encoder = VlmEncoder(gemma3_processor)
    example = encoder.encode(caption_messages("Describe the image.", CAPTIONS[1]), [Image.new("RGB", (30, 30), (0, 200, 0))])
    tokenizer = gemma3_processor.tokenizer
    ids, kinds = example["input_ids"].tolist(), example["token_type_ids"].tolist()
    soft = [i for i, token in enumerate(ids) if token == tokenizer.image_token_id]
    assert len(soft) == 4 and [i for i, kind in enumerate(kinds) if kind == 1] == soft
    assert ids[soft[0] - 1] == tokenizer.boi_token_id and ids[soft[-1] + 1] == tokenizer.convert_tokens_to_ids("<end_of_image>")


def test_truncation_never_cuts_an_image(llava_processor):
    long_caption = " ".join(CAPTIONS * 4)
    messages = [{"role": "user", "content": "Describe the image in great detail. <image>"}, {"role": "assistant", "content": long_caption}]
    image = Image.new("RGB", (32, 32))
    image_id = llava_processor.tokenizer.convert_tokens_to_ids("<image>")
    full = VlmEncoder(llava_processor).encode(messages, [image])
    cut = VlmEncoder(llava_processor, max_seq_len=24).encode(messages, [image])
    assert len(full["input_ids"]) > 24
    image_end = max(i for i, token in enumerate(full["input_ids"].tolist()) if token == image_id) + 1
    assert len(cut["input_ids"]) == max(24, image_end)
    assert cut["input_ids"].tolist().count(image_id) == 16


def test_collate_pads_text_and_stacks_images(llava_processor, gemma3_processor):
    for processor in (llava_processor, gemma3_processor):
        encoder = VlmEncoder(processor)
        batch = [
            encoder.encode(caption_messages("Describe the image.", caption), [Image.new("RGB", (32, 32))])
            for caption in ("a red circle", CAPTIONS[2])
        ]
        out = collate_vlm(batch, pad_token_id=processor.tokenizer.pad_token_id)
        longest = max(len(ex["input_ids"]) for ex in batch)
        assert out["input_ids"].shape == out["labels"].shape == out["attention_mask"].shape == (2, longest)
        assert out["pixel_values"].shape[0] == 2
        assert out["attention_mask"][0].sum() == len(batch[0]["input_ids"])
        assert (out["labels"][0, len(batch[0]["input_ids"]) :] == IGNORE_INDEX).all()
        if "token_type_ids" in batch[0]:
            assert out["token_type_ids"].shape == (2, longest)


def test_generation_pairs_default_to_held_out_shapes_and_pair_prompts(tmp_path):
    from zeropipe.config.schema import RunConfig
    from zeropipe.families.vlm.prepare import generation_pairs
    from zeropipe.rundir import RunDir

    run = RunDir(tmp_path / "run")
    (run.data).mkdir(parents=True)
    config = RunConfig.model_validate({"model": {"config": TINY_LLAVA}, "data": {"synthetic": {"task": "shapes"}}})
    pairs = generation_pairs(config, run)
    assert len(pairs) == 3 and all(p["prompt"] == "Describe the image." and Path(p["image"]).is_file() and p["expected"] for p in pairs)

    image = tmp_path / "mine.png"
    Image.new("RGB", (8, 8)).save(image)
    two_images = [str(image), str(image)]
    config = RunConfig.model_validate({"model": {"config": TINY_LLAVA}, "generate": {"prompts": ["What colour?"], "images": two_images}})
    assert [p["prompt"] for p in generation_pairs(config, run)] == ["What colour?", "What colour?"]
    config = RunConfig.model_validate({"model": {"config": TINY_LLAVA}, "generate": {"prompts": ["a", "b", "c"], "images": [str(image), str(image)]}})
    with pytest.raises(ConfigError, match="generate.images"):
        generation_pairs(config, run)


def test_manifest_round_trip(tmp_path, images):
    from zeropipe.families.vlm.data import read_manifest, write_manifest

    path = images / "c.token"
    path.write_text("0.png#0\tred\n")
    examples = read_vlm_data(path).examples
    write_manifest(tmp_path / "m.jsonl", examples)
    assert read_manifest(tmp_path / "m.jsonl") == examples
    assert json.loads((tmp_path / "m.jsonl").read_text())["images"] == [str(images / "0.png")]


def test_hub_style_parquet_with_embedded_image_bytes(tmp_path, images):
    """As the Hub stores image datasets: an image column of {bytes, path} structs, several rows per image."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"image": {"bytes": (images / f"{i % 3}.png").read_bytes(), "path": None}, "caption": CAPTIONS[i % 3]} for i in range(6)]
    rows.append({"image": {"bytes": b"\x89PNG\r\n\x1a\n not really a png", "path": "bad.png"}, "caption": "broken"})
    rows.append({"image": None, "caption": "no image"})
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / "train-00000-of-00001.parquet", row_group_size=3)
    written = tmp_path / "run" / "data" / "images"
    data = load_vlm_data(tmp_path / "hub", max_bad_fraction=0.5, image_dir=written)
    assert [ex.messages[1]["content"] for ex in data.examples] == CAPTIONS * 2
    # Each distinct image is written once, by content; the ranks read them as files.
    assert len({ex.images[0] for ex in data.examples}) == 3 and all(ex.images[0].startswith(str(written)) for ex in data.examples)
    assert load_rgb(data.examples[0].images[0]).size == (40, 30)
    assert data.skipped == 1 and [str(b) for b in data.bad_records] == ["train-00000-of-00001.parquet row 8: no image: a vision-language record needs 'image' or 'images'"]
    assert data.examples[4].where == "train-00000-of-00001.parquet row 5"


def test_parquet_with_image_paths_and_chat_records(tmp_path, images):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"images": [f"{i}.png"], "messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": CAPTIONS[i]}]} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), images / "chat.parquet")
    data = load_vlm_data(images / "chat.parquet")
    assert [ex.images for ex in data.examples] == [[str((images / f"{i}.png").resolve())] for i in range(3)]
    assert "Parquet/Arrow records (chat)" in data.layout
