"""Server-sent events: the runs list as it changes, and one run's state and new metric rows.

Streams read what the refresh thread keeps current; they never start or signal anything.
A stream closes after ``max_seconds`` (the browser's EventSource reconnects by itself, which
is also how a page reattaches to a restarted server) and a run's stream closes once the run
has ended and every row was sent, with a final ``end`` event.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from zeropipe.store import RunNotFound, RunStore

TICK_SECONDS = 1.0
HEARTBEAT_SECONDS = 15.0
MAX_ROWS_PER_EVENT = 5000  # more than this and the page reloads the (downsampled) series instead
ENDED = {"completed", "failed", "stopped", "lost"}


def open_while(request: Request, deadline: float):
    """The stream's loop condition: not past its deadline, the server not stopping."""
    stopping = request.app.state.stopping

    async def still_open() -> bool:
        return time.monotonic() < deadline and not stopping.is_set() and not await request.is_disconnected()

    return still_open


async def pause(request: Request, seconds: float = TICK_SECONDS) -> None:
    """Sleep between polls, waking early when the server is stopping."""
    stopping = request.app.state.stopping
    end = time.monotonic() + seconds
    while not stopping.is_set() and time.monotonic() < end:
        await asyncio.sleep(min(0.1, end - time.monotonic()))


def sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def streaming(generator: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(generator, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def cancellable(make: Callable[[threading.Event], Iterator[str]]) -> StreamingResponse:
    """A long answer's events, stopped when its client leaves.

    ``make(cancel)`` is a blocking generator (a model answering); it runs whole in one thread of its
    own and is closed in that thread, so that what it holds (the model's lock) is released when it
    ends, not when it is garbage-collected. When the client leaves, the server cancels the response
    and ``cancel`` is set: the generator checks it at each token (or denoising step) and stops.
    """
    cancel = threading.Event()

    async def relay():
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        end = object()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the server's loop has closed (Ctrl-C): nobody reads any more
                cancel.set()

        def pump() -> None:
            stream = make(cancel)
            try:
                for item in stream:
                    if cancel.is_set():
                        break
                    put(item)
            except Exception as err:  # noqa: BLE001 - the page gets one error event, never a cut stream
                put(sse("error", {"detail": f"the answer failed ({type(err).__name__}: {err})"}))
            finally:
                stream.close()
                put(end)

        threading.Thread(target=pump, name="zeropipe-answer", daemon=True).start()
        try:
            while (item := await items.get()) is not end:
                yield item
        finally:
            cancel.set()

    return streaming(relay())


async def until_disconnected(request: Request, work: Callable[[threading.Event], Any]) -> Any:
    """``work(cancel)`` in a worker thread; ``cancel`` is set when the client leaves (checked every 0.25 s) or this request is cancelled.

    Raises:
        whatever ``work`` raises (generation.Cancelled once it saw ``cancel``).
    """
    cancel = threading.Event()
    task = asyncio.ensure_future(run_in_threadpool(work, cancel))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                cancel.set()
        return task.result()
    finally:
        cancel.set()


def runs_stream(request: Request, store: RunStore, max_seconds: float) -> StreamingResponse:
    async def generate():
        yield "retry: 2000\n\n"
        still_open = open_while(request, time.monotonic() + max_seconds)
        last, beat = None, time.monotonic()
        while await still_open():
            runs = await run_in_threadpool(store.runs)
            payload = json.dumps(runs, sort_keys=True)
            if payload != last:
                last = payload
                yield sse("runs", {"runs": runs})
                beat = time.monotonic()
            elif time.monotonic() - beat > HEARTBEAT_SECONDS:
                yield ": heartbeat\n\n"
                beat = time.monotonic()
            await pause(request)

    return streaming(generate())


def run_stream(request: Request, store: RunStore, run: dict[str, Any], after_step: float, max_seconds: float) -> StreamingResponse:
    metrics_path = store.metrics_file(run)

    def poll(last_step: float, eval_version: int):
        current = store.run(run["id"])
        series = store.series.get(metrics_path)
        window = series.window(series.keys(), None, last_step)
        # An evaluation is written after its step's row, often after that row was streamed:
        # all evaluations are sent again whenever one is added.
        evals = series.evals() if series.eval_version != eval_version else None
        return current, window, evals, series.eval_version

    async def generate():
        yield "retry: 2000\n\n"
        still_open = open_while(request, time.monotonic() + max_seconds)
        last_step, last_state, beat = after_step, None, time.monotonic()
        eval_version = -1
        while await still_open():
            try:
                current, window, evals, eval_version = await run_in_threadpool(poll, last_step, eval_version)
            except RunNotFound:
                yield sse("end", {"reason": "the run is no longer in the store"})
                return
            sent = False
            if window["points"] > MAX_ROWS_PER_EVENT:
                yield sse("reload", {"points": window["points"]})
                last_step = window["step"][-1]
                sent = True
            elif window["points"]:
                yield sse("metrics", window)
                last_step = window["step"][-1]
                sent = True
            if evals is not None and evals["step"]:
                yield sse("evals", evals)
                sent = True
            state = json.dumps(current, sort_keys=True)
            if state != last_state:
                last_state = state
                yield sse("run", current)
                sent = True
            if current["state"] in ENDED and not window["points"]:
                yield sse("end", {"state": current["state"]})
                return
            if sent:
                beat = time.monotonic()
            elif time.monotonic() - beat > HEARTBEAT_SECONDS:
                yield ": heartbeat\n\n"
                beat = time.monotonic()
            await pause(request)

    return streaming(generate())
