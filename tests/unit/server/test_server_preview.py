"""Dataset preview: records as the trainer sees them (format, template, masked prompt), and the ones it skips."""

from __future__ import annotations

import json

import pytest

MODEL = {
    "config": {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
}


def alpaca_file(path, broken=True):
    lines = [json.dumps({"instruction": f"What is {i} + {i}?", "input": "", "output": str(2 * i)}) for i in range(40)]
    if broken:
        lines.insert(3, '{"instruction": "cut off", "output": ')
        lines.insert(7, json.dumps({"instruction": "no answer here"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def preview(client, **data):
    config = {"run": {"name": "p"}, "model": MODEL, "data": {"max_seq_len": 32, **data}}
    return client.post("/api/data/preview", json={"config": config, "limit": 5})


def test_the_first_records_with_the_prompt_masked_and_the_skipped_ones_with_reasons(client, tmp_path):
    alpaca_file(tmp_path / "data" / "train.jsonl")
    response = preview(client, path="data/train.jsonl")
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["format"] == "alpaca" and data["format_detected"] and data["records"] == 42
    first = data["examples"][0]
    assert first["line"] == 1 and len(data["examples"]) == 5
    prompt, learned = [p for p in first["pieces"] if not p["loss"]], [p for p in first["pieces"] if p["loss"]]
    assert "What is 0 + 0?" in "".join(p["text"] for p in prompt) and "0" in learned[0]["text"]
    assert first["loss_tokens"] == sum(p["tokens"] for p in learned) and first["tokens"] == sum(p["tokens"] for p in first["pieces"])
    assert data["skipped"] == [
        {"file": "", "line": 4, "reason": "not valid JSON (Expecting value at column 38)"},
        {"file": "", "line": 8, "reason": "missing key 'output' (alpaca format)"},
    ]
    assert data["verdict"]["starts"] is False and "data.max_bad_fraction" in data["verdict"]["text"]
    ok = preview(client, path="data/train.jsonl", max_bad_fraction=0.1).json()
    assert ok["verdict"]["starts"] is True


def test_a_tokenizers_chat_template_is_what_the_preview_renders(client, tmp_path):
    from zeropipe.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer([f"What is {i}?" for i in range(100)], 300, tmp_path / "data" / "tok")
    tokenizer.chat_template = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<<assistant>> {% endif %}"
    tokenizer.save_pretrained(str(tmp_path / "data" / "tok"))
    chat = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]} for i in range(5)]
    (tmp_path / "data" / "chat.jsonl").write_text("\n".join(map(json.dumps, chat)) + "\n")
    response = client.post(
        "/api/data/preview", json={"config": {"run": {"name": "p"}, "model": {**MODEL, "tokenizer": "data/tok"}, "data": {"path": "data/chat.jsonl"}}}
    )
    data = response.json()
    assert response.status_code == 200 and data["format"] == "chat" and "its chat template" in data["tokenizer"]
    text = "".join(p["text"] for p in data["examples"][0]["pieces"])
    assert "<<user>> hi 0" in text and "<<assistant>>" in text
    learned = "".join(p["text"] for p in data["examples"][0]["pieces"] if p["loss"])
    assert "hello 0" in learned and "hi 0" not in learned


def test_long_examples_are_shown_cut_where_the_trainer_cuts_them(client, tmp_path):
    (tmp_path / "data" / "long.jsonl").write_text(json.dumps({"instruction": "say it " * 40, "output": "ok"}) + "\n")
    data = preview(client, path="data/long.jsonl", max_seq_len=16).json()
    assert data["examples"][0]["truncated"] and data["examples"][0]["tokens"] == 16


def test_generated_data_can_be_previewed(client):
    data = preview(client, synthetic={"task": "arithmetic", "examples": 50}).json()
    assert data["source"].startswith("generated arithmetic") and data["records"] == 50 and data["skipped"] == []


@pytest.mark.parametrize("data, status, words", [
    ({"path": "/etc/passwd"}, 422, "outside the folders"),
    ({"path": "data/nothing.jsonl"}, 422, "does not exist"),
])  # fmt: skip
def test_data_the_preview_may_not_or_cannot_read_is_a_message(client, data, status, words):
    response = preview(client, **data)
    assert response.status_code == status and words in response.text, response.text


def test_an_image_folder_shows_thumbnails_captions_buckets_and_broken_images(client, tmp_path):
    from PIL import Image

    folder = tmp_path / "data" / "pics"
    folder.mkdir()
    Image.new("RGB", (96, 48), "red").save(folder / "wide.png")
    (folder / "wide.txt").write_text("a red banner")
    Image.new("RGB", (48, 48), "blue").save(folder / "square.png")
    (folder / "square.txt").write_text("a blue tile")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (folder / "broken.txt").write_text("never seen")
    config = {
        "run": {"name": "p"},
        "model": {"config": {"pipeline": "tiny-sdxl"}},
        "data": {"path": "data/pics", "images": {"resolution": 64, "bucket_step": 8}},
    }
    response = client.post("/api/data/preview", json={"config": config})
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["family"] == "diffusion" and data["layout"] == "flat" and data["records"] == 3
    by_file = {image["file"]: image for image in data["images"]}
    assert by_file["wide.png"]["caption"] == "a red banner" and by_file["wide.png"]["bucket"][0] > by_file["wide.png"]["bucket"][1]
    assert by_file["square.png"]["bucket"][0] == by_file["square.png"]["bucket"][1]
    assert by_file["wide.png"]["thumbnail"].startswith("data:image/png;base64,")
    assert [s["file"].endswith("broken.png") for s in data["skipped"]] == [True] and data["skipped_count"] == 1
    assert sum(data["buckets"].values()) == 2
