"""Compare offers the eval / validation loss: every evaluation of each run, never downsampled away (issue 44)."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from tests.e2e.fake_runs import write_run
from zeropipe.server import create_app
from zeropipe.store import Roots, RunStore


def test_compare_gives_every_evaluation_of_each_run(tmp_path):
    roots = Roots(runs=[tmp_path / "runs"], data=[tmp_path / "data"], base=tmp_path)
    (tmp_path / "data").mkdir()
    store = RunStore(roots)
    try:
        runs = {name: write_run(store.roots.primary_runs, name, steps=400) for name in ("lm", "sd")}
        with open(runs["sd"] / "metrics.jsonl", "a") as handle:
            for step in (100, 200, 300, 400):  # a diffusion run's rows: no perplexity, a loss per quantile
                handle.write(json.dumps({"kind": "eval", "step": step, "eval_loss": 1.0 / step, "eval_loss_by_quantile": {"0.1": 0.5}, "eval_examples": 5}) + "\n")
        store.refresh()
        ids = {run["name"]: run["id"] for run in store.runs()}
        with TestClient(create_app(store, refresh_interval=None), base_url="http://127.0.0.1") as client:
            data = client.get("/api/compare", params={"ids": f"{ids['lm']},{ids['sd']}", "key": "eval_loss", "width": 10}).json()
        by_name = {run["name"]: run for run in data["runs"]}
        assert by_name["sd"]["step"] == [100, 200, 300, 400] and by_name["sd"]["values"] == [0.01, 0.005, 1 / 300, 0.0025]
        assert by_name["lm"]["step"] == [] and by_name["lm"]["values"] == []
    finally:
        store.close()
