"""Vision-language models on 2 CPU ranks: LLaVA from a local checkpoint with its vision tower frozen
(ZeRO-2), and Gemma 3 from an inline config with LoRA on its language model (ZeRO-3, resumed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import assert_ok, metrics, tiny_run_config, write_config, zeropipe, zeropipe_here

pytestmark = pytest.mark.integration

TINY_LLAVA = {
    "model_type": "llava",
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "projection_dim": 32},
    "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False},
}
TINY_GEMMA3 = {
    "model_type": "gemma3",
    "mm_tokens_per_image": 4,
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "vision_use_head": False},
    "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 16, "max_position_embeddings": 128, "sliding_window": 32},
}
# ZeRO pads each rank's flat partition; a few elements per parameter group at most.
PADDING = 64


def first_vs_last(rows: list[dict]) -> tuple[float, float]:
    losses = [row["loss"] for row in rows if row.get("kind") is None]
    return sum(losses[:3]) / 3, sum(losses[-3:]) / 3


def generate_from_export(directory: Path, image: Path, prompt: str = "Describe the image.") -> str:
    """Load the export with the Auto classes and answer about ``image`` (rendered as in training)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from zeropipe.families.vlm.data import VlmEncoder, caption_messages, load_rgb

    model = AutoModelForImageTextToText.from_pretrained(directory).eval()
    processor = AutoProcessor.from_pretrained(directory)
    example = VlmEncoder(processor).encode(caption_messages(prompt), [load_rgb(image)], for_generation=True)
    inputs = {key: value[None] for key, value in example.items() if key not in ("images", "labels")}
    inputs.update({key: value.to(model.dtype) if value.is_floating_point() else value for key, value in example["images"].items()})
    with torch.no_grad():
        output = model.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=6, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    assert len(new_tokens) > 0
    return processor.tokenizer.decode(new_tokens, skip_special_tokens=True)


@pytest.fixture
def flickr_style_data(tmp_path) -> Path:
    """160 shape images with a Flickr8k-style captions file, plus a damaged and a missing image."""
    from zeropipe.data.images import generate_shapes_dataset

    folder = generate_shapes_dataset(tmp_path / "shapes", 160, seed=0, resolution=32) / "1_shapes"
    lines = [f"{png.name}#0\t{png.with_suffix('.txt').read_text().strip()}" for png in sorted(folder.glob("*.png"))]
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    lines += ["broken.png#0\ta damaged file", "missing.png#0\ta file that is not there"]
    captions = folder / "Flickr8k.token.txt"
    captions.write_text("\n".join(lines) + "\n")
    return captions


@pytest.fixture
def llava_checkpoint(tmp_path, flickr_style_data) -> Path:
    """A tiny pretrained-style LLaVA directory (bf16 safetensors + processor) saved by the test itself."""
    from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

    from zeropipe.families.vlm.model import build_processor, resolve_inline_config

    directory = tmp_path / "llava-base"
    captions = [line.split("\t", 1)[1] for line in flickr_style_data.read_text().splitlines()]
    processor = build_processor(TINY_LLAVA, captions + ["Describe the image."], 300, directory)
    fields = dict(resolve_inline_config(TINY_LLAVA, processor.tokenizer).fields)
    config = CONFIG_MAPPING[fields.pop("model_type")](**fields)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def test_llava_trains_with_a_frozen_vision_tower_and_exports(tmp_path, flickr_style_data, llava_checkpoint):
    from safetensors.torch import load_file

    held_out = flickr_style_data.parent / "00159.png"
    config = tiny_run_config(
        tmp_path,
        name="llava",
        model={"config": None, "path": str(llava_checkpoint), "trainable": ["projector", "language_model"]},
        data={"synthetic": None, "path": str(flickr_style_data), "max_seq_len": 48, "max_bad_fraction": 0.02},
        train={"max_steps": 16, "micro_batch_size": 8, "lr": 3e-3, "warmup_steps": 2},
        deepspeed={"zero_stage": 2},
        generate={"prompts": ["Describe the image."], "images": [str(held_out)], "max_new_tokens": 8},
    )
    result = zeropipe("train", write_config(tmp_path, config, "llava.yaml"))
    assert_ok(result)
    # Bad images are skipped and named before the ranks start.
    assert "2 example(s) with unreadable images" in result.stderr
    assert "broken.png: cannot be decoded" in result.stderr and "missing.png: file not found" in result.stderr

    run_dir = tmp_path / "runs" / "llava"
    first, last = first_vs_last(metrics(run_dir))
    assert last < 0.8 * first, (first, last)

    parameters = json.loads((run_dir / "summary.json").read_text())["parameters"]
    parts = parameters["parts"]
    assert parts["vision_tower"]["trainable"] == 0 and parts["vision_tower"]["total"] > 0
    assert parameters["trainable"] == parts["projector"]["total"] + parts["language_model"]["total"]
    # Adam holds moments for the trainable parameters only: the frozen tower has none.
    assert parameters["trainable"] <= parameters["optimizer_state_elements"] <= parameters["trainable"] + PADDING
    assert parameters["optimizer_state_elements"] < parameters["total"] - parts["vision_tower"]["total"] + PADDING

    generations = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert len(generations) == 1 and generations[0]["image"] == str(held_out.resolve())

    export = tmp_path / "llava-export"
    assert_ok(zeropipe_here("export", run_dir, "--out", export, "--dtype", "fp32"))
    exported, base = load_file(export / "model.safetensors"), load_file(llava_checkpoint / "model.safetensors")
    # save_pretrained writes LLaVA's original key names (vision_tower.vision_model..., multi_modal_projector...).
    tower = [key for key in base if "vision_tower." in key]
    projector = [key for key in base if "multi_modal_projector." in key and key.endswith("weight")]
    assert tower and all(torch.equal(exported[key], base[key].float()) for key in tower), "the frozen vision tower changed"
    assert projector and not any(torch.equal(exported[key], base[key].float()) for key in projector), "the projector did not train"
    answer = generate_from_export(export, held_out)

    # zeropipe generate answers the same from the run's checkpoint and from the export.
    answers = []
    for source in (run_dir, export):
        result = zeropipe_here("generate", source, "--prompt", "Describe the image.", "--image", held_out, "--max-new-tokens", "6", "--json")
        assert_ok(result)
        answers.append(json.loads(result.stdout)["generations"])
    assert answers[0] == answers[1], answers
    assert answers[0][0]["output"] == answer.strip() and answers[0][0]["image"] == str(held_out)


def test_gemma3_lora_under_zero3_resumes_exactly_and_exports(tmp_path):
    config = tiny_run_config(
        tmp_path,
        name="gemma3",
        model={"config": dict(TINY_GEMMA3), "trainable": ["language_model"], "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        data={"synthetic": {"task": "shapes", "examples": 160}, "max_seq_len": 48},
        train={"max_steps": 6, "micro_batch_size": 8, "lr": 1e-2, "warmup_steps": 1, "save_every": 3, "keep_last": 2},
        deepspeed={"zero_stage": 3},
        generate={"prompts": None, "max_new_tokens": 4},
    )
    path = write_config(tmp_path, config, "gemma3.yaml")
    assert_ok(zeropipe("train", path))
    run_dir = tmp_path / "runs" / "gemma3"
    reference = {row["step"]: row["loss"] for row in metrics(run_dir)}
    assert reference[6] < reference[1]

    parameters = json.loads((run_dir / "summary.json").read_text())["parameters"]
    assert parameters["parts"]["projector"]["trainable"] == parameters["parts"]["vision_tower"]["trainable"] == 0
    assert parameters["trainable"] == parameters["parts"]["language_model"]["trainable"] < parameters["total"] / 5
    assert parameters["trainable"] <= parameters["optimizer_state_elements"] <= parameters["trainable"] + PADDING
    # The end-of-run answers are about held-out synthetic images, with their true captions beside.
    generations = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert len(generations) == 3 and all(row["expected"].endswith("background") for row in generations)

    # Resume from the middle: the processor and the examples are reused, the losses are the same.
    result = zeropipe("train", path, "--resume", run_dir / "checkpoints" / "step_00000003")
    assert_ok(result)
    resumed = metrics(run_dir)
    assert [row["step"] for row in resumed] == list(range(1, 7))
    for row in resumed[3:]:
        assert row["loss"] == pytest.approx(reference[row["step"]], rel=1e-5, abs=1e-5), row["step"]

    export = tmp_path / "gemma3-merged"
    assert_ok(zeropipe_here("export", run_dir, "--out", export, "--merge", "--dtype", "fp32"))
    image = Path(generations[0]["image"])
    assert isinstance(generate_from_export(export, image), str)


def test_hub_style_parquet_with_embedded_image_bytes_trains(tmp_path):
    """A Hub image-text dataset as downloaded: data/train-*.parquet shards whose image column holds {bytes, path}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zeropipe.data.images import generate_shapes_dataset

    folder = generate_shapes_dataset(tmp_path / "shapes", 96, seed=0, resolution=32) / "1_shapes"
    rows = [{"image": {"bytes": png.read_bytes(), "path": None}, "text": png.with_suffix(".txt").read_text().strip()} for png in sorted(folder.glob("*.png"))]
    shards = tmp_path / "hub-dataset" / "data"
    shards.mkdir(parents=True)
    for index in range(2):
        pq.write_table(pa.Table.from_pylist(rows[index * 48 : (index + 1) * 48]), shards / f"train-0000{index}-of-00002.parquet", row_group_size=16)
    config = tiny_run_config(
        tmp_path,
        name="gemma3-parquet",
        model={"config": dict(TINY_GEMMA3), "trainable": ["language_model"], "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        data={"synthetic": None, "path": str(tmp_path / "hub-dataset"), "max_seq_len": 48},
        train={"max_steps": 4, "micro_batch_size": 8, "lr": 1e-2, "warmup_steps": 1},
        deepspeed={"zero_stage": 2},
        generate={"prompts": [], "max_new_tokens": 4},
    )
    result = zeropipe("train", write_config(tmp_path, config, "gemma3-parquet.yaml"))
    assert_ok(result)
    assert "96 image-text examples" in result.stderr and "embedded images written" in result.stderr, result.stderr[-2000:]
    run_dir = tmp_path / "runs" / "gemma3-parquet"
    losses = {row["step"]: row["loss"] for row in metrics(run_dir) if row.get("kind") is None}
    assert len(losses) == 4 and losses[4] < losses[1], losses
    assert len(list((run_dir / "data" / "images").glob("*.png"))) == 96
