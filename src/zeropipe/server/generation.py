"""The Generate and Chat pages' backend: answers from a run's checkpoint or export, streamed as they are made.

It is ``zeropipe generate`` in the server process (``zeropipe.export.generate``: the same
sources, prompt rendering and sampling); a Chat turn sends the whole conversation, rendered
with the training template. Only runs of the store and their finished exports can be
loaded: a request names a run id, not a path.

One policy for a model in the UI process: it is loaded on the CPU, or on a CUDA GPU that no
process (no training rank) uses; one model is kept, for the next prompt, and let go when
another is asked for or when it has been idle ``ZEROPIPE_UI_MODEL_IDLE_SECONDS`` (default
300), so a model left loaded does not hold host or GPU memory a run needs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from zeropipe.errors import ZeroPipeError

MAX_NEW_TOKENS = 1024
MAX_CHAT_IMAGE_PIXELS = 4096 * 4096  # a chat image's width x height, read from its header before anything decodes it


def chat_image(path: Path) -> Path:
    """A chat image (already confined) whose header says it is at most MAX_CHAT_IMAGE_PIXELS; nothing is decoded here.

    Raises:
        ZeroPipeError: not an image Pillow reads, or more pixels than the cap (a 12000x12000 PNG of 560 KB cost 4 GB in one turn).
    """
    from PIL import Image

    try:
        with Image.open(path) as image:
            width, height = image.size
    except Image.DecompressionBombError:
        width = height = None
    except Exception as err:  # noqa: BLE001 - Pillow raises many kinds on a file that is not an image
        raise ZeroPipeError(f"{path.name} is not an image Pillow reads ({type(err).__name__}): give a PNG, JPEG or WebP") from None
    if width is None or width * height > MAX_CHAT_IMAGE_PIXELS:
        size = f"{width}x{height} pixels" if width is not None else "more pixels than Pillow opens"
        raise ZeroPipeError(f"{path.name} is {size}, more than the {MAX_CHAT_IMAGE_PIXELS:,} a chat image may hold: it was not decoded; resize it")
    return path


class ModelBusy(ZeroPipeError):
    """Another request holds the loaded model."""


class Cancelled(ZeroPipeError):
    """The request that asked for an answer or a drawing went away (its client left, or it pressed Cancel)."""


class CancelCheck:
    """A streamer-shaped cancellation token for ``model.generate``: each new token asks it, and a cancelled request stops there.

    transformers calls ``put`` with the prompt, then with every token it makes; raising there ends the
    generation at once (a model answering 1,024 tokens on a CPU would otherwise run on for minutes).
    """

    def __init__(self, cancel: threading.Event, inner=None):
        self.cancel, self.inner = cancel, inner

    def put(self, value) -> None:
        if self.cancel.is_set():
            raise Cancelled("the request was cancelled (its client left): the answer stopped")
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()

IDLE_SECONDS = 300.0


def idle_seconds() -> float:
    try:
        return max(1.0, float(os.environ.get("ZEROPIPE_UI_MODEL_IDLE_SECONDS", IDLE_SECONDS)))
    except ValueError:
        return IDLE_SECONDS


def model_device() -> tuple[str, str]:
    """Where the UI loads a model, and why: a CUDA GPU no process uses, else the CPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "cpu", "no CUDA GPU"
        import pynvml  # the NVIDIA driver's own list of the processes on each GPU

        pynvml.nvmlInit()
        try:
            busy = set()
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                if pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    uuid = pynvml.nvmlDeviceGetUUID(handle)
                    busy.add(uuid.decode() if isinstance(uuid, bytes) else uuid)
        finally:
            pynvml.nvmlShutdown()
        for index in range(torch.cuda.device_count()):
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            if not any(name.endswith(uuid) for name in busy):
                return f"cuda:{index}", "a GPU no training rank (no process) uses"
        return "cpu", "every GPU is in use by a run"
    except Exception as err:  # noqa: BLE001 - not knowing which GPU is free means the CPU, never a rank's GPU
        return "cpu", f"cannot tell which GPUs are free ({type(err).__name__})"


MAX_SCANNED_FILES = 100_000  # files of a checkpoint or export folder looked at for links before loading


def links_out(folders: list[Path], readable: list[Path]) -> list[tuple[Path, Path]]:
    """Files and folders under ``folders`` (not descending into links) that are symlinks resolving outside ``readable``."""
    from zeropipe.rundir import is_inside

    out, seen = [], 0
    for folder in folders:
        if not folder.is_dir():
            continue
        for root, dirs, files in os.walk(folder, followlinks=False):
            for name in dirs + files:
                seen += 1
                path = Path(root) / name
                if path.is_symlink():
                    target = path.resolve()
                    if not any(is_inside(target, top) for top in readable):
                        out.append((path, target))
            if seen > MAX_SCANNED_FILES:
                raise ZeroPipeError(f"{folder} holds more than {MAX_SCANNED_FILES:,} files: not loaded by the UI; load it with the command line")
    return out


def refuse_links_out(path: Path, checkpoint: str | None, readable: list[Path] | None) -> None:
    """A checkpoint's or export's files are read only when none is a link out of the UI's folders (the folder itself was checked by the store).

    Raises:
        ZeroPipeError: naming the first such file (not where it leads).
    """
    if readable is None:
        return
    folders = [path / "checkpoints" / checkpoint, path / "tokenizer", path / "processor"] if checkpoint else [path]
    found = links_out(folders, readable)
    if found:
        names = ", ".join(str(link.relative_to(path)) for link, _ in found[:3])
        raise ZeroPipeError(f"{names} in {path.name} {'is a link' if len(found) == 1 else 'are links'} out of the folders this UI may read: "
                            "not loaded; replace the link by the file itself")  # fmt: skip


class Generator:
    def __init__(self, readable: list[Path] | None = None):
        self.readable = readable  # the UI's folders: a checkpoint's or export's file that links out of them is not loaded
        self.lock = threading.Lock()  # one generation at a time: they share the loaded model
        self.key: tuple | None = None
        self.loaded = None
        self.device_reason = ""
        self.last_used = time.monotonic()
        self.unloader: threading.Thread | None = None
        self.holder: dict[str, Any] | None = None  # what holds the lock: kind, label, since, and a drawing's progress

    @contextmanager
    def hold(self, kind: str, label: str):
        """The model for one request, released when the request ends (its answer done, failed or cancelled), never by garbage collection.

        Raises:
            ModelBusy: another request holds it (the message says which: answering or drawing, for which run, since when).
        """
        if not self.lock.acquire(timeout=1):
            raise ModelBusy(self.busy_message())
        self.holder = {"kind": kind, "label": label, "since": time.time(), "step": None, "steps": None}
        try:
            yield self.holder
        finally:
            self.holder = None
            self.last_used = time.monotonic()
            self.lock.release()

    def busy_message(self) -> str:
        holder = self.holder
        if holder is None:  # released between the try and this line
            return "the model was busy for another request: send again"
        doing = "drawing" if holder["kind"] == "draw" else "answering"
        since = time.strftime("%H:%M:%S", time.localtime(holder["since"]))
        progress = f", step {holder['step']} of {holder['steps']}" if holder.get("step") is not None else ""
        return (f"the model is {doing} for {holder['label']} since {since} ({time.time() - holder['since']:.0f} s{progress}): "
                "wait for it or cancel it (closing its page cancels it), then send again")  # fmt: skip

    def model(self, path: Path, checkpoint: str | None, purpose: str = "answer"):
        """The model of ``path`` (and checkpoint), loaded once: to answer (Generate, Chat) or to draw (Draw)."""
        from zeropipe.families import load_drawing, load_model

        key = (str(path), checkpoint, purpose)
        if self.key != key:
            self.unload()  # let the previous model go before loading the next: one model at a time
            refuse_links_out(Path(path), checkpoint, self.readable)
            device, self.device_reason = model_device()
            loader = load_drawing if purpose == "draw" else load_model
            self.loaded = loader(path, checkpoint=checkpoint, device=device)
            self.key = key
            self.watch_idle()
        self.last_used = time.monotonic()
        return self.loaded

    def draw(self, path: Path, checkpoint: str | None, out_dir: Path, settings: dict[str, Any], cancel: threading.Event | None = None,
             label: str = "", bound=None) -> dict[str, Any]:  # fmt: skip
        """Draw one picture (or clip) into ``out_dir``; the answer names the files and what drew them.

        Each denoising step reports its progress (``state()["busy"]``) and asks ``cancel``: a set
        event stops the drawing at the next step. ``bound(device)`` may refuse the work for the device
        the model is on (a CPU draws far less than a GPU in the same time).

        Raises:
            ModelBusy: another request holds the model. Cancelled: ``cancel`` was set.
            ZeroPipeError: the model cannot be loaded or cannot draw, or ``bound`` refused the work.
        """
        from zeropipe.families import draw

        cancel = cancel or threading.Event()
        with self.hold("draw", label or path.name) as holder:
            started = time.monotonic()
            try:
                loaded = self.model(path, checkpoint, purpose="draw")
            except ZeroPipeError:
                raise
            except Exception as err:  # noqa: BLE001 - a damaged checkpoint or export: a 400 that says so, not a 500
                raise ZeroPipeError(unloadable(path, checkpoint, err)) from None
            if bound is not None:
                bound(loaded.device)
            holder["steps"], holder["step"] = settings.get("steps"), 0

            def on_step(step: int, steps: int) -> None:
                holder["step"], holder["steps"] = step, steps
                if cancel.is_set():
                    raise Cancelled(f"the drawing was cancelled at step {step} of {steps}")

            if cancel.is_set():
                raise Cancelled("the drawing was cancelled before its first step")
            files = draw(loaded, out_dir, **settings, on_step=on_step)
            return {"source": loaded.source.describe(), "device": str(loaded.device), "device_reason": self.device_reason,
                    "files": files, "seconds": round(time.monotonic() - started, 2)}  # fmt: skip

    def unload(self) -> None:
        """Let the loaded model go (the caller holds the lock, or nothing else uses the model)."""
        if self.loaded is None:
            return
        on_gpu = self.loaded.device.type == "cuda"
        self.loaded, self.key = None, None
        import gc

        gc.collect()
        if on_gpu:
            import torch

            torch.cuda.empty_cache()

    def watch_idle(self) -> None:
        if self.unloader is not None and self.unloader.is_alive():
            return

        def loop():
            while True:
                limit = idle_seconds()
                time.sleep(min(30.0, limit / 4))
                if self.loaded is None:
                    return
                if time.monotonic() - self.last_used > limit and self.lock.acquire(blocking=False):
                    try:
                        if self.loaded is not None and time.monotonic() - self.last_used > limit:
                            self.unload()
                            return
                    finally:
                        self.lock.release()

        self.unloader = threading.Thread(target=loop, name="zeropipe-model-idle", daemon=True)
        self.unloader.start()

    def state(self) -> dict[str, Any]:
        """What is loaded, where, and when it will be let go (the pages show it)."""
        loaded, holder = self.loaded, self.holder
        device, reason = (str(loaded.device), self.device_reason) if loaded is not None else model_device()
        return {
            "loaded": None if loaded is None else loaded.source.describe(),
            "device": device,
            "device_reason": reason,
            "idle_seconds": idle_seconds(),
            "unloads_in": None if loaded is None else max(0.0, round(idle_seconds() - (time.monotonic() - self.last_used), 1)),
            "busy": None if holder is None else {**holder, "seconds": round(time.time() - holder["since"], 1)},
        }

    def stream(self, path: Path, checkpoint: str | None, prompt: str | list[dict[str, str]], settings: dict[str, Any], image: Path | None = None,
               cancel: threading.Event | None = None, label: str = "") -> Iterator[str]:  # fmt: skip
        """Server-sent events: ``source`` (what answers), ``token`` (text as it comes), then ``done`` or ``error``.

        Args:
            prompt: one user turn's text, or a whole conversation (the Chat page).
            image: vision-language models: the picture the prompt asks about (already confined by the caller).
            cancel: set when the client leaves (``events.cancellable``): the model stops at its next token and
                the model is released when this generator is closed.
        """
        cancel = cancel or threading.Event()
        started = time.monotonic()
        try:
            with self.hold("answer", label or path.name):
                yield from self._answer(path, checkpoint, prompt, settings, image, cancel, started)
        except ModelBusy as err:
            yield sse("error", {"detail": str(err)})

    def _answer(self, path, checkpoint, prompt, settings, image, cancel: threading.Event, started: float) -> Iterator[str]:
        from zeropipe.families import family_named, generate

        try:
            loaded = self.model(path, checkpoint)
        except ZeroPipeError as err:
            yield sse("error", {"detail": str(err)})
            return
        except Exception as err:  # noqa: BLE001 - a damaged checkpoint or export: one error event, never a cut stream
            yield sse("error", {"detail": unloadable(path, checkpoint, err)})
            return
        yield sse("source", {"source": loaded.source.describe(), "device": str(loaded.device), "device_reason": self.device_reason,
                             "idle_seconds": idle_seconds(), "family": loaded.source.family})  # fmt: skip
        family = family_named(loaded.source.family)
        if not family.answers_prompts:
            yield sse("error", {"detail": f"{loaded.source.describe()} is a diffusion model: its pictures are in the run's sample gallery (generate.sample_every), and the Draw page draws with it"})
            return
        if image is not None and not family.takes_images:
            yield sse("error", {"detail": f"an image needs a vision-language model; {loaded.source.describe()} reads text only: clear the image"})
            return
        if not family.streams_answers:
            # A backend that sends no text as it goes (vision-language) answers whole: one piece, then done; it still stops at a cancel.
            try:
                result = generate(loaded, [prompt], images=[str(image)] if image is not None else None, streamer=CancelCheck(cancel), **settings)[0]
            except ZeroPipeError as err:
                yield sse("error", {"detail": str(err)})
                return
            yield sse("token", {"text": result.output})
            yield sse("done", {"output": result.output, "seconds": round(time.monotonic() - started, 2), "prompt_tokens": result.prompt_tokens})
            return
        streamer = TokenStreamer(loaded.tokenizer)
        outcome: dict[str, Any] = {}

        def work():
            try:
                outcome["results"] = generate(loaded, [prompt], streamer=CancelCheck(cancel, streamer), **settings)
            except Exception as err:  # noqa: BLE001 - reported to the page; the streamer must end either way
                outcome["error"] = err
                streamer.end()

        thread = threading.Thread(target=work, name="zeropipe-generate", daemon=True)
        thread.start()
        try:
            for text in streamer:
                if text:
                    yield sse("token", {"text": text})
        except GeneratorExit:
            cancel.set()  # closed early (the client left): the next token's check stops the model
            raise
        finally:
            thread.join()  # the model is free only once the thread that uses it has ended
        if "error" in outcome:
            err = outcome["error"]
            yield sse("error", {"detail": str(err) if isinstance(err, ZeroPipeError) else f"generation failed ({type(err).__name__}: {err})"})
            return
        result = outcome["results"][0]
        yield sse("done", {"output": result.output, "seconds": round(time.monotonic() - started, 2), "prompt_tokens": result.prompt_tokens})


def unloadable(path: Path, checkpoint: str | None, err: Exception) -> str:
    what = f"checkpoint {checkpoint} of {path.name}" if checkpoint else f"export {path.name}"
    return f"the {what} cannot be loaded ({type(err).__name__}: {str(err)[:500]}): it is damaged or incomplete; pick another checkpoint or export"


class TokenStreamer:
    """The answer's text as each token is made, for ``model.generate(streamer=...)``; iterate it in another thread.

    transformers' TextIteratorStreamer holds text back until a space: answers in digits or
    without spaces would then arrive all at the end. Here each token's text is sent as soon as
    it decodes to whole characters (a multi-byte character split over tokens waits for its end).
    """

    def __init__(self, tokenizer):
        import queue

        self.tokenizer = tokenizer
        self.queue: queue.Queue = queue.Queue()
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded answer already sent
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt
            self.prompt_seen = True
            return
        self.ids += [int(token) for token in value.reshape(-1).tolist()]
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # the rest of a character is in the next token
        if len(text) > self.sent:
            self.queue.put(text[self.sent :])
            self.sent = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if len(text) > self.sent:
            self.queue.put(text[self.sent :])
            self.sent = len(text)
        self.queue.put(None)

    def __iter__(self):
        while (text := self.queue.get()) is not None:
            yield text


def sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
