"""Metric sinks: TensorBoard event files readable by TensorBoard, W&B offline, MLflow local store."""

from __future__ import annotations

import json
import logging

import pytest

from tests.e2e.fake_runs import metric_row
from zeropipe.config.schema import LoggingSection
from zeropipe.metrics import MetricSinks
from zeropipe.metrics.sinks import scalars

STEPS = 8


def log_steps(sinks: MetricSinks, first: int = 1, last: int = STEPS) -> list[dict]:
    rows = [metric_row(step, STEPS, gpu=True) for step in range(first, last + 1)]
    for row in rows:
        sinks.log(row)
    return rows


def test_scalars_flatten_per_rank_lists_and_skip_non_metrics():
    values = scalars(metric_row(3, 10, world_size=2, gpu=True))
    assert values["train/loss"] == pytest.approx(metric_row(3, 10)["loss"])
    assert {"memory/host_rss_bytes/rank0", "memory/host_rss_bytes/rank1", "memory/gpu_max_allocated_bytes/rank1", "perf/tokens_per_s", "train/lr"} <= set(values)
    assert "step" not in values and "time" not in values


def event_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return accumulator


def test_tensorboard_event_files_are_read_by_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricSinks(tmp_path, LoggingSection(), rank=0) as sinks:
        assert sinks.active == ["tensorboard"]
        rows = log_steps(sinks)
    # `tensorboard --logdir RUN_DIR` finds them: TensorBoard walks the run directory.
    accumulator = event_scalars(tmp_path / "tensorboard")
    tags = accumulator.Tags()["scalars"]
    assert {"train/loss", "train/lr", "perf/tokens_per_s", "memory/host_rss_bytes/rank1", "memory/gpu_max_allocated_bytes/rank0"} <= set(tags)
    events = accumulator.Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, STEPS + 1))
    assert [e.value for e in events] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert events[0].wall_time == pytest.approx(rows[0]["time"])


def test_a_resumed_run_hides_the_abandoned_steps_in_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricSinks(tmp_path, {"tensorboard": True}, rank=0) as sinks:
        log_steps(sinks, 1, 8)
    # Resumed from a checkpoint at step 4: steps 5.. are logged again.
    with MetricSinks(tmp_path, {"tensorboard": True}, rank=0) as sinks:
        log_steps(sinks, 5, 8)
    events = event_scalars(tmp_path / "tensorboard").Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 9))


def test_other_ranks_and_switched_off_sinks_do_nothing(tmp_path):
    sinks = MetricSinks(tmp_path, LoggingSection(), rank=1)
    sinks.log(metric_row(1, 2))
    sinks.close()
    off = MetricSinks(tmp_path, LoggingSection(tensorboard=False), rank=0)
    off.log(metric_row(1, 2))
    off.close()
    assert sinks.active == [] and off.active == [] and not (tmp_path / "tensorboard").exists()


def test_a_missing_package_is_one_warning_not_a_crash(tmp_path, monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError("No module named 'wandb'", name="wandb")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with caplog.at_level(logging.WARNING):
        sinks = MetricSinks(tmp_path, {"tensorboard": False, "wandb": True}, rank=0)
    sinks.log(metric_row(1, 2))
    sinks.close()
    assert sinks.active == []
    assert "wandb is not installed: pip install wandb" in caplog.text


def test_a_failing_sink_is_switched_off_and_the_others_keep_logging(tmp_path):
    pytest.importorskip("tensorboard")

    class Broken:
        def log(self, step, values, record):
            raise ConnectionError("service down")

        def close(self):
            pass

    sinks = MetricSinks(tmp_path, {"tensorboard": True}, rank=0)
    sinks.sinks["wandb"] = Broken()
    log_steps(sinks)
    sinks.close()
    assert any("wandb: logging failed (ConnectionError: service down)" in w for w in sinks.warnings)
    assert len(event_scalars(tmp_path / "tensorboard").Scalars("train/loss")) == STEPS


def wandb_history(run_dir):
    """The history rows of an offline W&B run, read from its .wandb file (LevelDB log records)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


@pytest.mark.timeout(180)
def test_wandb_offline_run_gets_every_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("train:\n  lr: 0.01\n")
    with MetricSinks(run_dir, LoggingSection(tensorboard=False, wandb=True, wandb_project="zp-test"), rank=0) as sinks:
        assert sinks.active == ["wandb"], sinks.warnings
        rows = log_steps(sinks)
    history = wandb_history(run_dir)
    assert [h["_step"] for h in history] == list(range(1, STEPS + 1))
    assert [h["train/loss"] for h in history] == pytest.approx([r["loss"] for r in rows])
    assert "memory/host_rss_bytes/rank1" in history[-1]
    ids = json.loads((run_dir / "metric_sinks.json").read_text())
    assert len(ids["wandb_run_id"]) == 8


@pytest.mark.timeout(180)
def test_mlflow_local_store_gets_every_step_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store only on request
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("train:\n  lr: 0.01\ndeepspeed:\n  zero_stage: 3\n")
    with MetricSinks(run_dir, {"tensorboard": False, "mlflow": True}, rank=0) as sinks:
        assert sinks.active == ["mlflow"], sinks.warnings
        rows = log_steps(sinks, 1, 4)
    with MetricSinks(run_dir, {"tensorboard": False, "mlflow": True}, rank=0) as sinks:
        rows += log_steps(sinks, 5, STEPS)

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("zeropipe").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["deepspeed.zero_stage"] == "3"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx([r["loss"] for r in rows])
