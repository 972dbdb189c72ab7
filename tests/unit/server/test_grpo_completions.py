"""A GRPO run's completions on the UI's run page: served by the run's API from completions.jsonl, as untrusted text.

Completions are what the model wrote (and a run folder may be written by anyone): the API hands
them over as JSON strings, unchanged and never interpreted; the page sets them as text.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient

from tests.e2e.fake_runs import write_run
from zeropipe.server import create_app

HOSTILE = '</code><script>alert("x")</script><img src=x onerror=alert(1)>'


def test_the_run_page_api_returns_the_completions_as_text_and_only_the_last_ones(store):
    root = store.roots.primary_runs
    run_dir = write_run(root, "grpo", steps=3)
    rows = [{"step": step, "prompt": "What is 2 + 3?", "completion": HOSTILE if step == 3 else f"{step}",
             "rewards": {"numeric": 1.0 if step == 3 else 0.0, "just_a_number": None}, "advantage": 0.5, "extra": "x" * 10}
            for step in range(1, 4) for _ in range(8)]
    filler = [{"step": 0, "prompt": "old", "completion": "y" * 1000, "rewards": {}, "advantage": 0.0}] * 400  # ~400 KB written before
    (run_dir / "completions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in filler + rows))
    store.refresh()
    with TestClient(create_app(store, refresh_interval=None), base_url="http://127.0.0.1") as client:
        run_id = next(run["id"] for run in client.get("/api/runs").json()["runs"] if run["name"] == "grpo")
        response = client.get(f"/api/runs/{run_id}")
        page = client.get(f"/runs/{run_id}")
    assert response.headers["content-type"].startswith("application/json")
    completions = response.json()["completions"]
    assert completions[-8:] == [{key: row[key] for key in ("step", "prompt", "completion", "rewards", "advantage")} for row in rows[-8:]]
    assert completions[-1]["completion"] == HOSTILE  # the very text, as a JSON string: nothing decoded or interpreted
    assert 0 < len(completions) < len(filler) and {row["step"] for row in completions} >= {1, 2, 3}  # the file's end only
    assert HOSTILE not in page.text and "completions-card" in page.text  # the page carries no completion: the script sets them as text
    script = (Path(__file__).parents[3] / "src/zeropipe/server/static/run.js").read_text()
    body = script[script.index("function renderCompletions") : script.index("// -------------------------------------------------------------- nodes")]
    assert "html" not in body and "innerHTML" not in body


def test_a_run_without_completions_has_none(store, client):
    write_run(store.roots.primary_runs, "plain", steps=2)
    store.refresh()
    run_id = next(run["id"] for run in client.get("/api/runs").json()["runs"] if run["name"] == "plain")
    assert client.get(f"/api/runs/{run_id}").json()["completions"] == []
