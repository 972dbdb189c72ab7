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
    if ids.startswith("1,"):
        # Run 1 exists: it is drawn and the impossible id named (one unknown id no longer blanks the page).
        assert response.status_code == 200 and response.json()["missing"] == [int(ids.split(",")[1])], response.text
    else:
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
    response = client.get(
        "/api/doctor", params={"refresh": "true", "trial_build": "true"}, headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Dest": "image"}
    )
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
    for headers in (
        {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Sec-Fetch-Site": "cross-site"},
    ):
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


def test_the_api_docs_load_nothing_from_the_internet(client):
    """/docs was blank offline: Swagger UI came from a CDN."""
    import re

    page = client.get("/docs")
    assert page.status_code == 200
    assets = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", page.text) + re.findall(r"""url:\s*['"]([^'"]+)['"]""", page.text)
    assert assets and not [a for a in assets if a.startswith(("http:", "https:", "//"))], assets
    for asset in assets:
        response = client.get(asset)
        assert response.status_code == 200, asset
    assert client.get("/redoc").status_code == 404  # ReDoc (also from a CDN) is not offered


def test_number_or_auto_fields_are_one_line_inputs(client):
    """micro_batch_size, gradient_accumulation_steps, shift, gradient_checkpointing were multi-line YAML text areas."""
    schema = client.get("/api/config/schema").json()

    def walk(fields):
        for field in fields:
            yield field
            yield from walk(field.get("fields", []))

    found = {f["key"]: f for section in schema["sections"] for f in walk(section["fields"])}
    for key in [
        "train.micro_batch_size",
        "train.gradient_accumulation_steps",
        "model.diffusion.shift",
        "model.gradient_checkpointing",
        "hardware.gpus",
    ]:
        assert found[key]["kind"] == "scalar" and "auto" in found[key]["options"], (key, found[key])
    assert found["train.micro_batch_size"]["min"] == 0 and found["train.micro_batch_size"]["exclusive_min"] is True
    # What stays a YAML box holds lists or mappings.
    assert {k for k, f in found.items() if f["kind"] == "yaml"} <= {
        "model.config", "model.trainable", "data.columns", "model.load_kwargs", "model.lora.target_modules", "data.mixture", "generate.prompts",
        "generate.images", "deepspeed.overrides", "stages", "run.accept_warnings", "data.video.frame_buckets", "hardware.nodes",
        "data.control_paths", "preference.loss_type", "preference.loss_weights", "convert.cannot_train", "model.lora.target_parameters",
    }  # fmt: skip


@pytest.mark.parametrize("key, value, expected", [
    ("train.micro_batch_size", 0, "must be greater than 0 or 'auto' (you gave 0)"),
    ("hardware.gpus", "many", "must be a whole number or 'auto' (you gave 'many')"),
])  # fmt: skip
def test_a_value_fitting_neither_a_number_nor_auto_is_one_problem(client, key, value, expected):
    """micro_batch_size: 0 gave two messages, one naming pydantic's `constrained-int`."""
    section, name = key.split(".")
    result = client.post("/api/config/check", json={"config": {"run": {"name": "x"}, section: {name: value}}}).json()
    mine = [p for p in result["problems"] if p["key"].startswith(key)]
    assert mine == [{"key": key, "message": expected}], result["problems"]


def test_a_missing_run_name_says_it_is_missing(client):
    result = client.post("/api/config/check", json={"config": {"train": {"lr": 0.1}}}).json()
    problem = next(p for p in result["problems"] if p["key"] == "run.name")
    assert "missing" in problem["message"] and "None" not in problem["message"]


def test_the_log_of_a_rank_that_does_not_exist_is_404(client, store):
    write_run(store.roots.primary_runs, "done", steps=3, checkpoints=())
    store.refresh()
    run_id = store.run("done")["id"]
    assert client.get(f"/api/runs/{run_id}/logs/rank0").status_code == 200
    response = client.get(f"/api/runs/{run_id}/logs/rank9999")
    assert response.status_code == 404 and "rank0" in response.json()["detail"]


def test_an_unknown_run_page_is_a_page_not_json(client):
    response = client.get("/runs/999", headers={"Accept": "text/html,application/xhtml+xml"})
    assert response.status_code == 404
    assert response.headers["content-type"].startswith("text/html")
    assert "no run 999" in response.text and 'href="/"' in response.text
    api = client.get("/api/runs/999", headers={"Accept": "text/html"})
    assert api.status_code == 404 and api.headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    "config",
    [
        {"run": {"name": "x"}, "data": {"path": "data/\x00"}},
        {"run": {"name": "x", "output_dir": "runs\x00"}},
        {"run": {"name": "x", "output_dir": 5}},
        {"run": {"name": "x", "output_dir": ["a"]}},
        {"run": 5},
        {"run": {"name": "x"}, "deepspeed": {"overrides": {"csv_monitor": {"output_path": "\x00"}}}},
    ],
)
def test_odd_paths_in_a_config_are_problems_not_errors(client, caplog, config):
    for path in ("/api/config/check", "/api/data/preview", "/api/runs"):
        response = client.post(path, json={"config": config})
        assert response.status_code in (200, 400, 403, 409, 422), (path, response.status_code, response.text)
        assert "internal error" not in response.text
    assert "Traceback" not in caplog.text


def test_a_nul_in_the_data_file_to_evaluate_on_is_refused(client, store):
    write_run(store.roots.primary_runs, "done", steps=12)
    store.refresh()
    response = client.post(f"/api/runs/{store.run('done')['id']}/eval", json={"data": "data/\x00x"})
    assert response.status_code == 403 and "NUL" in response.json()["detail"]
