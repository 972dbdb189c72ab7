"""A config from the UI names no path outside the runs and data folders, wherever the path hides;
no file outside them is served, whatever symlinks the runs folder holds."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from fastapi.testclient import TestClient

from tests.e2e.fake_runs import TINY_CONFIG, write_run
from zeropipe.server import create_app
from zeropipe.store import RunStore


def tiny(**sections):
    raw = json.loads(json.dumps(TINY_CONFIG))
    raw["run"] = {"name": "tiny"}
    for dotted, value in sections.items():
        *parents, last = dotted.split("__")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return raw


# Each of these was accepted without a word by /api/config/check (and the first wrote files into /some/dir).
OUTSIDE = [
    (
        "deepspeed__overrides",
        {"csv_monitor": {"enabled": True, "output_path": "OUT", "job_name": "x"}},
        "deepspeed.overrides.csv_monitor.output_path",
    ),
    ("deepspeed__overrides", {"tensorboard": {"enabled": True, "output_path": "OUT"}}, "deepspeed.overrides.tensorboard.output_path"),
    (
        "deepspeed__overrides",
        {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "OUT"}}},
        "deepspeed.overrides.zero_optimization.offload_optimizer.nvme_path",
    ),
    ("deepspeed__overrides", {"some_future_key": {"anything": "OUT/secret"}}, "deepspeed.overrides.some_future_key.anything"),
    ("data__cache__dir", "OUT", "data.cache.dir"),
    ("model__processor", "/etc", "model.processor"),
    ("data__vision__image_root", "/etc", "data.vision.image_root"),
    ("generate__images", ["data/ok.png", "/etc/passwd"], "generate.images[1]"),
    ("model__load_kwargs", {"cache_dir": "OUT"}, "model.load_kwargs.cache_dir"),
    ("model__load_kwargs", {"offload_folder": "../../elsewhere"}, "model.load_kwargs.offload_folder"),
    # Not confined at all before issue 26 (defect 4).
    ("data__control_path", "/etc", "data.control_path"),
    ("model__diffusion__denoiser_file", "/etc/shadow", "model.diffusion.denoiser_file"),
]


@pytest.mark.parametrize("dotted, value, key", OUTSIDE, ids=[case[2] for case in OUTSIDE])
def test_every_path_a_config_names_is_confined(client, tmp_path, dotted, value, key):
    outside = tmp_path / "outside"
    value = json.loads(json.dumps(value).replace("OUT", str(outside)))
    result = client.post("/api/config/check", json={"config": tiny(**{dotted: value})}).json()
    assert not result["valid"]
    messages = {p["key"]: p["message"] for p in result["problems"]}
    assert key in messages, result["problems"]
    assert "outside the folders this UI may read and write" in messages[key] and "--data-dir" in messages[key]


def test_paths_inside_the_folders_pass(client, tmp_path):
    raw = tiny(
        deepspeed__overrides={
            "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "runs" / "csv"), "job_name": "x"},
            "zero_optimization": {"reduce_bucket_size": 5e7},
        },
        model__load_kwargs={"revision": "main", "cache_dir": "data/hf-cache"},
    )
    result = client.post("/api/config/check", json={"config": raw}).json()
    assert result["problems"] == [], result["problems"]


def test_a_launch_with_a_monitor_writing_outside_starts_nothing_and_writes_nothing(client, store, tmp_path):
    outside = tmp_path / "outside"
    raw = tiny(deepspeed__overrides={"csv_monitor": {"enabled": True, "output_path": str(outside), "job_name": "x"}})
    response = client.post("/api/runs", json={"yaml": yaml.safe_dump(raw)})
    assert response.status_code == 422
    assert "deepspeed.overrides.csv_monitor.output_path" in {p["key"] for p in response.json()["problems"]}
    assert store.db.launches() == [] and not outside.exists()


def test_paths_hidden_in_curriculum_stages_are_confined(client, tmp_path):
    raw = tiny(
        stages=[
            {
                "name": "one",
                "model": {"load_kwargs": {"cache_dir": "/var/tmp"}},
                "deepspeed": {"overrides": {"csv_monitor": {"output_path": "/tmp/x"}}},
            }
        ]
    )
    result = client.post("/api/config/check", json={"config": raw}).json()
    keys = {p["key"] for p in result["problems"]}
    assert {"stages[0].model.load_kwargs.cache_dir", "stages[0].deepspeed.overrides.csv_monitor.output_path"} <= keys


@pytest.mark.parametrize("where", ["model__load_kwargs", "stages"])
def test_trust_remote_code_is_refused_unless_the_server_allows_it(store, tmp_path, where):
    if where == "stages":
        raw = tiny(stages=[{"name": "one", "model": {"load_kwargs": {"trust_remote_code": True}}}])
        key = "stages[0].model.load_kwargs.trust_remote_code"
    else:
        raw = tiny(model__load_kwargs={"trust_remote_code": True})
        key = "model.load_kwargs.trust_remote_code"
    with TestClient(create_app(store, refresh_interval=None), base_url="http://127.0.0.1") as client:
        result = client.post("/api/config/check", json={"config": raw}).json()
    problem = next(p for p in result["problems"] if p["key"] == key)
    assert "--allow-remote-code" in problem["message"]
    allowing = RunStore(store.roots, tmp_path / "other.sqlite3", allow_remote_code=True)
    with TestClient(create_app(allowing, refresh_interval=None), base_url="http://127.0.0.1") as client:
        result = client.post("/api/config/check", json={"config": raw}).json()
    allowing.close()
    assert key not in {p["key"] for p in result["problems"]}


def test_zeropipe_ui_has_the_allow_remote_code_switch():
    from zeropipe.cli.main import build_parser

    assert build_parser().parse_args(["ui", "--allow-remote-code"]).allow_remote_code is True
    assert build_parser().parse_args(["ui"]).allow_remote_code is False


# ----------------------------------------------------------------- symlinks in the runs folder
def test_a_config_symlinked_out_of_its_run_is_not_served(client, store, tmp_path):
    secret = tmp_path / "secret.yaml"
    secret.write_text("password: hunter2\n")
    run = write_run(store.roots.primary_runs, "linked", steps=3, checkpoints=())
    (run / "config.yaml").unlink()
    os.symlink(secret, run / "config.yaml")
    os.symlink(secret, run / "logs" / "launcher.log")
    store.refresh()
    run_id = store.run("linked")["id"]
    response = client.get(f"/api/runs/{run_id}/config")
    assert "hunter2" not in response.text
    assert response.status_code in (403, 404) or response.json()["yaml"] is None
    response = client.get(f"/api/runs/{run_id}/logs/launcher")
    assert "hunter2" not in response.text and response.status_code in (403, 404)


def test_run_files_symlinked_out_of_their_run_are_read_as_missing(client, store, tmp_path):
    secret = "hunter2-plan"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "run.json").write_text(json.dumps({"world_size": 64, "total_steps": 999, "accelerator": secret}))
    (outside / "summary.json").write_text(json.dumps({"steps": 999, "first_loss": 1.0, "final_loss": 0.5, "note": secret}))
    (outside / "status.json").write_text(json.dumps({"state": "failed", "diagnosis": {"text": secret}}))
    run = write_run(store.roots.primary_runs, "linked", steps=3, checkpoints=())
    for name in ("run.json", "summary.json", "status.json"):
        (run / name).unlink(missing_ok=True)
        os.symlink(outside / name, run / name)
    store.refresh()
    listed = client.get("/api/runs").json()["runs"]
    assert [r["name"] for r in listed] == ["linked"] and listed[0]["total_steps"] is None and secret not in json.dumps(listed)
    detail = client.get(f"/api/runs/{listed[0]['id']}")
    assert detail.status_code == 200 and secret not in detail.text
    assert detail.json()["plan"] is None and detail.json()["summary"] is None and detail.json()["status"] is None


def test_a_run_folder_that_is_a_symlink_to_elsewhere_is_not_indexed(client, store, tmp_path):
    elsewhere = write_run(tmp_path / "elsewhere", "private", steps=3, checkpoints=())
    (elsewhere / "logs" / "rank0.log").write_text("private log line\n")
    os.symlink(elsewhere, store.roots.primary_runs / "innocent")
    store.refresh()
    runs = client.get("/api/runs").json()["runs"]
    assert runs == [] and "private" not in json.dumps(runs)


def test_a_run_indexed_at_an_outside_path_by_an_older_version_is_dropped(client, store, tmp_path):
    elsewhere = write_run(tmp_path / "elsewhere", "private", steps=3, checkpoints=())
    run_id = store.db.insert_run(
        path=str(elsewhere), name="private", root=str(store.roots.primary_runs), origin="cli", state="completed", created_at=0
    )
    store.refresh()
    assert client.get(f"/api/runs/{run_id}/logs/rank0").status_code == 404
    assert client.get(f"/api/runs/{run_id}/config").status_code == 404


def test_a_checkpoint_folder_symlinked_out_of_its_run_is_hidden_and_never_used(client, store, tmp_path):
    """Hidden from the run page's list, and refused by export, eval, resume and generate (issue 26, defect 4)."""
    run = write_run(store.roots.primary_runs, "linked", steps=12, total_steps=20, checkpoints=(6,))
    elsewhere = write_run(tmp_path / "elsewhere", "private", steps=12, checkpoints=(12,))
    os.symlink(elsewhere / "checkpoints" / "step_00000012", run / "checkpoints" / "step_00000012")
    store.refresh()
    run_id = store.run("linked")["id"]
    assert [c["tag"] for c in client.get(f"/api/runs/{run_id}").json()["checkpoints"]] == ["step_00000006"]
    for path, body in (("export", {"checkpoint": "step_00000012"}), ("eval", {"checkpoint": "step_00000012", "data": "x"}), ("resume", {"checkpoint": "step_00000012", "confirm": True})):
        response = client.post(f"/api/runs/{run_id}/{path}", json=body)
        assert response.status_code == 403 and "leads outside the run directory" in response.json()["detail"], (path, body, response.text)
    response = client.post("/api/generate", json={"run_id": run_id, "checkpoint": "step_00000012", "prompt": "hi"})
    assert response.status_code == 403
    assert not (run / "exports").exists()  # nothing was started


MULTINODE = [
    ("nodes", ["localhost", "box2"]),
    ("hostfile", "data/hosts"),
    ("ssh_options", "-l trainer"),
    ("ssh_port", 2222),
    ("launcher", "ssh"),
    ("master_addr", "10.0.0.1"),
]


@pytest.mark.parametrize("field, value", MULTINODE, ids=[case[0] for case in MULTINODE])
def test_fields_that_choose_where_commands_run_are_refused_unless_trusted(store, tmp_path, field, value):
    """Issue 26, defect 1: each of them decides which machines are started over ssh/srun, with this user's keys."""
    (tmp_path / "data" / "hosts").write_text("localhost slots=1\nbox2 slots=1\n")
    raw = tiny(hardware={"gpus": 1, field: value})
    with TestClient(create_app(store, refresh_interval=None), base_url="http://127.0.0.1") as client:
        result = client.post("/api/config/check", json={"config": raw}).json()
        launched = client.post("/api/runs", json={"config": raw})
    assert not result["valid"] and f"hardware.{field}" in {p["key"] for p in result["problems"]}
    assert launched.status_code == 422 and "--trust-multinode" in launched.json()["detail"]
    trusting = RunStore(store.roots, tmp_path / "trusting.sqlite3", trust_multinode=True)
    trusting.validate(raw)  # raises ConfigError on any problem
    assert f"hardware.{field}" not in {key for key, _ in config_problems(trusting, raw)}
    trusting.close()


def config_problems(store, raw) -> list[tuple[str, str]]:
    from zeropipe.store.sandbox import config_path_problems

    return config_path_problems(raw, store.roots, allow_multinode=store.trust_multinode)
