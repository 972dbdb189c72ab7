"""The Generate page's backend: answers from a run's checkpoint or export, streamed as they are made.

It is ``zeropipe generate`` in the server process (``zeropipe.export.generate``: the same
sources, prompt rendering and sampling); the model stays loaded for the next prompt, one at
a time, and is let go when another is asked for. Only runs of the store and their finished
exports can be loaded: a request names a run id, not a path.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from zeropipe.errors import ZeroPipeError

MAX_NEW_TOKENS = 1024


class Generator:
    def __init__(self):
        self.lock = threading.Lock()  # one generation at a time: they share the loaded model
        self.key: tuple | None = None
        self.loaded = None

    def model(self, path: Path, checkpoint: str | None):
        from zeropipe.families import load_model

        key = (str(path), checkpoint)
        if self.key != key:
            self.loaded, self.key = None, None  # let the previous model go before loading the next
            self.loaded = load_model(path, checkpoint=checkpoint)
            self.key = key
        return self.loaded

    def stream(self, path: Path, checkpoint: str | None, prompt: str, settings: dict[str, Any], image: Path | None = None) -> Iterator[str]:
        """Server-sent events: ``source`` (what answers), ``token`` (text as it comes), then ``done`` or ``error``.

        Args:
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
            yield sse("source", {"source": loaded.source.describe(), "device": loaded.device.type, "family": loaded.source.family})
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
                yield sse("done", {"output": result.output, "seconds": round(time.monotonic() - started, 2)})
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
            yield sse("done", {"output": result.output, "seconds": round(time.monotonic() - started, 2)})
        finally:
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
