"""Run management: delete (with its checkpoints, confirmed by name), rename, download an export as an archive."""

from __future__ import annotations

import io
import os
import tarfile
import time

import pytest
import yaml

from tests.e2e.fake_runs import live_pid, write_run


def add(store, name, **kwargs):
    write_run(store.roots.primary_runs, name, **kwargs)
    store.refresh()
    return store.run(name)


def test_delete_needs_the_runs_name_and_takes_its_checkpoints(client, store):
    run = add(store, "old", steps=12, checkpoints=(6, 12))
    path = store.roots.primary_runs / "old"
    assert (path / "checkpoints").is_dir()
    response = client.request("DELETE", f"/api/runs/{run['id']}", json={})
    assert response.status_code == 422
    response = client.request("DELETE", f"/api/runs/{run['id']}", json={"confirm": "other"})
    assert response.status_code == 409 and "confirm with its name" in response.json()["detail"]
    assert path.is_dir()
    response = client.request("DELETE", f"/api/runs/{run['id']}", json={"confirm": "old"})
    assert response.status_code == 200
    assert response.json()["checkpoints"] == 2 and response.json()["bytes"] > 0
    assert not path.exists() and not list(store.roots.primary_runs.glob(".deleting-*"))
    store.refresh()  # a later scan does not bring it back
    assert client.get("/api/runs").json()["runs"] == []
    assert client.get(f"/api/runs/{run['id']}").status_code == 404


def test_a_running_run_is_neither_deleted_nor_renamed(client, store):
    run = add(store, "live", state="running", steps=4, total_steps=40, supervisor_pid=live_pid())
    response = client.request("DELETE", f"/api/runs/{run['id']}", json={"confirm": "live"})
    assert response.status_code == 409 and "stop it before" in response.json()["detail"]
    response = client.post(f"/api/runs/{run['id']}/rename", json={"name": "other"})
    assert response.status_code == 409
    assert (store.roots.primary_runs / "live" / "metrics.jsonl").is_file()


def test_another_site_cannot_delete_a_run(client, store):
    run = add(store, "old", steps=3, checkpoints=())
    response = client.request(
        "DELETE", f"/api/runs/{run['id']}", json={"confirm": "old"}, headers={"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    )
    assert response.status_code == 403 and (store.roots.primary_runs / "old").is_dir()


def test_rename_moves_the_folder_and_the_config_follows(client, store):
    run = add(store, "first-try", steps=12)
    response = client.post(f"/api/runs/{run['id']}/rename", json={"name": "lr-1e-2"})
    assert response.status_code == 200 and response.json()["run"]["name"] == "lr-1e-2"
    root = store.roots.primary_runs
    assert not (root / "first-try").exists() and (root / "lr-1e-2" / "metrics.jsonl").is_file()
    config = yaml.safe_load((root / "lr-1e-2" / "config.yaml").read_text())
    assert config["run"]["name"] == "lr-1e-2", "resume reads the run's config.yaml: its run.name names the folder"
    detail = client.get(f"/api/runs/{run['id']}").json()
    assert detail["run"]["path"] == str(root / "lr-1e-2") and [c["tag"] for c in detail["checkpoints"]] == ["step_00000012", "step_00000006"]
    assert len(client.get(f"/api/runs/{run['id']}/metrics").json()["step"]) == 12
    store.refresh()
    assert [r["name"] for r in client.get("/api/runs").json()["runs"]] == ["lr-1e-2"]


@pytest.mark.parametrize("name, message", [("taken", "exists"), ("../up", "cannot be a folder name"), ("configs", "reserved")])
def test_rename_refuses_taken_and_bad_names(client, store, name, message):
    run = add(store, "mine", steps=3, checkpoints=())
    add(store, "taken", steps=3, checkpoints=())
    response = client.post(f"/api/runs/{run['id']}/rename", json={"name": name})
    assert response.status_code == 409 and message in response.json()["detail"]
    assert (store.roots.primary_runs / "mine").is_dir()


def finished_export(store, run, name="hf"):
    """An export folder as `zeropipe export` leaves it, recorded as the store records its export launches."""
    out = store.roots.primary_runs / run["name"] / "exports" / name
    out.mkdir(parents=True)
    (out / "config.json").write_text('{"model_type": "llama"}')
    (out / "model.safetensors").write_bytes(os.urandom(3000))
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / "tokenizer.json").write_text("{}")
    now = time.time()
    store.db.insert_launch(run_id=run["id"], action="export", pid=1, command=["zeropipe", "export"], log_path=str(out) + ".log", out_path=str(out),
                           started_at=now - 5, ended_at=now, exit_code=0, detail={"checkpoint": "step_00000012", "name": name})  # fmt: skip
    return out


def test_download_an_export_as_a_tar_archive(client, store, tmp_path):
    run = add(store, "done", steps=12)
    out = finished_export(store, run)
    (tmp_path / "secret.txt").write_text("hunter2")
    os.symlink(tmp_path / "secret.txt", out / "leak.txt")
    response = client.get(f"/api/runs/{run['id']}/exports/hf/archive")
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-tar"
    assert 'filename="done-hf.tar"' in response.headers["content-disposition"]
    assert int(response.headers["content-length"]) == len(response.content)
    with tarfile.open(fileobj=io.BytesIO(response.content)) as archive:
        names = sorted(archive.getnames())
        assert names == ["done-hf/config.json", "done-hf/model.safetensors", "done-hf/tokenizer/tokenizer.json"]
        assert archive.extractfile("done-hf/model.safetensors").read() == (out / "model.safetensors").read_bytes()
    assert b"hunter2" not in response.content


@pytest.mark.parametrize("name", ["nope", "..", "..%2F..%2Fcheckpoints", "hf%2F..%2F..%2Flogs"])
def test_only_finished_exports_are_downloaded(client, store, name):
    run = add(store, "done", steps=12)
    finished_export(store, run)
    response = client.get(f"/api/runs/{run['id']}/exports/{name}/archive")
    assert response.status_code == 404, response.text


# ------------------------------------------------------------------ evaluations
def test_evaluation_refusals_say_why(client, store, tmp_path):
    run = add(store, "done", steps=12)
    response = client.post(f"/api/runs/{run['id']}/eval", json={})
    assert response.status_code == 409 and "no held-out data" in response.json()["detail"]
    response = client.post(f"/api/runs/{run['id']}/eval", json={"data": "/etc/passwd"})
    assert response.status_code == 403 and "outside the folders" in response.json()["detail"]
    response = client.post(f"/api/runs/{run['id']}/eval", json={"data": "data/missing.jsonl"})
    assert response.status_code == 409 and "is not a file" in response.json()["detail"]
    response = client.post(f"/api/runs/{run['id']}/eval", json={"checkpoint": "step_00000099", "data": "data/x.jsonl"})
    assert response.status_code == 409 and "no complete checkpoint step_00000099" in response.json()["detail"]
    assert store.db.launches() == []
