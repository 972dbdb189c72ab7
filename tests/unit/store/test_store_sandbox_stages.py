"""The UI's path rules reach into data mixtures and curriculum stages: no path may hide there."""

from __future__ import annotations

from zeropipe.store.sandbox import Roots, absolutize, config_path_problems


def test_paths_inside_mixtures_and_stages_are_checked_and_made_absolute(tmp_path):
    roots = Roots(runs=[tmp_path / "runs"], data=[tmp_path / "data"], base=tmp_path)
    raw = {
        "run": {"name": "ok"},
        "data": {"mixture": [{"path": "data/a.jsonl"}, {"path": "/etc/passwd"}], "eval_path": "/etc/shadow"},
        "stages": [
            {"name": "one", "data": {"path": "../outside.jsonl"}},
            {"name": "two", "data": {"mixture": [{"synthetic": {}}, {"path": "data/b.jsonl"}]}, "deepspeed": {"config_file": "/root/ds.json"}},
        ],
    }
    keys = {key for key, _ in config_path_problems(raw, roots)}
    assert keys == {"data.mixture[1].path", "data.eval_path", "stages[0].data.path", "stages[1].deepspeed.config_file"}
    out = absolutize(raw, roots)
    assert out["data"]["mixture"][0]["path"] == str(tmp_path / "data" / "a.jsonl")
    assert out["stages"][1]["data"]["mixture"][1]["path"] == str(tmp_path / "data" / "b.jsonl")
    assert raw["stages"][1]["data"]["mixture"][1]["path"] == "data/b.jsonl", "the submitted config is not modified"
