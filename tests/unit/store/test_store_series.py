"""Metrics as columns: read incrementally, cached across restarts, downsampled without losing spikes."""

from __future__ import annotations

import json
import math
import time

import numpy as np

from tests.e2e.fake_runs import metric_row, write_metrics
from zeropipe.store.series import Series, SeriesCache, m4_indices


def append(path, rows):
    with open(path, "a") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def test_only_appended_whole_lines_are_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, 5)
    series = Series(path)
    assert series.update() == 5 and series.update() == 0
    # Rank 0 is in the middle of writing step 6: the half line waits for its newline.
    with open(path, "a") as handle:
        handle.write(json.dumps(metric_row(6, 10))[:30])
    assert series.update() == 0
    with open(path, "a") as handle:
        handle.write(json.dumps(metric_row(6, 10))[30:] + "\n")
    assert series.update() == 1
    window = series.window(["loss", "host_rss_bytes/1"])
    assert window["step"] == [1, 2, 3, 4, 5, 6] and len(window["series"]["host_rss_bytes/1"]) == 6


def test_a_rewritten_file_is_read_again(tmp_path):
    """A resume from an older checkpoint drops the later rows: the series must follow."""
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, 50)
    series = Series(path)
    series.update()
    write_metrics(path, 20)
    series.update()
    assert series.rows == 20 and series.window(["loss"])["step"][-1] == 20


def test_missing_values_torn_lines_and_nan_become_gaps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [metric_row(s, 10) for s in range(1, 5)]
    rows[1]["loss"] = float("nan")
    rows[2]["grad_norm"] = None
    del rows[3]["lr"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + '{"step": 3, "loss": \n' + "".join(json.dumps(r) + "\n" for r in rows[2:]))
    series = Series(path)
    series.update()
    window = series.window(["loss", "grad_norm", "lr"])
    assert window["step"] == [1, 2, 3, 4]  # the torn line is skipped, the rest kept
    assert window["series"]["loss"][1] is None and window["series"]["grad_norm"][2] is None and window["series"]["lr"][3] is None
    json.dumps(window, allow_nan=False)  # valid JSON for the browser


def test_m4_keeps_first_last_min_and_max_of_every_bucket():
    rng = np.random.default_rng(0)
    values = rng.normal(size=100_003)
    values[12_345] = 50.0  # a loss spike
    values[77_777] = -50.0
    index = m4_indices(len(values), [values], 500)
    assert len(index) <= 4 * 500
    assert {0, len(values) - 1, 12_345, 77_777} <= set(index.tolist())
    # Every bucket's extremes survive, so the drawn envelope is the same.
    size = math.ceil(len(values) / 500)
    kept = set(index.tolist())
    for start in range(0, len(values), size):
        bucket = values[start : start + size]
        assert start + int(bucket.argmax()) in kept and start + int(bucket.argmin()) in kept


def test_a_long_run_is_served_downsampled(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, 100_000)
    series = Series(path)
    series.update()
    # This thread's CPU time, not the wall clock: other processes loading the machine do not count.
    # Vectorised it takes a few ms of CPU: the bound leaves a hundredfold margin.
    started = time.thread_time()
    window = series.window(["loss", "lr", "host_rss_bytes/0", "host_rss_bytes/1"], width=800)
    cpu_seconds = time.thread_time() - started
    assert window["downsampled"] and window["points"] == 100_000
    assert len(window["step"]) <= 4 * 800 * 4 and window["step"][0] == 1 and window["step"][-1] == 100_000
    assert cpu_seconds < 0.5


def test_the_columns_survive_a_restart_through_the_cache(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, 5000)
    cache = SeriesCache(tmp_path / "cache")
    series = cache.get(path)
    series.save_cache(force=True)
    append(path, [metric_row(5001, 6000)])

    again = SeriesCache(tmp_path / "cache").get(path, update=False)
    assert again.rows == 5000  # loaded from the cache, not parsed
    assert again.update() == 1 and again.rows == 5001
    assert again.window(["loss"])["step"][-1] == 5001


def test_a_stale_cache_of_a_rewritten_file_is_not_trusted(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, 5000)
    cache = SeriesCache(tmp_path / "cache")
    cache.get(path).save_cache(force=True)
    rows = [metric_row(s, 10) for s in range(1, 4)]
    rows[0]["loss"] = 123.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # a different file start
    series = SeriesCache(tmp_path / "cache").get(path)
    assert series.rows == 3 and series.window(["loss"])["series"]["loss"][0] == 123.0


def test_eval_rows_join_their_step_without_leaving_gaps(tmp_path):
    """The trainer writes an eval row (kind: eval, no loss) right after its step's row."""
    path = tmp_path / "metrics.jsonl"
    append(path, [metric_row(1, 10), metric_row(2, 10), {"kind": "eval", "step": 2, "eval_loss": 3.5, "eval_perplexity": 33.1}])
    series = Series(path)
    series.update()
    append(path, [metric_row(3, 10), metric_row(4, 10)])
    series.update()
    append(path, [{"kind": "eval", "step": 4, "eval_loss": 3.0, "eval_perplexity": 20.1}])  # arrives in a later read
    series.update()
    window = series.window(["loss", "eval_loss", "eval_perplexity"])
    assert window["step"] == [1, 2, 3, 4]
    assert None not in window["series"]["loss"]
    assert window["series"]["eval_loss"] == [None, 3.5, None, 3.0]
    assert "eval_loss" in series.keys()
    # A stream notices the late evaluation by the version and resends all of them.
    assert series.eval_version == 2
    assert series.evals() == {"step": [2, 4], "eval_loss": [3.5, 3.0], "eval_perplexity": [33.1, 20.1]}
