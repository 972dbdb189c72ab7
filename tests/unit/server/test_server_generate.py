"""The Generate endpoint's refusals (no model needed): what it may load is a run's complete checkpoint or finished export."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.e2e.fake_runs import write_run
from zeropipe.server import create_app
from zeropipe.store import Roots, RunStore


@pytest.fixture
def client(tmp_path):
    store = RunStore(Roots(runs=[tmp_path / "runs"], base=tmp_path))
    write_run(store.roots.primary_runs, "done", steps=12)
    write_run(store.roots.primary_runs, "oom", state="failed", steps=5, total_steps=12, checkpoints=())
    store.refresh()
    with TestClient(create_app(store, refresh_interval=None), base_url="http://127.0.0.1") as client:
        yield client
    store.close()


@pytest.mark.parametrize("body, status, words", [
    ({"run_id": 424242, "prompt": "hi"}, 404, "no run"),
    ({"run_id": 2, "prompt": "hi"}, 409, "no complete checkpoint"),
    ({"run_id": 1, "prompt": "hi", "checkpoint": "step_00000099"}, 409, "no complete checkpoint step_00000099"),
    ({"run_id": 1, "prompt": "hi", "checkpoint": "../../etc"}, 409, "not a checkpoint name"),
    ({"run_id": 1, "prompt": "hi", "export": "../checkpoints"}, 404, "no export"),
    ({"run_id": 1, "prompt": "hi", "export": "hf"}, 404, "no finished export"),
    ({"run_id": 1, "prompt": ""}, 422, "prompt"),
    ({"run_id": 1, "prompt": "hi", "max_new_tokens": 100000}, 422, "max_new_tokens"),
    ({"run_id": 1, "prompt": "hi", "path": "/etc"}, 422, "path"),
])  # fmt: skip
def test_only_a_runs_own_weights_can_be_asked(client, body, status, words):
    response = client.post("/api/generate", json=body)
    assert response.status_code == status, response.text
    assert words in response.json()["detail"]


def test_generating_is_a_post_from_this_ui(client):
    assert client.get("/api/generate").status_code == 405
    response = client.post("/api/generate", json={"run_id": 1, "prompt": "hi"}, headers={"Origin": "http://evil.example"})
    assert response.status_code == 403


@pytest.mark.parametrize(
    "image, status, words", [("/etc/hostname", 403, "outside the folders"), ("runs/none.png", 409, "is not a file"), ("x\x00.png", 403, "NUL")]
)
def test_an_image_must_be_a_file_in_the_folders(client, image, status, words):
    response = client.post("/api/generate", json={"run_id": 1, "prompt": "hi", "image": image})
    assert response.status_code == status and words in response.json()["detail"], response.text
