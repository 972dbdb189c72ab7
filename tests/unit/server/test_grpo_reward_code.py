"""A GRPO config submitted through the UI may not name Python code (a reward function) unless the UI trusts code,
as with trust_remote_code; a reward model's folder is confined like every other path."""

from __future__ import annotations

import yaml
from fastapi.testclient import TestClient

from tests.unit.server.test_server_confinement import tiny
from zeropipe.server import create_app
from zeropipe.store import RunStore

FUNCTION = "my_rewards:short_answers"


def grpo(rewards):
    return {"num_generations": 4, "max_completion_length": 4, "rewards": rewards}


def test_a_reward_function_is_refused_unless_the_ui_allows_code(store, tmp_path):
    for raw, key in [
        (tiny(grpo=grpo([{"kind": "numeric"}, {"kind": "function", "function": FUNCTION}])), "grpo.rewards[1].function"),
        (tiny(stages=[{"name": "one", "grpo": grpo([{"kind": "function", "function": FUNCTION}])}]), "stages[0].grpo.rewards[0].function"),
    ]:
        with TestClient(create_app(store, refresh_interval=None), base_url="http://127.0.0.1") as client:
            result = client.post("/api/config/check", json={"config": raw}).json()
            launched = client.post("/api/runs", json={"yaml": yaml.safe_dump(raw)})
        problem = next(p for p in result["problems"] if p["key"] == key)
        assert "--allow-remote-code" in problem["message"] and not result["valid"]
        assert launched.status_code == 422 and key in {p["key"] for p in launched.json()["problems"]} and store.db.launches() == []
        allowing = RunStore(store.roots, tmp_path / "other.sqlite3", allow_remote_code=True)
        with TestClient(create_app(allowing, refresh_interval=None), base_url="http://127.0.0.1") as client:
            result = client.post("/api/config/check", json={"config": raw}).json()
        allowing.close()
        assert key not in {p["key"] for p in result["problems"]}


def test_built_in_rewards_pass_and_a_reward_model_outside_the_folders_is_refused(client, tmp_path):
    built_in = tiny(grpo=grpo([{"kind": "numeric"}, {"kind": "format", "pattern": "^-?[0-9]+$", "weight": 0.5}]))
    result = client.post("/api/config/check", json={"config": built_in}).json()
    assert not [p for p in result["problems"] if p["key"].startswith("grpo")], result["problems"]
    outside = tiny(grpo=grpo([{"kind": "model", "path": str(tmp_path / "elsewhere" / "reward_model")}]))
    result = client.post("/api/config/check", json={"config": outside}).json()
    messages = {p["key"]: p["message"] for p in result["problems"]}
    assert "outside the folders this UI may read and write" in messages["grpo.rewards[0].path"]
