"""Where a run's per-step metrics go besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow.

The trainer's rank 0 hands each metrics record (the object it appends to metrics.jsonl) to
``MetricSinks.log``; other ranks get a ``MetricSinks`` that does nothing, so the call needs
no ``if rank == 0``. The sinks follow the run's ``logging`` section:

- TensorBoard (on by default): event files in ``RUN_DIR/tensorboard``, so
  ``tensorboard --logdir RUN_DIR`` (or the runs folder, for all runs) shows them;
- Weights & Biases (``logging.wandb``): project ``logging.wandb_project``, the run named
  after the run directory; ``WANDB_MODE=offline`` works without a network;
- MLflow (``logging.mlflow``): ``MLFLOW_TRACKING_URI``, or MLflow's own default (``./mlruns``
  before MLflow 3, ``./mlflow.db`` since), experiment ``MLFLOW_EXPERIMENT_NAME`` or ``zeropipe``.

A resumed run continues the same W&B and MLflow runs (their ids are kept in
``RUN_DIR/metric_sinks.json``). A missing package or a failing service never stops training:
the sink is switched off with one warning in the rank's log.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import string
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# metrics.jsonl keys -> the names dashboards show, grouped the way TensorBoard groups by prefix.
NAMES = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "epoch": "train/epoch",
    "tokens_per_s": "perf/tokens_per_s",
    "samples_per_s": "perf/samples_per_s",
    "step_time_s": "perf/step_time_s",
    "host_rss_bytes": "memory/host_rss_bytes",
    "gpu_max_allocated_bytes": "memory/gpu_max_allocated_bytes",
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
    "eval_tokens": "eval/tokens",
    "eval_examples": "eval/examples",
    "eval_time_s": "eval/time_s",
    "eval_loss_by_quantile": "eval/loss_quantile",  # a diffusion run's, one scalar per fixed timestep quantile
}
NOT_METRICS = {"step", "time"}
IDS_FILE = "metric_sinks.json"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record as flat scalars; per-rank lists become ``name/rank0``, ``name/rank1``..."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_METRICS:
            continue
        name = NAMES.get(key, key)
        if isinstance(value, list):
            for rank, item in enumerate(value):
                if is_number(item):
                    out[f"{name}/rank{rank}"] = float(item)
        elif isinstance(value, dict):
            out.update({f"{name}/{part}": float(item) for part, item in value.items() if is_number(item)})
        elif is_number(value):
            out[name] = float(value)
    return out


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def setting(section: Any, name: str, default: Any) -> Any:
    """A logging setting from the LoggingSection model (or a plain dict)."""
    if section is None:
        return default
    if isinstance(section, dict):
        return section.get(name, default)
    return getattr(section, name, default)


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer_class = SummaryWriter
        self.log_dir = run_dir / "tensorboard"
        self.writer = None

    def log(self, step: int, values: dict[str, float], record: dict[str, Any]) -> None:
        if self.writer is None:
            # purge_step: a run resumed from step N hides what an abandoned timeline logged after N.
            self.writer = self.writer_class(log_dir=str(self.log_dir), purge_step=step, flush_secs=5)
        wall_time = record.get("time") if is_number(record.get("time")) else None
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step, walltime=wall_time)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, project: str, ids: dict[str, Any], config: dict[str, Any] | None):
        import wandb

        # W&B run ids are 8 lowercase letters and digits; kept so a resume continues the same run.
        run_id = ids.get("wandb_run_id") or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        ids["wandb_run_id"] = run_id
        self.run = wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir), config=config or {})

    def log(self, step: int, values: dict[str, float], record: dict[str, Any]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() returns before W&B's service has written everything; teardown waits for it,
        # so the run's file is complete even if the rank is killed right after training.
        wandb.teardown()


class MlflowSink:
    def __init__(self, run_dir: Path, ids: dict[str, Any], config: dict[str, Any] | None):
        import mlflow
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # MLflow's own default when the variable is unset (./mlruns before MLflow 3, ./mlflow.db
        # since): where `mlflow ui` started in the same folder looks.
        uri = os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
        self.client = MlflowClient(tracking_uri=uri)
        run_id = ids.get("mlflow_run_id") if ids.get("mlflow_tracking_uri") == uri else None
        if run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "zeropipe")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment_id, run_name=run_dir.name, tags={"zeropipe.run_dir": str(run_dir)}).info.run_id
            params = [Param(key, str(value)[:500]) for key, value in flatten(config or {}).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[start : start + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        ids.update(mlflow_run_id=run_id, mlflow_tracking_uri=uri)
        self.run_id = run_id

    def log(self, step: int, values: dict[str, float], record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        timestamp = int(1000 * (record["time"] if is_number(record.get("time")) else time.time()))
        self.client.log_batch(self.run_id, metrics=[Metric(name, value, timestamp, step) for name, value in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def flatten(node: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


class MetricSinks:
    """The run's metric sinks on rank 0; nothing on the other ranks.

    Args:
        run_dir: the run directory (TensorBoard writes RUN_DIR/tensorboard).
        logging_section: the config's ``logging`` section (LoggingSection or a dict).
        rank: this process's rank; only rank 0 logs.
    """

    def __init__(self, run_dir: str | Path, logging_section: Any, rank: int):
        self.run_dir = Path(run_dir)
        self.sinks: dict[str, Any] = {}
        self.warnings: list[str] = []
        if rank != 0:
            return
        self.ids_file = self.run_dir / IDS_FILE
        ids = self.read_ids()
        config = self.read_config()
        if setting(logging_section, "tensorboard", True):
            self.start("tensorboard", "tensorboard", lambda: TensorBoardSink(self.run_dir))
        if setting(logging_section, "wandb", False):
            project = setting(logging_section, "wandb_project", "zeropipe")
            self.start("wandb", "wandb", lambda: WandbSink(self.run_dir, project, ids, config))
        if setting(logging_section, "mlflow", False):
            self.start("mlflow", "mlflow-skinny (or mlflow)", lambda: MlflowSink(self.run_dir, ids, config))
        if ids:
            self.ids_file.write_text(json.dumps(ids, indent=2))

    def start(self, name: str, package: str, make) -> None:
        try:
            self.sinks[name] = make()
        except ImportError as err:
            self.warn(f"logging.{name} is on but {err.name or package} is not installed: pip install {package} (or zeropipe[{name}]); {name} logging is off for this run")
        except Exception as err:  # noqa: BLE001 - a tracking service must not stop training
            self.warn(f"logging.{name}: could not start ({type(err).__name__}: {err}); {name} logging is off for this run")

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        log.warning(message)

    def read_ids(self) -> dict[str, Any]:
        try:
            value = json.loads(self.ids_file.read_text())
            return value if isinstance(value, dict) else {}
        except (OSError, ValueError):
            return {}

    def read_config(self) -> dict[str, Any] | None:
        """The run's config as plain values, for the trackers' run config; None when it cannot be read."""
        from zeropipe.errors import ZeroPipeError
        from zeropipe.rundir import RunDir

        try:
            return RunDir(self.run_dir).read_config_fields() or None
        except (OSError, ZeroPipeError):
            return None

    @property
    def active(self) -> list[str]:
        return list(self.sinks)

    def log(self, record: dict[str, Any]) -> None:
        """Send one metrics record (one optimizer step) to every sink."""
        if not self.sinks:
            return
        step = int(record.get("step", 0))
        values = scalars(record)
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(step, values, record)
            except Exception as err:  # noqa: BLE001
                self.warn(f"logging.{name}: logging failed ({type(err).__name__}: {err}); {name} logging is off from step {step}")
                self.sinks.pop(name, None)
                self.close_one(sink)

    def close(self) -> None:
        """Flush and close every sink (end of training; safe to call twice)."""
        sinks, self.sinks = self.sinks, {}
        for sink in sinks.values():
            self.close_one(sink)

    def close_one(self, sink: Any) -> None:
        try:
            sink.close()
        except Exception as err:  # noqa: BLE001
            log.warning("closing a metric sink failed: %s", err)

    def __enter__(self) -> MetricSinks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["MetricSinks", "scalars"]
