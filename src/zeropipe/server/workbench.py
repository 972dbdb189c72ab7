"""The API of the Chat page (multi-turn answers from a run), the Dataset page and the loaded model's state.

Everything a request sends is bounded here (turns, characters, new tokens) before a model
sees it; runs are named by id and their weights by checkpoint tag or export name, never by path.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Literal

from fastapi import APIRouter, HTTPException, Path, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from zeropipe.rundir import is_inside
from zeropipe.server import events
from zeropipe.store import RunStore

router = APIRouter(prefix="/api")

MAX_TURNS = 40  # user messages in one conversation
MAX_MESSAGE_CHARS = 8000
MAX_CONVERSATION_CHARS = 64_000
MAX_SYSTEM_CHARS = 4000


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def store_of(request: Request) -> RunStore:
    return request.app.state.store


# -------------------------------------------------------------------- chat
class Message(Strict):
    role: Literal["user", "assistant"] = Field(..., description="who wrote it: the person (user) or the model (assistant)")
    content: str = Field(..., max_length=MAX_MESSAGE_CHARS, description="the message's text")


class ChatRequest(Strict):
    run_id: int = Field(..., ge=1, le=2**53, description="the run whose model answers")
    checkpoint: str | None = Field(None, max_length=64, description="a complete checkpoint of the run (default: the latest)")
    export: str | None = Field(None, max_length=100, description="a finished export of the run instead of a checkpoint (its folder name)")
    system: str = Field("", max_length=MAX_SYSTEM_CHARS, description="the system prompt (empty: none)")
    messages: list[Message] = Field(
        ..., min_length=1, max_length=2 * MAX_TURNS, description="the conversation so far, oldest first, ending with the user turn to answer"
    )
    max_new_tokens: int | None = Field(None, ge=1, le=1024, description="default: the run's generate.max_new_tokens")
    temperature: float = Field(0.0, ge=0, le=10, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = Field(0, ge=0, le=2**31)
    image: str | None = Field(None, max_length=1000, description="vision-language models: an image file inside the runs or data folders, shown with the first user turn")

    @model_validator(mode="after")
    def a_conversation(self):
        if self.messages[-1].role != "user":
            raise ValueError("the conversation must end with the user turn to answer")
        if sum(len(m.content) for m in self.messages) + len(self.system) > MAX_CONVERSATION_CHARS:
            raise ValueError(f"the conversation holds more than {MAX_CONVERSATION_CHARS} characters: start a new one")
        if sum(m.role == "user" for m in self.messages) > MAX_TURNS:
            raise ValueError(f"more than {MAX_TURNS} turns: start a new conversation")
        if self.checkpoint is not None and self.export is not None:
            raise ValueError("name a checkpoint or an export, not both")
        return self

    def conversation(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system.strip() else []
        return system + [m.model_dump() for m in self.messages]


@router.post("/chat", summary="The next assistant turn of a conversation with a run's checkpoint or export; server-sent events as /api/generate")
def chat(request: Request, body: ChatRequest):
    store = store_of(request)
    run = store.run(body.run_id)
    source, checkpoint = store.model_source(run, body.export, body.checkpoint)
    settings = {"max_new_tokens": body.max_new_tokens, "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed, "raw": False}
    from zeropipe.server.generation import chat_image

    image = chat_image(store.readable_file(body.image)) if body.image else None
    generator, label = request.app.state.generator, f"run {run['name']} ({checkpoint or 'export ' + str(body.export)})"
    return events.cancellable(lambda cancel: generator.stream(source, checkpoint, body.conversation(), settings, image, cancel=cancel, label=label))


@router.get("/model", summary="The model loaded for Generate and Chat: what, on which device and why, and when it is let go")
def loaded_model(request: Request):
    return request.app.state.generator.state()


# ----------------------------------------------------------------- dataset
class DatasetRequest(Strict):
    path: str = Field(..., min_length=1, max_length=1000, description="an image or video folder inside the data (or runs) folders")
    caption_ext: str = Field(".txt", pattern=r"^\.?[A-Za-z0-9_-]{1,16}$", description="the caption file's suffix beside each image (data.images.caption_ext)")
    resolution: int = Field(1024, ge=16, le=8192, description="data.images.resolution: the buckets' area is about resolution squared")
    bucket_step: int = Field(64, ge=8, le=1024, description="data.images.bucket_step")
    max_aspect: float = Field(2.0, ge=1.0, le=8.0, description="data.images.max_aspect")
    bucketing: bool = Field(True, description="data.images.bucketing: false trains every image at resolution x resolution")
    videos: bool = Field(False, description="a video model's folder: clips are probed (frames, frame rate) with the images")
    offset: int = Field(0, ge=0, le=1_000_000, description="the first file shown (files are sorted by path)")
    limit: int = Field(24, ge=1, le=60, description="files shown, with thumbnails")


@router.post("/dataset", summary="An image or video folder as diffusion training reads it: buckets, captions, and the files it rejects with why")
def dataset(request: Request, body: DatasetRequest):
    from zeropipe.server.dataset import dataset_view
    from zeropipe.store import OutsideRoots

    from zeropipe.confine import confining
    from zeropipe.store.sandbox import hidden_in_data

    store = store_of(request)
    folder = store.roots.absolute(body.path)
    readable = store.roots.readable()
    # One answer for a folder outside, hidden or missing: the page tells nothing of what lies outside.
    if not any(is_inside(folder, root) for root in readable) or hidden_in_data(folder, store.roots) or not folder.is_dir():
        raise OutsideRoots(f"{body.path} is not a folder inside the folders this UI may read ({', '.join(map(str, readable))}); hidden folders are not read")
    # Every caption, metadata file and sub-folder is tested when it is opened: a link out of the folders is not followed.
    with one_at_a_time("dataset"), confining(store.confinement):
        return dataset_view(folder, readable, body.caption_ext, body.resolution, body.bucket_step, body.max_aspect, body.bucketing, body.videos, body.offset, body.limit)


# One heavy look (a Dataset view, a data preview) of each kind at a time: each decodes images or reads
# data files up to its bounds, and a second at once would double the memory it may take.
_HEAVY: dict[str, threading.Lock] = {"dataset": threading.Lock(), "preview": threading.Lock()}


@contextmanager
def one_at_a_time(kind: str):
    lock = _HEAVY[kind]
    if not lock.acquire(blocking=False):
        raise HTTPException(429, f"another {kind} look is running (one at a time, so that their memory never adds up): try again when it ends")
    try:
        yield
    finally:
        lock.release()


# -------------------------------------------------------------- sample now
@router.post("/runs/{run_id}/sample", status_code=202, summary="Ask a running run for samples now: its ranks draw them together at the next step")
def sample_now(request: Request, run_id: int = Path(ge=1, le=2**53, description="the run's id in the store")):
    return store_of(request).request_samples(run_id)


# -------------------------------------------------------------------- draw
MAX_DRAW_PIXELS = 2048 * 2048  # width x height x frames of one drawing: minutes on a CPU, seconds on a GPU
MAX_CPU_DRAW_WORK = 256 * 256 * 50  # width x height x frames x steps on a CPU: a 256x256 picture in 50 steps (minutes for a real model)
DRAW_NAME = r"^draw-[0-9]{8}-[0-9]{6}-[0-9]{3}$"
DRAW_FILE = r"^[A-Za-z0-9_-]{1,64}\.(png|mp4|webp|json)$"


class DrawRequest(Strict):
    run_id: int = Field(..., ge=1, le=2**53, description="the diffusion run whose weights draw")
    checkpoint: str | None = Field(None, max_length=64, description="a complete checkpoint of the run (default: the latest)")
    export: str | None = Field(None, max_length=100, description="a finished export of the run instead (a pipeline folder or a LoRA)")
    prompt: str = Field(..., min_length=1, max_length=2000, description="what to draw")
    negative_prompt: str = Field("", max_length=2000, description="what not to draw (pipelines that take one)")
    width: int | None = Field(None, ge=16, le=2048, multiple_of=8, description="pixels, a multiple of 8 (default: the run's data.images.resolution)")
    height: int | None = Field(None, ge=16, le=2048, multiple_of=8, description="pixels, a multiple of 8 (default: the run's data.images.resolution)")
    steps: int | None = Field(None, ge=1, le=150, description="denoising steps (default: the run's generate.sample_steps)")
    guidance: float | None = Field(None, ge=0, le=30, description="classifier-free guidance scale (default: the run's generate.guidance_scale)")
    seed: int = Field(0, ge=0, le=2**31)
    frames: int | None = Field(None, ge=1, le=257, description="video models: frames of the clip (default: the pipeline's)")

    @model_validator(mode="after")
    def bounded(self):
        if (self.width or 0) * (self.height or 0) * (self.frames or 1) > MAX_DRAW_PIXELS:
            raise ValueError(f"width x height x frames is over {MAX_DRAW_PIXELS:,} pixels: draw smaller (or fewer frames)")
        if self.checkpoint is not None and self.export is not None:
            raise ValueError("name a checkpoint or an export, not both")
        return self


def draw_defaults(store: RunStore, run: dict) -> dict:
    """What Draw draws when the request leaves it out: the run's own resolution, steps and guidance (as its samples)."""
    import yaml

    try:
        config = yaml.safe_load(store.config_text(run)) or {}
    except Exception:  # noqa: BLE001 - an unreadable config: the pipeline's usual values
        config = {}
    images = ((config.get("data") or {}).get("images") or {}) if isinstance(config, dict) else {}
    generate = (config.get("generate") or {}) if isinstance(config, dict) else {}

    def number(value, default, low, high):
        return min(high, max(low, value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    side = int(number(images.get("resolution"), 512, 16, 2048)) // 8 * 8
    return {"width": side, "height": side, "steps": int(number(generate.get("sample_steps"), 20, 1, 150)), "guidance": float(number(generate.get("guidance_scale"), 5.0, 0, 30))}


def device_bound(settings: dict):
    """The work a drawing may ask of the device it runs on: on a CPU, width x height x frames x steps is capped."""

    def bound(device) -> None:
        work = settings["width"] * settings["height"] * (settings.get("frames") or 1) * settings["steps"]
        if getattr(device, "type", str(device)) == "cpu" and work > MAX_CPU_DRAW_WORK:
            from zeropipe.errors import ZeroPipeError

            raise ZeroPipeError(
                f"on the CPU a drawing is at most {MAX_CPU_DRAW_WORK:,} pixel-steps (width x height x frames x steps, e.g. 256x256 in 50 steps); "
                f"{settings['width']}x{settings['height']}{' x ' + str(settings['frames']) + ' frames' if settings.get('frames') else ''} in {settings['steps']} steps "
                f"is {work:,}: draw smaller or with fewer steps, or free a GPU (the model goes to a GPU no run uses)"
            )

    return bound


@router.post("/draw", summary="Draw a picture (a clip for video models) with a diffusion run's checkpoint or export; kept in RUN/draws/. "
             "Its progress is in GET /api/model (busy.step of busy.steps); closing the request cancels it")  # fmt: skip
async def draw(request: Request, body: DrawRequest):
    import json
    import time

    from starlette.concurrency import run_in_threadpool

    from zeropipe.server.generation import Cancelled, ModelBusy
    from zeropipe.store import ActionRefused

    store = store_of(request)

    def prepare():
        run = store.run(body.run_id)
        source, checkpoint = store.model_source(run, body.export, body.checkpoint)
        defaults = draw_defaults(store, run)
        now = time.time()
        name = time.strftime("draw-%Y%m%d-%H%M%S", time.localtime(now)) + f"-{int(now * 1000) % 1000:03d}"
        out_dir = store.own(run, f"draws/{name}")  # confined: a draws/ link out of the run is refused
        return run, source, checkpoint, defaults, name, out_dir, now

    run, source, checkpoint, defaults, name, out_dir, now = await run_in_threadpool(prepare)
    weights = f"export {body.export}" if checkpoint is None else f"checkpoint {checkpoint}"
    settings = body.model_dump(include={"prompt", "negative_prompt", "width", "height", "steps", "guidance", "seed", "frames"})
    settings.update({key: value for key, value in defaults.items() if settings.get(key) is None})
    if settings["width"] * settings["height"] * (settings["frames"] or 1) > MAX_DRAW_PIXELS:
        raise HTTPException(422, f"width x height x frames is over {MAX_DRAW_PIXELS:,} pixels: draw smaller (or fewer frames)")
    generator, label = request.app.state.generator, f"run {run['name']} ({weights})"
    try:  # the page closed or its Cancel pressed: the drawing stops at its next step
        result = await events.until_disconnected(request, lambda cancel: generator.draw(source, checkpoint, out_dir, settings, cancel, label, device_bound(settings)))
    except ModelBusy as err:
        raise ActionRefused(str(err)) from None
    except Cancelled as err:
        raise HTTPException(409, str(err)) from None
    record = {"name": name, "weights": weights, **settings, **result, "created_at": now}
    (out_dir / "draw.json").write_text(json.dumps(record, indent=2))
    return record


def draws_pictures(store: RunStore, run: dict) -> bool:
    """Whether the run's family draws (the family says so: ``draws_images``), from its config's model.family; a run with samples does."""
    from zeropipe.families import family_named

    if run.get("has_samples"):
        return True
    try:
        name = ((store.run_dir(run).read_config_fields() or {}).get("model") or {}).get("family")
        return bool(name) and bool(getattr(family_named(str(name)), "draws_images", False))
    except Exception:  # noqa: BLE001 - an unreadable run directory or a plug-in this server has not loaded: not listed
        return False


@router.get("/draw/runs", summary="The runs that can draw (diffusion runs), newest first")
def drawing_runs(request: Request):
    store = store_of(request)
    return {"runs": [run for run in store.runs() if run["state"] != "starting" and draws_pictures(store, run)]}


@router.get("/runs/{run_id}/draws", summary="The pictures drawn with a run's weights, newest first, and the settings Draw starts from (the run's own)")
def list_draws(request: Request, run_id: int = Path(ge=1, le=2**53)):
    import json
    import re

    store = store_of(request)
    run = store.run(run_id)
    folder = store.own_or_none(run, "draws")
    out = []
    if folder is not None and folder.is_dir():
        for entry in sorted(folder.iterdir(), reverse=True)[:100]:
            info = store.own_or_none(run, f"draws/{entry.name}/draw.json") if re.match(DRAW_NAME, entry.name) else None
            if info is None or not info.is_file():
                continue
            try:
                out.append(json.loads(info.read_text()))
            except ValueError:
                continue
    return {"draws": out, "defaults": draw_defaults(store, run), "cpu_limit": MAX_CPU_DRAW_WORK}


@router.get("/runs/{run_id}/draws/{name}/{file}", summary="A file of a drawing (PNG, mp4 or animated WebP)")
def draw_file(request: Request, run_id: int = Path(ge=1, le=2**53), name: str = Path(pattern=DRAW_NAME), file: str = Path(pattern=DRAW_FILE)):
    from fastapi.responses import FileResponse

    from zeropipe.store import RunNotFound

    store = store_of(request)
    run = store.run(run_id)
    path = store.own_or_none(run, f"draws/{name}/{file}")
    if path is None or not path.is_file():
        raise RunNotFound(f"no file {file} in drawing {name} of run {run['name']}")
    return FileResponse(path)
