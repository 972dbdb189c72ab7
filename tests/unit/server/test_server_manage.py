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
    response = client.get(f"/api/runs/{run['id']}/exports/hf/archive")
    assert response.status_code == 200 and response.headers["content-type"] == "application/x-tar"
    assert 'filename="done-hf.tar"' in response.headers["content-disposition"]
    assert int(response.headers["content-length"]) == len(response.content)
    with tarfile.open(fileobj=io.BytesIO(response.content)) as archive:
        names = sorted(archive.getnames())
        assert names == ["done-hf/config.json", "done-hf/model.safetensors", "done-hf/tokenizer/tokenizer.json"]
        assert archive.extractfile("done-hf/model.safetensors").read() == (out / "model.safetensors").read_bytes()
    # A link in the export is never followed, and the archive is not sent without it silently (issue 46): refused with its name.
    (tmp_path / "secret.txt").write_text("hunter2")
    os.symlink(tmp_path / "secret.txt", out / "leak.txt")
    response = client.get(f"/api/runs/{run['id']}/exports/hf/archive")
    assert response.status_code == 409 and "export hf holds leak.txt as a link" in response.text, response.text
    assert "hunter2" not in response.text and str(tmp_path) not in response.text


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


def launched_from_ui(store, run):
    """What Launch leaves: RUNS/configs/NAME.yaml, and the train launch that ran it."""
    configs = store.roots.primary_runs / "configs"
    configs.mkdir(exist_ok=True)
    config_path = configs / f"{run['name']}.yaml"
    config_path.write_text("# Launched from zeropipe ui.\n" + yaml.safe_dump({"run": {"name": run["name"], "output_dir": str(store.roots.primary_runs)}}))
    store.db.insert_launch(run_id=run["id"], action="train", pid=999999, command=["zeropipe", "train", str(config_path)], log_path=str(store.roots.primary_runs / run["name"] / "logs" / "launcher.log"),
                           config_path=str(config_path), started_at=time.time(), ended_at=time.time(), exit_code=0)  # fmt: skip
    return config_path


def test_rename_and_delete_take_the_launch_config_along(client, store):
    """RUNS/configs/<old>.yaml stayed behind: rerunning it started a new run under the old name."""
    run = add(store, "first-try", steps=12)
    launched = launched_from_ui(store, run)
    assert client.post(f"/api/runs/{run['id']}/rename", json={"name": "lr-1e-2"}).status_code == 200
    moved = launched.with_name("lr-1e-2.yaml")
    assert not launched.exists() and moved.is_file()
    assert yaml.safe_load(moved.read_text())["run"]["name"] == "lr-1e-2" and f"zeropipe train {moved}" in moved.read_text()
    assert client.request("DELETE", f"/api/runs/{run['id']}", json={"confirm": "lr-1e-2"}).status_code == 200
    assert not moved.exists()
    other = add(store, "unrelated", steps=3, checkpoints=())
    kept = store.roots.primary_runs / "configs" / "unrelated.yaml"
    kept.write_text("run: {name: unrelated}\n")  # not what launched it (started from the command line): left alone
    assert client.request("DELETE", f"/api/runs/{other['id']}", json={"confirm": "unrelated"}).status_code == 200
    assert kept.is_file()


def test_a_deleted_runs_id_is_not_given_to_the_next_run(client, store):
    """Run ids were reused after a delete: /runs/2 silently showed another run."""
    add(store, "a", steps=3, checkpoints=())
    b = add(store, "b", steps=3, checkpoints=())
    assert client.request("DELETE", f"/api/runs/{b['id']}", json={"confirm": "b"}).status_code == 200
    c = add(store, "c", steps=3, checkpoints=())
    assert c["id"] > b["id"]
    assert client.get(f"/api/runs/{b['id']}").status_code == 404


def test_compare_draws_the_runs_that_exist_and_names_the_missing_one(client, store):
    """One unknown id blanked the whole Compare page."""
    a = add(store, "a", steps=5, checkpoints=())
    response = client.get("/api/compare", params={"ids": f"{a['id']},4242"})
    assert response.status_code == 200
    assert [r["name"] for r in response.json()["runs"]] == ["a"] and response.json()["missing"] == [4242]
    assert client.get("/api/compare", params={"ids": "4242"}).status_code == 404


def as_diffusion_run(store, run):
    config_file = store.roots.primary_runs / run["name"] / "config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["model"] = {"family": "diffusion", "config": {"pipeline": "tiny-sdxl"}}
    config_file.write_text(yaml.safe_dump(config))


def test_the_run_says_what_its_family_can_do(client, store):
    """Diffusion runs offered Generate and Evaluate, which always failed."""
    llm = add(store, "llm", steps=12)
    sd = add(store, "sd", steps=12)
    as_diffusion_run(store, sd)
    actions = client.get(f"/api/runs/{llm['id']}").json()["actions"]
    assert actions["generate"]["available"] and actions["evaluate"]["available"]
    actions = client.get(f"/api/runs/{sd['id']}").json()["actions"]
    assert not actions["generate"]["available"] and "sample gallery" in actions["generate"]["reason"]
    assert not actions["evaluate"]["available"] and "held-out" in actions["evaluate"]["reason"]
    # A diffusion run that held images out: its validation loss (issue 44).
    plan = store.roots.primary_runs / "sd" / "data" / "diffusion.json"
    plan.parent.mkdir(exist_ok=True)
    plan.write_text('{"eval_items": [3, 7]}')
    assert client.get(f"/api/runs/{sd['id']}").json()["actions"]["evaluate"]["available"]


def test_a_starting_run_says_what_it_is_doing_until_its_first_step(client, store):
    """A starting diffusion run showed nothing for 2.5 minutes while it built its pipeline and filled its caches."""
    from zeropipe.rundir import RunDir

    run = add(store, "warming", state="running", steps=0, total_steps=40, checkpoints=(), supervisor_pid=live_pid())
    run_dir = RunDir(store.roots.primary_runs / "warming")
    time.sleep(0.01)
    run_dir.write_progress("caching latents", 40, 240)
    progress = client.get(f"/api/runs/{run['id']}").json()["progress"]
    assert progress["phase"] == "caching latents" and (progress["done"], progress["total"]) == (40, 240)
    time.sleep(0.01)
    run_dir.metrics.write_text(run_dir.metrics.read_text() + '{"step": 1, "loss": 2.0}\n')  # the first step: training now
    assert client.get(f"/api/runs/{run['id']}").json()["progress"] is None
    done = add(store, "done", steps=3, checkpoints=())
    RunDir(store.roots.primary_runs / "done").write_progress("caching latents", 1, 2)
    assert client.get(f"/api/runs/{done['id']}").json()["progress"] is None  # an ended run prepares nothing


def test_the_runs_list_says_when_a_resumed_run_first_started_and_for_how_long(client, store):
    """The list showed the last resume as "started" and no duration."""
    import json

    run = add(store, "resumed", steps=12)
    path = store.roots.primary_runs / "resumed"
    first_row = json.loads((path / "metrics.jsonl").read_text().splitlines()[0])
    status = json.loads((path / "status.json").read_text())
    status.update(started_at=first_row["time"] + 3600, ended_at=first_row["time"] + 3700)  # resumed an hour later
    (path / "status.json").write_text(json.dumps(status))
    store.refresh()
    shown = next(r for r in client.get("/api/runs").json()["runs"] if r["id"] == run["id"])
    assert shown["started_at"] == first_row["time"] + 3600
    assert abs(shown["first_started_at"] - (first_row["time"] - first_row["step_time_s"])) < 1e-6
    assert abs(shown["duration_s"] - (3700 + first_row["step_time_s"])) < 1e-3
