"""One thread owns the engine and steps it while requests arrive; callers in an event loop only
submit, await their outputs and abort.

The thread takes submissions (add, abort) between steps from a queue, so nothing a caller does
waits on a step or makes a step wait, and hands each request's outputs to the event loop that
submitted it. A bound on the requests in the engine turns away the one past it (``Overloaded``)
and changes nothing else. ``close`` aborts what is in flight: every open stream ends, with
finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from .text import TextEngine, TextOutput

__all__ = ["EngineLoop", "Overloaded", "Stream"]


class Overloaded(RuntimeError):
    """The engine holds as many requests as it was told to; try again later."""


@dataclass
class Stream:
    """A request's outputs as they arrive: ``await stream.next()`` until one is finished."""

    id: int
    prompt_tokens: int
    _outputs: asyncio.Queue

    async def next(self) -> TextOutput:
        return await self._outputs.get()

    async def next_all(self) -> list[TextOutput]:
        """The next output and every one already waiting behind it (a reader that fell behind
        the engine catches up in one go); the last may be finished."""
        outs = [await self._outputs.get()]
        while not outs[-1].finished and not self._outputs.empty():
            outs.append(self._outputs.get_nowait())
        return outs


def _put_all(items) -> None:
    for outputs, out in items:
        outputs.put_nowait(out)


class EngineLoop:
    def __init__(self, text: TextEngine, max_requests: int | None = None):
        """max_requests: requests queued or running at once, beyond which ``submit`` raises
        Overloaded (None: unbounded, the engine queues)."""
        self.text, self.max_requests = text, max_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closed = threading.Event()
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="mambastep-engine", daemon=True)
        self._thread.start()

    async def submit(self, prompt, params, stop=()) -> Stream:
        """Add a request; its Stream. Raises what the engine raises for bad input (ValueError,
        TokenizerError), Overloaded, or RuntimeError once closed."""
        if self._closed.is_set():
            raise RuntimeError("the engine loop is closed")
        done: Future = Future()
        self._inbox.put(("add", (prompt, params, stop, asyncio.get_running_loop(), done)))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: int) -> None:
        """Drop a request (a client went away); a no-op for one already finished."""
        self._inbox.put(("abort", request_id))

    def open_requests(self) -> int:
        return len(self._streams)

    @property
    def closed(self) -> bool:
        """Whether the loop has stopped (closed, or its engine failed): nothing more is served."""
        return self._closed.is_set()

    def close(self, timeout: float = 10.0) -> None:
        """Abort every request in flight, end their streams, and stop the thread."""
        self._inbox.put(("close", None))
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                busy = self.text.has_unfinished()
                try:
                    # between steps take whatever has arrived; idle, wait for the next arrival
                    kind, arg = self._inbox.get(block=not busy, timeout=None if not busy else 0)
                    self._handle(kind, arg)
                    continue
                except queue.Empty:
                    pass
                self.steps += 1
                self._deliver(self.text.step())
        finally:
            self._closed.set()
            for rid in list(self._streams):
                self._end(rid)

    def _handle(self, kind: str, arg) -> None:
        if kind == "add":
            prompt, params, stop, loop, done = arg
            if self.max_requests is not None and len(self._streams) >= self.max_requests:
                done.set_exception(Overloaded(f"{len(self._streams)} requests in flight, the bound"))
                return
            try:
                rid = self.text.add(prompt, params, stop)
            except Exception as e:  # bad input: the caller's error, nothing changed here
                done.set_exception(e)
                return
            outputs: asyncio.Queue = asyncio.Queue()
            self._streams[rid] = (loop, outputs)
            done.set_result(Stream(rid, self.text.prompt_tokens(rid), outputs))
        elif kind == "abort":
            if arg in self._streams:
                self._end(arg)
        elif kind == "close":
            self._closed.set()

    def _deliver(self, outs: list[TextOutput]) -> None:
        """Hand a step's outputs over: one wake-up per event loop a step, however many streams."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            loop, outputs = self._streams[out.id]
            by_loop.setdefault(loop, []).append((outputs, out))
            if out.finished:
                del self._streams[out.id]
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _end(self, rid: int) -> None:
        """Close a stream that will get no more outputs (aborted, or the loop closing)."""
        if rid in self.text.engine.requests:
            self.text.abort(rid)
        loop, outputs = self._streams.pop(rid)
        loop.call_soon_threadsafe(outputs.put_nowait, TextOutput(rid, "", [], True, "abort"))
