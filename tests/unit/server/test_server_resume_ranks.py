"""The UI's Resume on another number of ranks: a count that keeps the global batch starts a real
`zeropipe train ... hardware.gpus=N --resume`; a count that cannot is refused before anything starts."""

from __future__ import annotations

import time

import psutil
import pytest
from fastapi.testclient import TestClient

from tests.e2e.fake_runs import write_run
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


def stopped_run(store):
    """A 2-rank run stopped at step 6 of 12: micro-batch 8 x accumulation 1 x 2 ranks, a global batch of 16."""
    path = write_run(store.roots.primary_runs, "halfway", state="stopped", steps=6, total_steps=12, checkpoints=(6,))
    # A ZeRO shard that is no checkpoint at all: the launcher's conversion must fail on it, fast.
    (path / "checkpoints" / "step_00000006" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not a tensor file")
    store.refresh()
    return store.run("halfway")


@pytest.mark.timeout(180)
def test_a_resume_on_another_rank_count_starts_the_launcher_with_it(client, store):
    run = stopped_run(store)
    response = client.post(f"/api/runs/{run['id']}/resume", json={"checkpoint": "step_00000006", "gpus": 1, "confirm": True})
    assert response.status_code == 200, response.text
    assert response.json()["run"]["state"] == "starting"
    (launch,) = store.db.launches(run["id"])
    command = launch["command"]
    assert command[command.index("train") + 2 :][:2] == ["hardware.gpus=1", "--resume"], command
    assert launch["detail"] == {"checkpoint": "step_00000006", "gpus": 1}
    # The launcher really takes the count: it gets past the rank check to converting the
    # checkpoint, which this fake checkpoint (no DeepSpeed shards) cannot be, and says so.
    log = store.run_dir(run).logs / "launcher.log"
    deadline = time.time() + 150
    while time.time() < deadline and "universal" not in (log.read_text() if log.is_file() else ""):
        time.sleep(0.5)
    text = log.read_text()
    assert "converting checkpoint step_00000006 to a universal checkpoint" in text and "is unchanged" in text, text[-3000:]
    assert "Traceback" not in text


def test_a_rank_count_that_cannot_keep_the_global_batch_is_refused_with_the_counts_that_can(client, store):
    run = stopped_run(store)
    response = client.post(f"/api/runs/{run['id']}/resume", json={"checkpoint": "step_00000006", "gpus": 3, "confirm": True})
    assert response.status_code == 409
    detail = response.json()["detail"]
    assert "global batch of 16 (micro-batch 8 x accumulation 1 x 2 ranks)" in detail
    assert "resume on one of these rank counts: 1, 2" in detail
    assert store.db.launches(run["id"]) == [] and store.run(run["id"])["state"] == "stopped"


@pytest.mark.parametrize("gpus", [0, -2, "two", 1.5])
def test_a_malformed_rank_count_is_a_422_naming_the_field(client, store, gpus):
    run = stopped_run(store)
    response = client.post(f"/api/runs/{run['id']}/resume", json={"gpus": gpus, "confirm": True})
    assert response.status_code == 422
    assert "gpus" in response.json()["detail"]
    assert store.db.launches(run["id"]) == []
