"""The JSON API, in-process: every page's data, the streams, and refusals with a message, never a traceback."""

from __future__ import annotations

import json

import pytest
import yaml
from fastapi.testclient import TestClient

from tests.e2e.fake_runs import TINY_CONFIG, live_pid, write_run, write_samples
from zeropipe.config.schema import RunConfig
from zeropipe.server import create_app
from zeropipe.store import Roots, RunStore


@pytest.fixture
def store(tmp_path):
    roots = Roots(runs=[tmp_path / "runs"], data=[tmp_path / "data"], base=tmp_path)
    (tmp_path / "data").mkdir()
    store = RunStore(roots)
    yield store
    store.close()


@pytest.fixture
def client(store):
    with TestClient(create_app(store, refresh_interval=None), base_url="http://127.0.0.1") as client:
        yield client


def add_runs(store):
    root = store.roots.primary_runs
    write_run(root, "done", steps=12)
    write_run(root, "oom", state="failed", steps=5, total_steps=12, checkpoints=())
    write_samples(write_run(root, "sd", steps=100, checkpoints=(50, 100)))
    write_run(root, "live", state="running", steps=4, total_steps=40, supervisor_pid=live_pid())
    store.refresh()
    return {run["name"]: run["id"] for run in store.runs()}


def test_runs_list_with_filters(client, store):
    ids = add_runs(store)
    runs = client.get("/api/runs").json()["runs"]
    assert {r["name"] for r in runs} == {"done", "oom", "sd", "live"}
    assert [r["name"] for r in client.get("/api/runs", params={"state": "failed"}).json()["runs"]] == ["oom"]
    assert [r["name"] for r in client.get("/api/runs", params={"q": "liv"}).json()["runs"]] == ["live"]
    live = next(r for r in runs if r["name"] == "live")
    assert live["state"] == "running" and live["progress"] == pytest.approx(0.1) and live["eta_s"] == pytest.approx(36 * 0.25)
    assert ids


def test_run_detail_has_the_diagnosis_checkpoints_logs_and_generations(client, store):
    ids = add_runs(store)
    oom = client.get(f"/api/runs/{ids['oom']}").json()
    assert oom["run"]["state"] == "failed"
    assert "rank 0 was killed by SIGKILL" in oom["status"]["diagnosis"]["text"]
    assert oom["logs"] == ["rank0", "rank1"]
    done = client.get(f"/api/runs/{ids['done']}").json()
    assert [c["tag"] for c in done["checkpoints"]] == ["step_00000012", "step_00000006"]
    assert done["generations"][0]["prompt"] == "What is 1 + 2?"
    assert done["plan"]["total_steps"] == 12
    log = client.get(f"/api/runs/{ids['done']}/logs/rank0", params={"lines": 3}).json()
    assert len(log["lines"]) == 3 and log["lines"][-1].startswith("step 12/12")
    assert "max_steps: 12" in client.get(f"/api/runs/{ids['done']}/config").json()["yaml"]


def test_metrics_are_downsampled_to_the_chart_width(client, store):
    run = write_run(store.roots.primary_runs, "long", steps=100_000, checkpoints=())
    store.refresh()
    run_id = store.run("long")["id"]
    client.get(f"/api/runs/{run_id}/metrics", params={"width": 10})  # the store reads the file once (the refresh thread does this for live runs)
    response = client.get(f"/api/runs/{run_id}/metrics", params={"width": 900})
    data = response.json()
    assert response.status_code == 200 and data["downsampled"] and data["points"] == 100_000
    assert 900 <= len(data["step"]) <= 4 * 900 * 12
    assert {"loss", "lr", "host_rss_bytes/0", "host_rss_bytes/1"} <= set(data["series"]) and "step" not in data["series"]
    assert data["step"][0] == 1 and data["step"][-1] == 100_000
    # A page of a long run loads fast because the answer is bounded by the chart's width, not by
    # the run's length (a wall-clock bound here failed on loaded machines): 100,000 steps of four
    # series come back in well under a megabyte.
    assert len(response.content) < 1_000_000, len(response.content)
    keys = client.get(f"/api/runs/{run_id}/metrics", params={"keys": "loss,host_rss_bytes/*", "width": 100}).json()
    assert set(keys["series"]) == {"loss", "host_rss_bytes/0", "host_rss_bytes/1"}
    assert run


def test_the_sample_gallery_and_its_images(client, store):
    ids = add_runs(store)
    samples = client.get(f"/api/runs/{ids['sd']}/samples").json()["samples"]
    assert len(samples) == 4 and {s["prompt"] for s in samples} == {"a red fox in the snow", "a lighthouse at dusk"}
    image = client.get(f"/api/runs/{ids['sd']}/samples/{samples[0]['file']}")
    assert image.status_code == 200 and image.headers["content-type"] == "image/png" and image.content.startswith(b"\x89PNG")
    assert client.get(f"/api/runs/{ids['done']}/samples").json() == {"samples": []}


@pytest.mark.parametrize(
    "path",
    [
        "../config.yaml",
        "..%2Fconfig.yaml",
        "step_00000050/../../status.json",
        "%2Fetc%2Fpasswd",
        "step_00000050/..%2F..%2F..%2F..%2Fetc%2Fpasswd",
    ],
)
def test_path_traversal_is_refused(client, store, path):
    ids = add_runs(store)
    response = client.get(f"/api/runs/{ids['sd']}/samples/{path}")
    assert response.status_code in (403, 404), response.text
    assert "PNG" not in response.text and "root:" not in response.text and response.json()["detail"]


def test_log_names_cannot_leave_the_logs_folder(client, store):
    ids = add_runs(store)
    for name in ["..%2Fstatus", "rank0.log", "launcher%2F..%2F..%2Fstatus", "%2e%2e"]:
        response = client.get(f"/api/runs/{ids['done']}/logs/{name}")
        assert response.status_code == 404, (name, response.text)


def test_the_form_schema_covers_every_config_field_with_its_help(client):
    schema = client.get("/api/config/schema").json()

    def keys(fields):
        for field in fields:
            yield field["key"], field
            yield from keys(field.get("fields", []))

    found = dict(kv for section in schema["sections"] for kv in keys(section["fields"]))

    def expected(model, prefix):
        for name, field in model.model_fields.items():
            yield f"{prefix}{name}", field
            sub = next((a for a in (field.annotation, *getattr(field.annotation, "__args__", ())) if isinstance(a, type) and hasattr(a, "model_fields")), None)
            if sub is not None and prefix:
                yield from expected(sub, f"{prefix}{name}.")

    wanted = {}
    for section, field in RunConfig.model_fields.items():
        # A section, or an optional one (preference); a list of sections (stages) is one YAML field.
        model = next((a for a in (field.annotation, *getattr(field.annotation, "__args__", ())) if isinstance(a, type) and hasattr(a, "model_fields")), None)
        if model is None:
            wanted[section] = field
            continue
        wanted.update(dict(expected(model, f"{section}.")))
    assert set(found) == set(wanted)
    for key, field in wanted.items():
        assert found[key]["help"] == field.description, key
    assert found["deepspeed.zero_stage"]["kind"] == "select" and {0, 1, 2, 3} <= set(found["deepspeed.zero_stage"]["options"])
    assert found["logging.wandb"]["kind"] == "bool" and found["model.lora"]["kind"] == "section"
    assert found["hardware.gpus"]["kind"] == "scalar" and found["train.lr"]["min"] == 0
    assert found["stages"]["kind"] == "yaml" and found["data.mixture"]["kind"] == "yaml"


def check(client, text):
    response = client.post("/api/config/check", json={"yaml": text})
    assert response.status_code == 200, response.text
    return response.json()


def test_check_reports_problems_findings_and_the_plan(client):
    template = client.get("/api/config/template").json()["yaml"]
    good = check(client, template)
    assert good["valid"] and good["problems"] == []
    assert set(good["plan"]) >= {"available"}
    if not good["plan"]["available"]:
        assert "planner unavailable" in good["plan"]["reason"]

    raw = yaml.safe_load(template)
    raw["train"]["micro_batchsize"] = 4
    raw["deepspeed"]["offload_param"] = "cpu"
    bad = check(client, yaml.safe_dump(raw))
    assert not bad["valid"]
    keys = {p["key"] for p in bad["problems"]}
    assert {"train.micro_batchsize", "deepspeed.offload_param"} <= keys
    assert any("did you mean 'micro_batch_size'" in p["message"] for p in bad["problems"])

    syntax = check(client, "train:\n  lr: [1, 2\n")
    assert not syntax["valid"] and "not valid YAML at line" in syntax["problems"][0]["message"]


def test_check_runs_the_check_rules(client):
    raw = yaml.safe_load(client.get("/api/config/template").json()["yaml"])
    raw["deepspeed"]["precision"] = "fp16"  # refused on CPU ranks (rule ZP010)
    result = check(client, yaml.safe_dump(raw))
    assert not result["valid"] and result["problems"] == []
    assert any(f["rule"] == "ZP010" and f["severity"] == "error" for f in result["findings"])


def test_a_failing_planner_shows_planner_unavailable(client, monkeypatch):
    from zeropipe.launch import resolve

    def broken(*args, **kwargs):
        raise RuntimeError("the planner broke")

    monkeypatch.setattr(resolve, "plan_run", broken)
    result = check(client, client.get("/api/config/template").json()["yaml"])
    assert result["plan"]["available"] is False and "planner unavailable (RuntimeError: the planner broke)" in result["plan"]["reason"]
    assert result["problems"] == []


def launch(client, raw):
    return client.post("/api/runs", json={"yaml": yaml.safe_dump(raw)})


@pytest.mark.parametrize(
    "change, key",
    [
        ({"run": {"name": "../../escape"}}, "run.name"),
        ({"run": {"name": "ok", "output_dir": "/tmp"}}, "run.output_dir"),
        ({"data": {"path": "/etc/passwd", "synthetic": None}}, "data.path"),
        ({"model": {"path": "/usr", "config": None}}, "model.path"),
        ({"train": {"lr": "fast"}}, "train.lr"),
    ],
)
def test_launch_refuses_bad_configs_before_starting_anything(client, store, change, key):
    raw = json.loads(json.dumps(TINY_CONFIG))
    raw["run"].pop("output_dir")
    for section, values in change.items():
        for name, value in values.items():
            if value is None:
                raw[section].pop(name, None)
            else:
                raw[section][name] = value
    response = launch(client, raw)
    assert response.status_code == 422, response.text
    assert key in {p["key"] for p in response.json()["problems"]}
    assert store.db.launches() == []


def test_launch_refuses_check_errors_and_existing_runs(client, store):
    raw = json.loads(json.dumps(TINY_CONFIG))
    raw["run"] = {"name": "tiny"}
    raw["deepspeed"]["precision"] = "fp16"
    response = launch(client, raw)
    assert response.status_code == 422 and response.json()["findings"][0]["rule"] == "ZP010"
    write_run(store.roots.primary_runs, "taken")
    raw["run"]["name"], raw["deepspeed"]["precision"] = "taken", "bf16"
    response = launch(client, raw)
    assert response.status_code == 409 and "already holds a run" in response.json()["detail"]
    assert store.db.launches() == []


def test_actions_on_runs_in_the_wrong_state_are_409_with_the_reason(client, store):
    ids = add_runs(store)
    assert client.post(f"/api/runs/{ids['done']}/stop", json={}).status_code == 409
    response = client.post(f"/api/runs/{ids['live']}/stop", json={})  # its "launcher" is this test process: never signalled
    assert response.status_code == 409 and "no live launcher" in response.json()["detail"]
    response = client.post(f"/api/runs/{ids['oom']}/resume", json={"confirm": True})
    assert response.status_code == 409 and "no complete checkpoint" in response.json()["detail"]
    response = client.post(f"/api/runs/{ids['done']}/export", json={"checkpoint": "step_00000099"})
    assert response.status_code == 409 and "no complete checkpoint step_00000099" in response.json()["detail"]


def sse_events(response):
    events, event = [], {}
    for line in response.iter_lines():
        if line.startswith("event: "):
            event["event"] = line[7:]
        elif line.startswith("data: "):
            event["data"] = json.loads(line[6:])
        elif line == "" and event:
            events.append(event)
            event = {}
    return events


def test_the_runs_stream_sends_the_list(client, store):
    add_runs(store)
    with client.stream("GET", "/api/runs/stream", params={"max_seconds": 0.5}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[0]["event"] == "runs" and len(events[0]["data"]["runs"]) == 4


def test_a_finished_runs_stream_sends_its_rows_state_and_end(client, store):
    ids = add_runs(store)
    with client.stream("GET", f"/api/runs/{ids['done']}/stream", params={"after_step": 10}) as response:
        events = sse_events(response)
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["metrics", "run"] and kinds[-1] == "end"
    assert events[0]["data"]["step"] == [11, 12]
    assert events[1]["data"]["state"] == "completed"


def test_a_runs_stream_sends_its_evaluations(client, store):
    ids = add_runs(store)
    run = store.run(ids["done"])
    with open(f"{run['path']}/metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"kind": "eval", "step": 12, "eval_loss": 2.5, "eval_perplexity": 12.2}) + "\n")
    with client.stream("GET", f"/api/runs/{ids['done']}/stream", params={"after_step": 12}) as response:
        events = sse_events(response)
    evals = [e["data"] for e in events if e["event"] == "evals"]
    assert evals == [{"step": [12], "eval_loss": [2.5], "eval_perplexity": [12.2]}]


def test_malformed_requests_get_4xx_with_a_message(client, store):
    ids = add_runs(store)
    attempts = [
        ("GET", "/api/runs/abc", None),
        ("GET", "/api/runs/0", None),
        ("GET", "/api/runs/99999999999999999999999", None),
        ("GET", "/api/runs/424242", None),
        ("GET", f"/api/runs/{ids['done']}/metrics?width=-5", None),
        ("GET", f"/api/runs/{ids['done']}/metrics?after_step=nan", None),
        ("GET", f"/api/runs/{ids['done']}/logs/rank0?lines=0", None),
        ("GET", "/api/compare?ids=1;drop", None),
        ("GET", "/api/compare?ids=424242", None),
        ("POST", "/api/runs", "not json"),
        ("POST", "/api/runs", []),
        ("POST", "/api/runs", {"yaml": 3}),
        ("POST", "/api/runs", {"yaml": "a", "config": {}}),
        ("POST", "/api/runs", {"yaml": "- a list"}),
        ("POST", "/api/runs", {"config": {"train": "x"}}),
        ("POST", "/api/runs", {"yaml": "x" * 300_000}),
        ("POST", "/api/runs", {"unknown": 1}),
        ("POST", "/api/config/check", {"yaml": None, "config": None}),
        ("POST", f"/api/runs/{ids['done']}/export", {"dtype": "int4"}),
        ("POST", f"/api/runs/{ids['done']}/export", {"merge": "sometimes"}),
        ("POST", f"/api/runs/{ids['done']}/resume", {"checkpoint": 12}),
        ("GET", "/api/nothing-here", None),
        ("DELETE", "/api/runs", None),
    ]
    for method, path, body in attempts:
        if isinstance(body, str):
            response = client.request(method, path, content=body, headers={"Content-Type": "application/json"})
        elif body is None and method != "POST":
            response = client.request(method, path)
        else:
            response = client.request(method, path, json=body)
        assert 400 <= response.status_code < 500, (method, path, response.status_code, response.text)
        detail = response.json()["detail"]
        assert isinstance(detail, str) and detail and "Traceback" not in response.text, (path, response.text)


def test_an_unexpected_error_is_a_500_without_a_traceback(store):
    app = create_app(store, refresh_interval=None)

    @app.get("/api/boom")
    def boom():
        raise RuntimeError("secret internals")

    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        response = client.get("/api/boom")
    assert response.status_code == 500
    assert "secret internals" not in response.text and "Traceback" not in response.text
    assert response.json()["detail"].startswith("internal error (RuntimeError)")


def test_compare_returns_each_runs_loss(client, store):
    ids = add_runs(store)
    data = client.get("/api/compare", params={"ids": f"{ids['done']},{ids['sd']}", "width": 50}).json()
    assert [r["name"] for r in data["runs"]] == ["done", "sd"]
    assert len(data["runs"][0]["values"]) == 12 and len(data["runs"][1]["step"]) == 100


def test_the_openapi_schema_documents_the_api(client):
    schema = client.get("/openapi.json").json()
    paths = set(schema["paths"])
    assert {"/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/metrics", "/api/runs/{run_id}/stop", "/api/runs/{run_id}/resume",
            "/api/runs/{run_id}/export", "/api/config/check", "/api/config/schema", "/api/compare", "/api/doctor", "/api/runs/stream"} <= paths  # fmt: skip
    assert not any(not p.startswith("/api/") for p in paths)  # pages are not API
    assert client.get("/docs").status_code == 200


@pytest.mark.parametrize("path", ["/", "/new", "/compare", "/environment", "/generate"])
def test_pages_render(client, path):
    response = client.get(path)
    assert response.status_code == 200 and "ZeRO-Pipe" in response.text and "/static/common.js" in response.text


def test_a_run_page_and_static_assets(client, store):
    ids = add_runs(store)
    assert client.get(f"/runs/{ids['sd']}").status_code == 200
    assert client.get("/runs/424242").status_code == 404
    uplot = client.get("/static/vendor/uPlot.iife.min.js")
    assert uplot.status_code == 200 and "uPlot" in uplot.text
    assert client.get("/static/../pyproject.toml").status_code == 404


def test_doctor_report_or_unavailable(client, monkeypatch):
    from zeropipe.server import checking

    monkeypatch.setattr(checking, "_doctor", {})
    data = client.get("/api/doctor").json()
    if data["available"]:
        assert data["findings"] and {"id", "status", "title"} <= set(data["findings"][0])
    else:
        assert "doctor" in data["reason"]
