"""The JSON API behind every page (its OpenAPI schema is served at /docs and /openapi.json)."""

from __future__ import annotations

import time
from pathlib import Path as FilePath
from typing import Any, Literal

import yaml
from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from zeropipe.errors import ConfigError
from zeropipe.server import checking, events
from zeropipe.server.formschema import form_schema
from zeropipe.store import RunStore, parse_yaml_text
from zeropipe.store.index import read_json

router = APIRouter(prefix="/api")

RunId = Path(ge=1, le=2**53, description="the run's id in the store")
MAX_YAML = 200_000
CHART_KEYS = "loss,eval_loss,lr,grad_norm,tokens_per_s,samples_per_s,step_time_s,host_rss_bytes/*,gpu_max_allocated_bytes/*"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConfigSubmission(Strict):
    yaml: str | None = Field(None, max_length=MAX_YAML, description="the run config as YAML text")
    config: dict[str, Any] | None = Field(None, description="the run config as a JSON object (instead of yaml)")

    @model_validator(mode="after")
    def one_of_them(self):
        if (self.yaml is None) == (self.config is None):
            raise ValueError("send either 'yaml' (the config as YAML text) or 'config' (a JSON object), not both or neither")
        return self

    def raw(self) -> dict[str, Any]:
        return parse_yaml_text(self.yaml) if self.yaml is not None else self.config


class ResumeRequest(Strict):
    checkpoint: str | None = Field(None, max_length=64, description="checkpoint tag such as step_00000120; default: the latest complete one")


class ExportRequest(Strict):
    checkpoint: str | None = Field(None, max_length=64, description="checkpoint tag; default: the latest complete one")
    name: str | None = Field(None, max_length=100, description="folder name under RUN/exports (default: the tag)")
    merge: bool = Field(False, description="LoRA runs: merge the adapter into the base weights")
    dtype: Literal["bf16", "fp16", "fp32"] | None = Field(None, description="weights dtype (default: the run's precision)")


def store_of(request: Request) -> RunStore:
    return request.app.state.store


# ------------------------------------------------------------------- runs
@router.get("/runs", summary="Runs with their state, progress, ETA and last loss")
def list_runs(
    request: Request,
    state: str | None = Query(None, max_length=200, description="comma-separated states: starting, running, stopping, completed, failed, stopped, lost"),
    q: str | None = Query(None, max_length=200, description="part of the run name"),
):
    return {"runs": store_of(request).runs(state=state, search=q)}


@router.post("/runs", status_code=201, summary="Validate a config and launch `zeropipe train` on it")
def launch_run(request: Request, body: ConfigSubmission):
    return {"run": store_of(request).launch(body.raw())}


@router.get("/runs/stream", summary="Server-sent events: the runs list whenever it changes")
async def runs_stream(request: Request, max_seconds: float = Query(300, ge=0.1, le=3600, description="close after this long; EventSource reconnects")):
    return events.runs_stream(request, store_of(request), max_seconds)


@router.get("/runs/{run_id}", summary="One run: state, plan, summary, failure diagnosis, logs, checkpoints, exports")
def run_detail(request: Request, run_id: int = RunId):
    store = store_of(request)
    run = store.run(run_id)
    run_dir = store.run_dir(run)
    return {
        "run": run,
        "status": run_dir.read_status() or None,
        "plan": read_json(run_dir.plan_file),
        "summary": read_json(run_dir.summary),
        "logs": store.log_names(run),
        "checkpoints": store.checkpoints(run),
        "exports": store.exports(run),
        "generations": store.generations(run),
        "tensorboard": (run_dir.path / "tensorboard").is_dir(),
    }


@router.get("/runs/{run_id}/metrics", summary="Metric columns, downsampled to `width` pixel columns")
def run_metrics(
    request: Request,
    run_id: int = RunId,
    keys: str | None = Query(None, max_length=2000, description="comma-separated metric names (default: all); host_rss_bytes/* means every rank"),
    width: int | None = Query(None, ge=10, le=20000, description="chart width in pixels: at most 4 points per pixel column are returned"),
    after_step: float | None = Query(None, ge=0, description="only steps after this one"),
):
    store = store_of(request)
    run = store.run(run_id)
    return store.metrics(run, expand_keys(store, run, keys), width, after_step)


def expand_keys(store: RunStore, run: dict, keys: str | None) -> list[str] | None:
    if not keys:
        return None
    available = store.series.get(FilePath(run["path"]) / "metrics.jsonl").keys()
    out = []
    for key in keys.split(","):
        key = key.strip()
        if key.endswith("/*"):
            out += [k for k in available if k.startswith(key[:-1])]
        elif key:
            out.append(key)
    return out


@router.get("/runs/{run_id}/stream", summary="Server-sent events: the run's state and its new metric rows")
async def run_stream(
    request: Request,
    run_id: int = RunId,
    after_step: float = Query(0, ge=0, description="the last step the client has"),
    max_seconds: float = Query(300, ge=0.1, le=3600),
):
    store = store_of(request)
    run = store.run(run_id)
    return events.run_stream(request, store, run, after_step, max_seconds)


@router.get("/runs/{run_id}/logs/{name}", summary="The last lines of a rank's (or the launcher's) log")
def run_log(request: Request, run_id: int = RunId, name: str = Path(max_length=20), lines: int = Query(200, ge=1, le=5000)):
    store = store_of(request)
    run = store.run(run_id)
    return {"name": name, "lines": store.read_log(run, name, lines)}


@router.get("/runs/{run_id}/config", summary="The run's fully resolved config.yaml")
def run_config(request: Request, run_id: int = RunId):
    store = store_of(request)
    return {"yaml": store.config_text(store.run(run_id))}


@router.get("/runs/{run_id}/samples", summary="Sample images of a diffusion run (samples/index.jsonl)")
def run_samples(request: Request, run_id: int = RunId):
    store = store_of(request)
    return {"samples": store.samples(store.run(run_id))}


@router.get("/runs/{run_id}/samples/{path:path}", summary="One sample image", response_class=FileResponse)
def sample_image(request: Request, run_id: int = RunId, path: str = Path(max_length=500)):
    store = store_of(request)
    return FileResponse(store.sample_file(store.run(run_id), path))


@router.post("/runs/{run_id}/stop", summary="Stop a running run (SIGTERM to its launcher: every rank stops, the run is marked stopped)")
def stop_run(request: Request, run_id: int = RunId):
    return {"run": store_of(request).stop(run_id)}


@router.post("/runs/{run_id}/resume", summary="Continue a run from a complete checkpoint")
def resume_run(request: Request, body: ResumeRequest, run_id: int = RunId):
    return {"run": store_of(request).resume(run_id, body.checkpoint)}


@router.post("/runs/{run_id}/export", status_code=202, summary="Export a checkpoint to a Hugging Face directory under RUN/exports")
def export_run(request: Request, body: ExportRequest, run_id: int = RunId):
    return {"export": store_of(request).export(run_id, body.checkpoint, body.name, body.merge, body.dtype)}


@router.get("/compare", summary="Loss (or another metric) of several runs, each downsampled")
def compare(
    request: Request,
    ids: str = Query(..., max_length=500, pattern=r"^\d+(,\d+)*$", description="comma-separated run ids"),
    key: str = Query("loss", max_length=100),
    width: int = Query(900, ge=10, le=20000),
):
    store = store_of(request)
    out = []
    for run_id in dict.fromkeys(int(i) for i in ids.split(",")):
        run = store.run(run_id)
        data = store.metrics(run, [key], width)
        out.append({"id": run["id"], "name": run["name"], "state": run["state"], "step": data["step"], "values": data["series"].get(key, [])})
    return {"key": key, "runs": out}


# ----------------------------------------------------------------- config
@router.get("/config/schema", summary="The New-run form: every config field with its help text, default and bounds")
def config_schema():
    return form_schema()


@router.get("/config/template", summary="A small starting config for the New-run page")
def config_template(request: Request):
    name = time.strftime("run-%Y%m%d-%H%M%S")
    template = {
        "run": {"name": name},
        "model": {
            "config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
        },
        "data": {"synthetic": {"task": "arithmetic", "examples": 400}, "max_seq_len": 32},
        "train": {"max_steps": 20, "micro_batch_size": 8, "lr": 1.0e-2, "warmup_steps": 2, "save_every": 10},
        "deepspeed": {"zero_stage": 2, "precision": "bf16"},
    }
    return {"yaml": yaml.safe_dump(template, sort_keys=False)}


@router.post("/config/check", summary="Validate a config: problems, `zeropipe check` findings and the memory plan")
def config_check(request: Request, body: ConfigSubmission):
    try:
        raw = body.raw()
    except ConfigError as err:
        return {"valid": False, "problems": checking.problems_json(err.problems), "findings": [], "plan": {"available": False, "reason": "fix the problems first"}}
    return checking.check_submission(store_of(request), raw)


# ------------------------------------------------------------ environment
@router.get("/doctor", summary="The `zeropipe doctor` report of this machine")
def doctor(request: Request, refresh: bool = Query(False), trial_build: bool = Query(False, description="also build DeepSpeed's CPU Adam (about a minute the first time)")):
    store = store_of(request)
    return checking.doctor_report(str(store.roots.primary_runs), trial_build=trial_build, max_age_seconds=0 if refresh else 120)


@router.get("/health", summary="Liveness, version and the folders this server uses")
def health(request: Request):
    store = store_of(request)
    return {
        "ok": True,
        "version": request.app.state.version,
        "runs_roots": [str(p) for p in store.roots.runs],
        "data_roots": [str(p) for p in store.roots.data],
        "database": str(store.db_path),
        "migrations": store.db.migrations(),
    }
