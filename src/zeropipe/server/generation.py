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
from pathlib import Path
from typing import Any, Iterator

from zeropipe.errors import ZeroPipeError

MAX_NEW_TOKENS = 1024


class ModelBusy(ZeroPipeError):
    """Another request holds the loaded model."""

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


class Generator:
    def __init__(self):
        self.lock = threading.Lock()  # one generation at a time: they share the loaded model
        self.key: tuple | None = None
        self.loaded = None
        self.device_reason = ""
        self.last_used = time.monotonic()
        self.unloader: threading.Thread | None = None

    def model(self, path: Path, checkpoint: str | None, purpose: str = "answer"):
        """The model of ``path`` (and checkpoint), loaded once: to answer (Generate, Chat) or to draw (Draw)."""
        from zeropipe.families import load_drawing, load_model

        key = (str(path), checkpoint, purpose)
        if self.key != key:
            self.unload()  # let the previous model go before loading the next: one model at a time
            device, self.device_reason = model_device()
            loader = load_drawing if purpose == "draw" else load_model
            self.loaded = loader(path, checkpoint=checkpoint, device=device)
            self.key = key
            self.watch_idle()
        self.last_used = time.monotonic()
        return self.loaded

    def draw(self, path: Path, checkpoint: str | None, out_dir: Path, settings: dict[str, Any]) -> dict[str, Any]:
        """Draw one picture (or clip) into ``out_dir``; the answer names the files and what drew them.

        Raises:
            ZeroPipeError: the model cannot be loaded or cannot draw; ActionRefused-like busy state as ZeroPipeError.
        """
        from zeropipe.families import draw

        if not self.lock.acquire(timeout=1):
            raise ModelBusy("the model is answering or drawing for another request: wait for it, then send again")
        started = time.monotonic()
        try:
            loaded = self.model(path, checkpoint, purpose="draw")
            files = draw(loaded, out_dir, **settings)
            return {"source": loaded.source.describe(), "device": str(loaded.device), "device_reason": self.device_reason,
                    "files": files, "seconds": round(time.monotonic() - started, 2)}  # fmt: skip
        finally:
            self.last_used = time.monotonic()
            self.lock.release()

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
        loaded = self.loaded
        device, reason = (str(loaded.device), self.device_reason) if loaded is not None else model_device()
        return {
            "loaded": None if loaded is None else loaded.source.describe(),
            "device": device,
            "device_reason": reason,
            "idle_seconds": idle_seconds(),
            "unloads_in": None if loaded is None else max(0.0, round(idle_seconds() - (time.monotonic() - self.last_used), 1)),
        }

    def stream(self, path: Path, checkpoint: str | None, prompt: str | list[dict[str, str]], settings: dict[str, Any], image: Path | None = None) -> Iterator[str]:
        """Server-sent events: ``source`` (what answers), ``token`` (text as it comes), then ``done`` or ``error``.

        Args:
            prompt: one user turn's text, or a whole conversation (the Chat page).
            image: vision-language models: the picture the prompt asks about (already confined by the caller).
        """
        from zeropipe.families import family_named, generate

        started = time.monotonic()
        if not self.lock.acquire(timeout=1):
            yield sse("error", {"detail": "another answer is being generated: wait for it, then send again"})
            return
        try:
            try:
                loaded = self.model(path, checkpoint)
            except ZeroPipeError as err:
                yield sse("error", {"detail": str(err)})
                return
            yield sse("source", {"source": loaded.source.describe(), "device": str(loaded.device), "device_reason": self.device_reason,
                                 "idle_seconds": idle_seconds(), "family": loaded.source.family})  # fmt: skip
            family = family_named(loaded.source.family)
            if not family.answers_prompts:
                yield sse(
                    "error",
                    {
                        "detail": f"{loaded.source.describe()} is a diffusion model: its pictures are in the run's sample gallery (generate.sample_every)"
                    },
                )
                return
            if image is not None and not family.takes_images:
                yield sse("error", {"detail": f"an image needs a vision-language model; {loaded.source.describe()} reads text only: clear the image"})
                return
            if not family.streams_answers:
                # A backend that takes no streamer (vision-language) answers whole: one piece, then done.
                try:
                    result = generate(loaded, [prompt], images=[str(image)] if image is not None else None, **settings)[0]
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
                    outcome["results"] = generate(loaded, [prompt], streamer=streamer, **settings)
                except Exception as err:  # noqa: BLE001 - reported to the page; the streamer must end either way
                    outcome["error"] = err
                    streamer.end()

            thread = threading.Thread(target=work, name="zeropipe-generate", daemon=True)
            thread.start()
            for text in streamer:
                if text:
                    yield sse("token", {"text": text})
            thread.join()
            if "error" in outcome:
                err = outcome["error"]
                yield sse("error", {"detail": str(err) if isinstance(err, ZeroPipeError) else f"generation failed ({type(err).__name__}: {err})"})
                return
            result = outcome["results"][0]
            yield sse("done", {"output": result.output, "seconds": round(time.monotonic() - started, 2), "prompt_tokens": result.prompt_tokens})
        finally:
            self.last_used = time.monotonic()
            self.lock.release()


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
