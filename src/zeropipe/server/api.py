"""The JSON API behind every page (its OpenAPI schema is served at /docs and /openapi.json)."""

from __future__ import annotations

import time
from pathlib import Path as FilePath
from typing import Any, Literal

import yaml
from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from starlette.concurrency import iterate_in_threadpool

from zeropipe.errors import ConfigError
from zeropipe.server import checking, events
from zeropipe.server.formschema import form_schema
from zeropipe.store import ActionRefused, RunNotFound, RunStore, parse_yaml_text
from zeropipe.store.archive import tar_size, tar_stream
from zeropipe.store.series import EVAL_SCALARS

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
    gpus: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="ranks to resume on (default: the config's hardware.gpus); another count than the checkpoint's converts it "
        "to a universal checkpoint and keeps the global batch (the accumulation is recomputed)",
    )
    confirm: StrictBool = Field(
        False,
        description="must be true: resuming from an older checkpoint moves the newer ones aside (into checkpoints/superseded-DATE), "
        "so a resume is never done by a request that did not ask for it explicitly",
    )


class ExportRequest(Strict):
    checkpoint: str | None = Field(None, max_length=64, description="checkpoint tag; default: the latest complete one")
    name: str | None = Field(None, max_length=100, description="folder name under RUN/exports (default: the tag)")
    merge: StrictBool = Field(False, description="LoRA runs: merge the adapter into the base weights")
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
    run_dir = store.run_dir(run)  # confined: a file leading out of the run reads as missing
    return {
        "run": run,
        "status": run_dir.read_status() or None,
        "plan": run_dir.read_plan_fields() or None,
        "summary": run_dir.read_summary() or None,
        "logs": store.log_names(run),
        "checkpoints": store.checkpoints(run),
        "exports": store.exports(run),
        "evaluations": store.evaluations(run),
        "held_out": store.has_held_out(run),
        "actions": store.actions(run),
        "progress": store.progress(run) or None,
        "generations": store.generations(run),
        "completions": run_dir.read_completions(),  # GRPO: the last completions sampled in the loop (untrusted text)
        "tensorboard": bool(store.own_or_none(run, "tensorboard")) and (FilePath(run["path"]) / "tensorboard").is_dir(),
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
    available = store.series.get(store.metrics_file(run)).keys()
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
    if not body.confirm:
        raise HTTPException(400, "resuming moves the checkpoints newer than the chosen one aside: send \"confirm\": true to resume")
    return {"run": store_of(request).resume(run_id, body.checkpoint, body.gpus)}


@router.post("/runs/{run_id}/export", status_code=202, summary="Export a checkpoint to a Hugging Face directory under RUN/exports")
def export_run(request: Request, body: ExportRequest, run_id: int = RunId):
    return {"export": store_of(request).export(run_id, body.checkpoint, body.name, body.merge, body.dtype)}


class DeleteRequest(Strict):
    confirm: str = Field(..., max_length=100, description="the run's name: a delete must name what it deletes")


class RenameRequest(Strict):
    name: str = Field(..., max_length=100, description="the new name (letters, digits, '.', '_', '-'); the folder is renamed too")


@router.delete("/runs/{run_id}", summary="Delete a run that has ended, with its checkpoints, exports and logs")
def delete_run(request: Request, body: DeleteRequest, run_id: int = RunId):
    return store_of(request).delete(run_id, body.confirm)


@router.post("/runs/{run_id}/rename", summary="Rename a run that has ended (its folder and its config.yaml's run.name)")
def rename_run(request: Request, body: RenameRequest, run_id: int = RunId):
    return {"run": store_of(request).rename(run_id, body.name)}


@router.get("/runs/{run_id}/exports/{name}/archive", summary="Download a finished export as a .tar archive", response_class=StreamingResponse)
def export_archive(request: Request, run_id: int = RunId, name: str = Path(max_length=100)):
    store = store_of(request)
    run = store.run(run_id)
    folder = store.export_folder(run_id, name)
    from zeropipe.server.generation import links_out

    linked = [link for link, _ in links_out([folder], [])]  # every link: an archive holds regular files only, so a linked file would be missing
    if linked:
        names = ", ".join(str(link.relative_to(folder)) for link in linked[:3])
        raise ActionRefused(f"export {name} holds {names} as {'a link' if len(linked) == 1 else 'links'}: a download sends regular files only, "
                            "and the archive would lack it; replace the link by the file itself, or export again")  # fmt: skip
    top = f"{run['name']}-{name}"
    headers = {"Content-Disposition": f'attachment; filename="{top}.tar"', "Content-Length": str(tar_size(folder, top))}
    return StreamingResponse(iterate_in_threadpool(tar_stream(folder, top)), media_type="application/x-tar", headers=headers)


class EvalRequest(Strict):
    checkpoint: str | None = Field(None, max_length=64, description="checkpoint tag; default: the latest complete one")
    data: str | None = Field(None, max_length=1000, description="a data file inside the data folders; default: the run's held-out data")


@router.post("/runs/{run_id}/eval", status_code=202, summary="Start `zeropipe eval` on a checkpoint: eval loss and perplexity, kept with the run")
def evaluate_run(request: Request, body: EvalRequest, run_id: int = RunId):
    return {"evaluation": store_of(request).evaluate(run_id, body.checkpoint, body.data)}


@router.get("/compare", summary="Loss (or another metric) of several runs, each downsampled")
def compare(
    request: Request,
    ids: str = Query(..., max_length=500, pattern=r"^\d+(,\d+)*$", description="comma-separated run ids"),
    key: str = Query("loss", max_length=100),
    width: int = Query(900, ge=10, le=20000),
):
    store = store_of(request)
    out, missing, first_miss = [], [], None
    for run_id in dict.fromkeys(int(i) for i in ids.split(",")):
        try:
            run = store.run(run_id)  # an id past any run's (even past SQLite's range) is "no run"
        except RunNotFound as err:
            # One deleted run (an old link) must not hide the others: they are drawn, it is named.
            missing.append(run_id)
            first_miss = first_miss or err
            continue
        if key in EVAL_SCALARS:
            # Evaluations (a diffusion run's validation loss, a language model's eval loss) are at a few steps only: all of them, never downsampled away.
            evals = store.series.get(store.metrics_file(run)).evals()
            data = {"step": evals["step"], "series": {key: evals[key]}}
        else:
            data = store.metrics(run, [key], width)
        out.append({"id": run["id"], "name": run["name"], "state": run["state"], "step": data["step"], "values": data["series"].get(key, [])})
    if not out and first_miss is not None:
        raise first_miss  # none of them: a 404
    return {"key": key, "runs": out, "missing": missing}


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


class PreviewRequest(ConfigSubmission):
    limit: int = Field(20, ge=1, le=200, description="examples shown")


@router.post("/data/preview", summary="The first records of a config's data as the trainer will see them, and the records it would skip")
async def data_preview(request: Request, body: PreviewRequest):
    from starlette.concurrency import run_in_threadpool

    from zeropipe.confine import confining
    from zeropipe.server.preview import preview
    from zeropipe.server.workbench import one_at_a_time

    store = store_of(request)
    config, _ = await run_in_threadpool(store.validate, body.raw())  # every path confined, as for a launch

    def look(cancel):
        with one_at_a_time("preview"), confining(store.confinement):  # and every file the preview opens: a symlink out of a data folder is skipped, as training skips it
            return preview(config, body.limit, cancel)

    return await events.until_disconnected(request, look)  # the client leaves: the preview stops at its next record


# --------------------------------------------------------------- generate
class GenerateRequest(Strict):
    run_id: int = Field(..., ge=1, le=2**53, description="the run whose model answers")
    checkpoint: str | None = Field(None, max_length=64, description="a complete checkpoint of the run (default: the latest)")
    export: str | None = Field(None, max_length=100, description="a finished export of the run instead of a checkpoint (its folder name)")
    prompt: str = Field(..., min_length=1, max_length=8000, description="rendered as a user turn with the training template (unless raw)")
    max_new_tokens: int | None = Field(None, ge=1, le=1024, description="default: the run's generate.max_new_tokens")
    temperature: float = Field(0.0, ge=0, le=10, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = Field(0, ge=0, le=2**31)
    raw: bool = Field(False, description="continue the prompt text as it is (models trained on plain text)")
    image: str | None = Field(None, max_length=1000, description="vision-language models: an image file inside the runs or data folders")


@router.post("/generate", summary="Answer a prompt with a run's checkpoint or export; server-sent events: source, token..., done (or error)")
def generate_answer(request: Request, body: GenerateRequest):
    store = store_of(request)
    run = store.run(body.run_id)
    source, checkpoint = store.model_source(run, body.export, body.checkpoint)
    settings = {"max_new_tokens": body.max_new_tokens, "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "raw": body.raw}
    from zeropipe.server.generation import chat_image

    image = chat_image(store.readable_file(body.image)) if body.image else None
    generator, label = request.app.state.generator, f"run {run['name']} ({checkpoint or 'export ' + str(body.export)})"
    return events.cancellable(lambda cancel: generator.stream(source, checkpoint, body.prompt, settings, image, cancel=cancel, label=label))


# ---------------------------------------------------------------- presets
PresetKind = Path(pattern="^(example|saved|run)$", description="example (shipped), saved (by you) or run (a past run's config; name: its id)")
PresetName = Path(max_length=100, description="the example's or preset's name, or the run's id")


class PresetSubmission(Strict):
    name: str = Field(..., max_length=100, description="the preset's name (letters, digits, '.', '_', '-')")
    yaml: str = Field(..., max_length=MAX_YAML, description="the config as YAML text (need not be complete)")
    overwrite: StrictBool = Field(False, description="replace a saved preset of that name")


@router.get("/presets", summary="Configs to start a new run from: the shipped examples, saved presets and past runs")
def list_presets(request: Request):
    return {"presets": store_of(request).presets.list()}


@router.get("/presets/{kind}/{name}", summary="A preset as YAML ready to edit: a fresh run name, no output_dir, a past run's defaults left out")
def load_preset(request: Request, kind: str = PresetKind, name: str = PresetName):
    return store_of(request).presets.load(kind, name)


@router.post("/presets", status_code=201, summary="Save a config as a preset")
def save_preset(request: Request, body: PresetSubmission):
    return {"preset": store_of(request).presets.save(body.name, body.yaml, body.overwrite)}


@router.delete("/presets/saved/{name}", summary="Delete a saved preset")
def delete_preset(request: Request, name: str = PresetName):
    store_of(request).presets.delete(name)
    return {"deleted": name}


# ------------------------------------------------------------ environment
@router.get("/doctor", summary="The `zeropipe doctor` report of this machine (the last one; checked once if there is none)")
def doctor(request: Request):
    store = store_of(request)
    # Reading never builds anything: the CPU Adam trial build is a POST (below), which only this UI's own pages can send.
    return checking.doctor_report(str(store.roots.primary_runs), trial_build=False, max_age_seconds=float("inf"))


class DoctorRequest(Strict):
    trial_build: bool = Field(False, description="also build DeepSpeed's CPU Adam in a child process (about a minute the first time)")


@router.post("/doctor/check", summary="Examine this machine again (optionally with the CPU Adam trial build) and return the report")
def doctor_check(request: Request, body: DoctorRequest):
    store = store_of(request)
    return checking.doctor_report(str(store.roots.primary_runs), trial_build=body.trial_build, max_age_seconds=0)


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
