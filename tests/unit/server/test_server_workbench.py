"""The Chat endpoint's bounds and refusals, and the one policy for a model loaded in the UI process (no real model)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from tests.e2e.fake_runs import write_run
from zeropipe.server import create_app
from zeropipe.server import generation as generation_module
from zeropipe.store import Roots, RunStore


@pytest.fixture
def client(tmp_path):
    store = RunStore(Roots(runs=[tmp_path / "runs"], base=tmp_path))
    write_run(store.roots.primary_runs, "done", steps=12)
    store.refresh()
    with TestClient(create_app(store, refresh_interval=None), base_url="http://127.0.0.1") as client:
        yield client
    store.close()


def turns(count: int) -> list[dict]:
    out = []
    for index in range(count):
        out += [{"role": "user", "content": f"question {index}"}, {"role": "assistant", "content": f"answer {index}"}]
    return out + [{"role": "user", "content": "last"}]


@pytest.mark.parametrize("body, status, words", [
    ({"run_id": 1, "messages": []}, 422, "messages"),
    ({"run_id": 1, "messages": [{"role": "assistant", "content": "hi"}]}, 422, "end with the user turn"),
    ({"run_id": 1, "messages": [{"role": "system", "content": "hi"}]}, 422, "role"),
    ({"run_id": 1, "messages": turns(40)}, 422, "messages"),
    ({"run_id": 1, "messages": [{"role": "user", "content": "x" * 8001}]}, 422, "content"),
    ({"run_id": 1, "messages": [{"role": "user", "content": "x" * 8000}] * 9}, 422, "more than 64000 characters"),
    ({"run_id": 1, "system": "x" * 4001, "messages": [{"role": "user", "content": "hi"}]}, 422, "system"),
    ({"run_id": 1, "messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 5000}, 422, "max_new_tokens"),
    ({"run_id": 1, "messages": [{"role": "user", "content": "hi"}], "checkpoint": "../../etc"}, 409, "not a checkpoint name"),
    ({"run_id": 1, "messages": [{"role": "user", "content": "hi"}], "path": "/etc"}, 422, "path"),
    ({"run_id": 424242, "messages": [{"role": "user", "content": "hi"}]}, 404, "no run"),
])  # fmt: skip
def test_a_conversation_is_bounded_and_names_only_a_runs_weights(client, body, status, words):
    response = client.post("/api/chat", json=body)
    assert response.status_code == status, response.text
    assert words in response.json()["detail"]


def test_chatting_is_a_post_from_this_ui(client):
    assert client.get("/api/chat").status_code == 405
    response = client.post("/api/chat", json={"run_id": 1, "messages": [{"role": "user", "content": "hi"}]}, headers={"Origin": "http://evil.example"})
    assert response.status_code == 403


def test_the_loaded_model_says_where_it_runs(client):
    state = client.get("/api/model").json()
    assert state["loaded"] is None and (state["device"] == "cpu" or state["device"].startswith("cuda:"))
    assert state["idle_seconds"] == 300 and state["device_reason"]


def test_an_idle_model_is_let_go(monkeypatch, tmp_path):
    """One cached model: loaded on the policy's device, kept for the next prompt, unloaded after its idle time."""
    loads = []

    def fake_load(path, checkpoint=None, device=None):
        loads.append((str(path), checkpoint, device))
        return SimpleNamespace(device=SimpleNamespace(type="cpu"), source=SimpleNamespace(describe=lambda: f"{path}"))

    from zeropipe import families

    monkeypatch.setattr(families, "load_model", fake_load)
    monkeypatch.setenv("ZEROPIPE_UI_MODEL_IDLE_SECONDS", "1")
    generator = generation_module.Generator()
    generator.model(tmp_path / "a", "step_1")
    generator.model(tmp_path / "a", "step_1")
    assert len(loads) == 1 and loads[0][2] == generation_module.model_device()[0]
    assert generator.state()["loaded"] == str(tmp_path / "a")
    deadline = time.time() + 10
    while generator.loaded is not None and time.time() < deadline:
        time.sleep(0.1)
    assert generator.loaded is None and generator.state()["loaded"] is None
    generator.model(tmp_path / "b", None)  # asked again: loaded again
    assert len(loads) == 2


def test_conversations_render_whole_and_refuse_what_cannot_be_answered():
    from zeropipe.errors import ZeroPipeError
    from zeropipe.export.generate import as_messages, check_context

    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    assert as_messages(conversation) == conversation and as_messages("hi") == [{"role": "user", "content": "hi"}]
    with pytest.raises(ZeroPipeError, match="end with a user turn"):
        as_messages(conversation[:3])
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    check_context(model, 56, 8)
    with pytest.raises(ZeroPipeError, match="reads at most 64: start a new conversation"):
        check_context(model, 57, 8)


# ------------------------------------------------------------------ sample now, draw, dataset
def test_sample_now_is_refused_for_a_run_that_is_not_training(client, tmp_path):
    response = client.post("/api/runs/1/sample", json={})
    assert response.status_code == 409 and "not training" in response.json()["detail"], response.text
    assert not (tmp_path / "runs" / "done" / "sample_request.json").exists()


@pytest.mark.parametrize("body, status, words", [
    ({"run_id": 1, "prompt": ""}, 422, "prompt"),
    ({"run_id": 1, "prompt": "x", "width": 4096}, 422, "width"),
    ({"run_id": 1, "prompt": "x", "width": 36}, 422, "multiple of 8"),
    ({"run_id": 1, "prompt": "x", "width": 2048, "height": 2048, "frames": 2}, 422, "over 4,194,304 pixels"),
    ({"run_id": 1, "prompt": "x", "steps": 1000}, 422, "steps"),
    ({"run_id": 1, "prompt": "x", "checkpoint": "../../etc"}, 409, "not a checkpoint name"),
    ({"run_id": 1, "prompt": "x", "export": "../checkpoints"}, 404, "no export"),
    ({"run_id": 1, "prompt": "x", "path": "/etc"}, 422, "path"),
])  # fmt: skip
def test_a_drawing_is_bounded_and_names_only_a_runs_weights(client, body, status, words):
    response = client.post("/api/draw", json=body)
    assert response.status_code == status, response.text
    assert words in response.json()["detail"]


def test_a_drawing_s_files_are_served_only_from_the_run_s_draws(client, tmp_path):
    assert client.get("/api/runs/1/draws").json()["draws"] == []
    assert client.get("/api/runs/1/draws/draw-20260101-000000-000/..%2F..%2Fconfig.yaml").status_code in (404, 422)
    assert client.get("/api/runs/1/draws/..%2F..%2F/config.yaml").status_code in (404, 422)
    folder = tmp_path / "runs" / "done" / "draws" / "draw-20260101-000000-000"
    folder.mkdir(parents=True)
    (folder / "image.png").write_bytes(b"\x89PNG")
    assert client.get("/api/runs/1/draws/draw-20260101-000000-000/image.png").content == b"\x89PNG"
    (tmp_path / "secret.png").write_bytes(b"secret")
    (folder / "link.png").symlink_to(tmp_path / "secret.png")
    assert client.get("/api/runs/1/draws/draw-20260101-000000-000/link.png").status_code == 404


def test_the_dataset_view_reads_only_the_folders_the_ui_may_read(tmp_path):
    from PIL import Image

    store = RunStore(Roots(runs=[tmp_path / "runs"], data=[tmp_path / "data"], base=tmp_path))
    folder = tmp_path / "data" / "images"
    folder.mkdir(parents=True)
    Image.new("RGB", (64, 32)).save(folder / "a.png")
    (folder / "a.txt").write_text("a black field")
    (tmp_path / "outside.txt").write_text("private words")
    Image.new("RGB", (32, 32)).save(folder / "b.png")
    (folder / "b.txt").symlink_to(tmp_path / "outside.txt")  # a caption that leads out
    (folder / "c.png").write_bytes(b"not a png")
    with TestClient(create_app(store, refresh_interval=None), base_url="http://127.0.0.1") as client:
        assert client.post("/api/dataset", json={"path": "/etc"}).status_code == 403
        assert client.post("/api/dataset", json={"path": str(folder), "caption_ext": "../x"}).status_code == 422
        data = client.post("/api/dataset", json={"path": str(folder), "resolution": 64, "bucket_step": 16}).json()
    store.close()
    # b.png is rejected unread, as a run launched by the UI skips it (issue 46: its caption was read in full before).
    assert data["usable"] == 1 and data["layout"] == "flat"
    rejected = {r["file"]: r["reason"] for r in data["rejected"]}
    assert rejected["c.png"].startswith("not an image") and "outside" in rejected["b.png"]
    captions = {f["file"]: f["caption"] for f in data["files"]}
    assert captions["a.png"] == "a black field" and "private words" not in str(data)
    assert sum(b["files"] for b in data["buckets"].values()) == 1
