"""The FastAPI application: JSON API, server-sent events, pages and static files.

``create_app`` takes a ``RunStore`` and returns the app; ``zeropipe ui`` serves it with
uvicorn. A background thread keeps the store in step with the run directories (once a
second), so pages and event streams only read the database and the metrics cache.
"""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from zeropipe import __version__
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.server.security import LOOPBACK_NAMES, Guard
from zeropipe.store import ActionRefused, OutsideRoots, PresetNotFound, RunNotFound, RunStore

log = logging.getLogger(__name__)
HERE = Path(__file__).parent


class Refresher:
    """Re-index the runs every ``interval`` seconds (new directories every fifth time)."""

    def __init__(self, store: RunStore, interval: float):
        self.store = store
        self.interval = interval
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="zeropipe-refresh", daemon=True)

    def loop(self) -> None:
        tick = 0
        while not self.stopping.is_set():
            try:
                self.store.refresh(scan=tick % 5 == 0)
                for run in self.store.runs(state="running,starting,stopping"):
                    # Keep live runs' series warm: their pages and streams answer at once.
                    self.store.series.get(self.store.metrics_file(run))
                self.store.series.save_all()
            except Exception:  # noqa: BLE001 - one bad directory must not stop the refreshing
                log.exception("refreshing the run store failed")
            tick += 1
            self.stopping.wait(self.interval)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)


def create_app(store: RunStore, token: str | None = None, bind_host: str = "127.0.0.1", refresh_interval: float | None = 1.0) -> FastAPI:
    """The web app over ``store``.

    Args:
        token: required on every request when set (``zeropipe ui`` sets one whenever it binds
            a non-loopback address).
        bind_host: the address served; on loopback, requests for other Host names are refused.
        refresh_interval: seconds between re-indexing passes; None for none (tests call
            ``store.refresh()`` themselves).
    """

    if token is not None and not token.strip():
        raise ValueError("an empty token matches no request: pass None for no token")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        refresher = Refresher(store, refresh_interval) if refresh_interval else None
        if refresher:
            refresher.start()
        try:
            yield
        finally:
            app.state.stopping.set()
            if refresher:
                refresher.stop()
            store.series.save_all(force=True)

    app = FastAPI(
        title="ZeRO-Pipe",
        version=__version__,
        description="Set up, launch, watch, stop, resume and export DeepSpeed ZeRO training runs.",
        lifespan=lifespan,
        docs_url=None,  # served below from the package's own copy of Swagger UI: FastAPI's default loads it from a CDN
        redoc_url=None,
    )
    app.state.store = store
    app.state.version = __version__
    # Set when the server is asked to stop (Ctrl-C): event streams end at once, so the
    # server is not left waiting for browser tabs that would hold them open for minutes.
    app.state.stopping = threading.Event()
    from zeropipe.server.generation import Generator

    app.state.generator = Generator(readable=store.roots.readable())  # a file of a checkpoint or export that links out of these is not loaded
    from zeropipe.server.security import is_loopback

    allowed = None
    if token is None and is_loopback(bind_host):
        allowed = set(LOOPBACK_NAMES) | {bind_host}
    app.add_middleware(Guard, token=token, allowed_hosts=allowed)
    add_error_handlers(app)

    from zeropipe.server import api, pages, workbench

    app.include_router(api.router)
    app.include_router(workbench.router)
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.get("/docs", include_in_schema=False)
    def api_docs():
        # FastAPI's get_swagger_ui_html starts Swagger UI from an inline script, which the
        # content security policy refuses: the same page, started from static/api-docs.js.
        return HTMLResponse(
            "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><meta name=\"viewport\" content=\"width=device-width, initial-scale=1.0\">"
            f'<link rel="stylesheet" href="/static/vendor/swagger-ui.css?v={__version__}"><link rel="icon" href="/favicon.ico">'
            "<title>ZeRO-Pipe API</title></head><body><div id=\"swagger-ui\"></div>"
            f'<script src="/static/vendor/swagger-ui-bundle.js?v={__version__}"></script><script src="/static/api-docs.js?v={__version__}"></script>'
            "</body></html>"
        )

    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every failure becomes a status code and a message; never a traceback."""

    def error(status: int, detail: str, **extra) -> JSONResponse:
        return JSONResponse({"detail": detail, **extra}, status_code=status)

    def wants_page(request: Request) -> bool:
        """A browser opening a page (not the API, not a file): it gets a page, not JSON."""
        path = request.url.path
        return request.method == "GET" and not path.startswith(("/api/", "/static/")) and "text/html" in request.headers.get("accept", "")

    def not_found_page(request: Request, detail: str):
        from zeropipe.server.pages import page

        return page(request, "not_found.html", "Not found", nav="", detail=detail, status_code=404)

    @app.exception_handler(ConfigError)
    async def config_error(request: Request, err: ConfigError):
        return error(422, str(err), problems=[{"key": k, "message": m} for k, m in err.problems])

    @app.exception_handler(RunNotFound)
    async def not_found(request: Request, err: RunNotFound):
        return not_found_page(request, str(err)) if wants_page(request) else error(404, str(err))

    @app.exception_handler(PresetNotFound)
    async def no_preset(request: Request, err: PresetNotFound):
        return error(404, str(err))

    @app.exception_handler(OutsideRoots)
    async def outside(request: Request, err: OutsideRoots):
        return error(403, str(err))

    @app.exception_handler(ActionRefused)
    async def refused(request: Request, err: ActionRefused):
        return error(409, str(err))

    @app.exception_handler(ZeroPipeError)
    async def zeropipe_error(request: Request, err: ZeroPipeError):
        from zeropipe.check import CheckFailed

        if isinstance(err, CheckFailed):
            return error(422, str(err), findings=[f.to_dict() for f in err.findings])
        return error(400, str(err))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError):
        problems = []
        for item in err.errors():
            where = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
            problems.append({"key": where, "message": item.get("msg", "invalid")})
        text = "; ".join(f"{p['key']}: {p['message']}" if p["key"] else p["message"] for p in problems)
        return error(422, f"malformed request: {text}", problems=problems)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        if err.status_code == 404 and wants_page(request):
            return not_found_page(request, f"There is no page {request.url.path}.")
        return error(err.status_code, str(err.detail))

    @app.exception_handler(RecursionError)
    async def too_deep(request: Request, err: RecursionError):
        # Only input nested thousands deep gets here (parsers recurse); its traceback is thousands of lines of nothing.
        log.warning("refused %s %s: the request nests too deeply (RecursionError)", request.method, request.url.path)
        return error(422, "the request nests too deeply to be read: a run config has a few levels of sections")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception):
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        return error(500, f"internal error ({type(err).__name__}); the server log has the details")
