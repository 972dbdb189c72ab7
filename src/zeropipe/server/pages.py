"""The HTML pages. Each is a thin template; its script draws it from the JSON API."""

from __future__ import annotations

from pathlib import Path as FilePath

from fastapi import APIRouter, Path, Request
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.templating import Jinja2Templates

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=FilePath(__file__).parent / "templates")


def page(request: Request, template: str, title: str, status_code: int = 200, **context) -> HTMLResponse:
    return templates.TemplateResponse(request, template, {"title": title, "version": request.app.state.version, **context}, status_code=status_code)


@router.get("/", response_class=HTMLResponse)
def runs_page(request: Request):
    return page(request, "runs.html", "Runs", nav="runs")


@router.get("/new", response_class=HTMLResponse)
def new_run_page(request: Request):
    return page(request, "new.html", "New run", nav="new")


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: int = Path(ge=1, le=2**53)):
    run = request.app.state.store.run(run_id)  # 404 for an unknown run, before drawing a page for it
    return page(request, "run.html", f"Run {run_id}", nav="runs", run_id=run_id, foreign=run.get("origin") != "ui")


@router.get("/generate", response_class=HTMLResponse)
def generate_page(request: Request):
    return page(request, "generate.html", "Generate", nav="generate")


@router.get("/chat", response_class=HTMLResponse)
def chat_page(request: Request):
    return page(request, "chat.html", "Chat", nav="chat")


@router.get("/draw", response_class=HTMLResponse)
def draw_page(request: Request):
    return page(request, "draw.html", "Draw", nav="draw")


@router.get("/dataset", response_class=HTMLResponse)
def dataset_page(request: Request):
    return page(request, "dataset.html", "Dataset", nav="dataset")


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request):
    return page(request, "compare.html", "Compare", nav="compare")


@router.get("/environment", response_class=HTMLResponse)
def environment_page(request: Request):
    return page(request, "environment.html", "Environment", nav="environment")


@router.get("/favicon.ico")
def favicon():
    return FileResponse(FilePath(__file__).parent / "static" / "favicon.svg", media_type="image/svg+xml")
