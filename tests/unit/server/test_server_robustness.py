"""Requests found to break the server from outside: each gets a 4xx with a message, no traceback
in the log, and no side effect."""

from __future__ import annotations

import logging
import time

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
    store.close()


@pytest.fixture
def client(store):
    with TestClient(create_app(store, refresh_interval=None), base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        yield client


def deep_list(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [600, 5000])
@pytest.mark.parametrize("form", ["yaml", "json"])
def test_a_deeply_nested_config_is_refused_with_a_message(client, caplog, form, depth):
    if form == "yaml":
        response = client.post("/api/config/check", json={"yaml": f"run: {{name: x}}\ndeepspeed: {{overrides: {{a: {deep_list(depth)}}}}}"})
    else:
        body = '{"config": {"run": {"name": "x"}, "deepspeed": {"overrides": {"a": ' + deep_list(depth) + "}}}}"
        response = client.post("/api/config/check", content=body, headers={"Content-Type": "application/json"})
    assert 200 <= response.status_code < 500, response.text
    answer = response.json()
    message = answer.get("detail") or " ".join(p["message"] for p in answer["problems"])
    assert answer.get("valid") is not True and ("nests more than" in message or "parsing the body" in message), answer
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text


def test_a_deeply_nested_config_cannot_be_launched(client, store):
    response = client.post("/api/runs", json={"yaml": f"run: {{name: x}}\nmodel: {{config: {{a: {deep_list(600)}}}}}"})
    assert response.status_code == 422 and "nests more than" in response.json()["detail"]
    assert store.db.launches() == []


def test_a_yaml_alias_bomb_is_refused_without_expanding_it(client):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for level in "bcdefghi":
        previous = chr(ord(level) - 1)
        bomb += f"{level}: &{level} [" + ", ".join([f"*{previous}"] * 10) + "]\n"
    response = client.post("/api/config/check", json={"yaml": "run: {name: x}\ndeepspeed:\n  overrides:\n    " + bomb.replace("\n", "\n    ")})
    assert response.status_code == 200
    assert any("more than 100,000 values" in p["message"] for p in response.json()["problems"])


@pytest.mark.parametrize("ids", ["9223372036854775808", "1,99999999999999999999999999", "18446744073709551616"])
def test_compare_with_an_id_too_large_for_the_database_is_a_4xx(client, store, caplog, ids):
    write_run(store.roots.primary_runs, "done", steps=3, checkpoints=())
    store.refresh()
    response = client.get("/api/compare", params={"ids": ids})
    assert 400 <= response.status_code < 500, response.text
    assert "no run" in response.json()["detail"] or "run id" in response.json()["detail"]
    assert "Traceback" not in caplog.text and "OverflowError" not in caplog.text


def test_the_store_treats_an_id_too_large_as_no_run(store):
    from zeropipe.store import RunNotFound

    with pytest.raises(RunNotFound):
        store.run(2**63)
    with pytest.raises(RunNotFound):
        store.run(str(10**30))


def test_an_unexpected_recursion_error_is_not_logged_as_a_traceback(store, caplog):
    app = create_app(store, refresh_interval=None)

    @app.get("/api/recurse")
    def recurse():
        def down(n):
            return down(n + 1)

        return down(0)

    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client, caplog.at_level(logging.WARNING):
        response = client.get("/api/recurse")
    assert response.status_code == 422 and "nest" in response.json()["detail"]
    assert "Traceback" not in caplog.text and len(caplog.text.splitlines()) <= 2


# ------------------------------------------------------------------ no GET changes anything
def test_reading_the_doctor_report_never_starts_the_trial_build(client, monkeypatch):
    """An <img src=".../api/doctor?refresh=true&trial_build=true"> on any website started a build."""
    from zeropipe.server import checking

    monkeypatch.setattr(checking, "_doctor", {})
    response = client.get("/api/doctor", params={"refresh": "true", "trial_build": "true"}, headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Dest": "image"})
    report = response.json()
    assert response.status_code == 200
    if report["available"]:
        assert report["facts"]["cpu_adam"]["skipped_reason"], report["facts"]["cpu_adam"]
    assert checking._doctor.get("trial_build") is not True
    again = client.get("/api/doctor", params={"refresh": "true"}).json()
    assert again.get("checked_at") == report.get("checked_at"), "a GET does not even re-examine the machine"


def test_examining_again_is_a_post_from_this_ui_only(client, monkeypatch):
    from zeropipe.server import checking

    monkeypatch.setattr(checking, "_doctor", {})
    for headers in ({"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"}, {"Sec-Fetch-Site": "cross-site"}):
        response = client.post("/api/doctor/check", json={"trial_build": True}, headers=headers)
        assert response.status_code == 403, (headers, response.text)
    assert checking._doctor == {}
    first = client.get("/api/doctor").json()
    time.sleep(0.05)
    response = client.post("/api/doctor/check", json={"trial_build": False}, headers={"Origin": "http://127.0.0.1", "Sec-Fetch-Site": "same-origin"})
    assert response.status_code == 200
    assert response.json().get("checked_at", 1) != first.get("checked_at", 0)


@pytest.mark.parametrize("method", ["DELETE", "PUT", "PATCH"])
def test_a_wrong_method_on_a_route_is_405(client, store, method):
    write_run(store.roots.primary_runs, "done", steps=3, checkpoints=())
    store.refresh()
    for path in ["/api/runs/1/config", "/api/compare?ids=1", "/api/health"]:
        response = client.request(method, path)
        assert response.status_code == 405, (method, path, response.status_code, response.text)
        assert response.json()["detail"]
