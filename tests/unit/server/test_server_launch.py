"""Launching from the API starts a real, detached `zeropipe train`; stop and early failures are recorded.

These start the launcher process but never get as far as training, so they take seconds.
"""

from __future__ import annotations

import json
import time

import psutil
import pytest
import yaml
from fastapi.testclient import TestClient

from tests.e2e.fake_runs import TINY_CONFIG
from zeropipe.server import create_app
from zeropipe.store import Roots, RunStore


@pytest.fixture
def store(tmp_path):
    (tmp_path / "data").mkdir()
    store = RunStore(Roots(runs=[tmp_path / "runs"], data=[tmp_path / "data"], base=tmp_path))
    yield store
    for launch in store.db.launches(open_only=True):  # never leave a launcher behind
        try:
            psutil.Process(launch["pid"]).kill()
        except psutil.Error:
            pass
    store.close()


@pytest.fixture
def client(store):
    with TestClient(create_app(store, refresh_interval=None), base_url="http://127.0.0.1") as client:
        yield client


def tiny(name: str, **sections) -> dict:
    raw = json.loads(json.dumps(TINY_CONFIG))
    raw["run"] = {"name": name}
    for section, values in sections.items():
        raw[section] = values
    return raw


def wait_for_state(store, run_id, states, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        store.refresh(scan=False)
        run = store.run(run_id)
        if run["state"] in states:
            return run
        time.sleep(0.3)
    raise AssertionError(f"run {run_id} still {store.run(run_id)['state']} after {timeout}s")


@pytest.mark.timeout(180)
def test_a_launched_run_is_detached_recorded_and_stopped(client, store, tmp_path):
    response = client.post("/api/runs", json={"yaml": yaml.safe_dump(tiny("from-ui"))})
    assert response.status_code == 201, response.text
    run = response.json()["run"]
    assert run["state"] == "starting" and run["origin"] == "ui" and run["path"] == str(tmp_path / "runs" / "from-ui")
    (launch,) = store.db.launches(run["id"])
    process = psutil.Process(launch["pid"])
    assert process.cmdline()[1:4] == ["-m", "zeropipe", "train"]
    # Its own session: a Ctrl-C in the UI's terminal, or the UI exiting, does not reach it.
    assert process.pid == psutil.Process(launch["pid"]).pid and __import__("os").getsid(process.pid) == process.pid
    config_file = tmp_path / "runs" / "configs" / "from-ui.yaml"
    saved = yaml.safe_load(config_file.read_text())
    assert launch["config_path"] == str(config_file) and saved["run"]["output_dir"] == str(tmp_path / "runs")
    assert client.post("/api/runs", json={"yaml": yaml.safe_dump(tiny("from-ui"))}).status_code == 409  # already starting

    response = client.post(f"/api/runs/{run['id']}/stop", json={})
    assert response.status_code == 200, response.text
    stopped = wait_for_state(store, run["id"], {"stopped", "failed", "completed"})
    assert stopped["state"] == "stopped"
    assert not psutil.pid_exists(launch["pid"]) or psutil.Process(launch["pid"]).status() == psutil.STATUS_ZOMBIE
    assert (tmp_path / "runs" / "from-ui" / "logs" / "launcher.log").is_file()


@pytest.mark.timeout(300)
def test_a_launcher_that_fails_before_any_rank_starts_is_diagnosed(client, store, tmp_path):
    bad = tmp_path / "data" / "broken.jsonl"
    bad.write_text("this is not json\n" * 50)
    raw = tiny("bad-data", data={"path": "data/broken.jsonl", "max_seq_len": 32})
    response = client.post("/api/runs", json={"yaml": yaml.safe_dump(raw)})
    assert response.status_code == 201, response.text
    run = wait_for_state(store, response.json()["run"]["id"], {"failed", "completed", "stopped"}, timeout=240)
    assert run["state"] == "failed"
    text = run["diagnosis"]["text"]
    assert "zeropipe train exited with code 2 before any rank started" in text
    assert "all 50 records are malformed" in text and "Fix the file" in text  # the data error itself, with its fix
