"""One loop owns the engine and steps it while requests arrive; callers in an event loop only
submit, await their outputs and abort.

The loop takes submissions (add, abort) between steps, so nothing a caller does waits on a step
or makes a step wait, and hands each request's outputs to the event loop that submitted it. A
bound on the requests in the engine turns away the one past it (``Overloaded``) and changes
nothing else. ``close`` aborts what is in flight: every open stream ends, with finish_reason
"abort". Two placements, one interface: ``EngineLoop`` runs the engine in a thread of this
process, ``EngineProcess`` in a process of its own (a pipe carries submissions one way and each
step's outputs the other).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from .text import TextEngine, TextOutput, TextStreams

__all__ = ["EngineLoop", "EngineProcess", "Overloaded", "Stream"]


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


def _admit(text: TextEngine, prompt, params, stop) -> tuple[int, int]:
    """Add a request to the engine: (its id, its prompt's tokens); raises on bad input, having
    changed nothing."""
    rid = text.add(prompt, params, stop)
    return rid, text.prompt_tokens(rid)


def _drop(text: TextEngine, rid: int) -> None:
    """Abort a request the engine still holds (a no-op for one already finished)."""
    if rid in text.engine.requests:
        text.abort(rid)


def _free_slots(text: TextEngine) -> int:
    return len(text.engine.scheduler.free_slots)


def _put_all(items) -> None:
    for outputs, out in items:
        outputs.put_nowait(out)


class _Streams:
    """What both loops keep on the caller's side: each open request's stream, handed its outputs
    with one wake-up per event loop a step, and ended when the request can get no more."""

    def __init__(self, max_requests: int | None):
        self.max_requests = max_requests
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closed = threading.Event()
        self.steps = 0

    def open_requests(self) -> int:
        return len(self._streams)

    @property
    def closed(self) -> bool:
        """Whether the loop has stopped (closed, or its engine failed): nothing more is served."""
        return self._closed.is_set()

    def _overloaded(self, pending: int = 0) -> Overloaded | None:
        if self.max_requests is not None and len(self._streams) + pending >= self.max_requests:
            return Overloaded(f"{len(self._streams) + pending} requests in flight, the bound")
        return None

    def _open(self, rid: int, prompt_tokens: int, loop: asyncio.AbstractEventLoop) -> Stream:
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (loop, outputs)
        return Stream(rid, prompt_tokens, outputs)

    def _deliver(self, outs: list[TextOutput]) -> None:
        """Hand a step's outputs over: one wake-up per event loop a step, however many streams."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            if out.id not in self._streams:  # ended meanwhile (aborted, the loop closing)
                continue
            loop, outputs = self._streams[out.id]
            by_loop.setdefault(loop, []).append((outputs, out))
            if out.finished:
                del self._streams[out.id]
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _end(self, rid: int) -> None:
        """Close a stream that will get no more outputs (aborted, or the loop closing)."""
        if rid in self._streams:
            loop, outputs = self._streams.pop(rid)
            loop.call_soon_threadsafe(outputs.put_nowait, TextOutput(rid, "", [], True, "abort"))


class EngineLoop(_Streams):
    """The engine in a thread of this process (embedding, tests). The thread lets go of the GIL
    while it waits for the GPU, but a busy event loop can hold it up; see EngineProcess."""

    kind = "thread"

    def __init__(self, text: TextEngine, max_requests: int | None = None):
        """max_requests: requests queued or running at once, beyond which ``submit`` raises
        Overloaded (None: unbounded, the engine queues)."""
        super().__init__(max_requests)
        self.text = text
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
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

    def free_slots(self) -> int:
        return _free_slots(self.text)

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
                self._abort(rid)

    def _handle(self, kind: str, arg) -> None:
        if kind == "add":
            prompt, params, stop, loop, done = arg
            if (refused := self._overloaded()) is not None:
                done.set_exception(refused)
                return
            try:
                rid, prompt_tokens = _admit(self.text, prompt, params, stop)
            except Exception as e:  # bad input: the caller's error, nothing changed here
                done.set_exception(e)
                return
            done.set_result(self._open(rid, prompt_tokens, loop))
        elif kind == "abort":
            self._abort(arg)
        elif kind == "close":
            self._closed.set()

    def _abort(self, rid: int) -> None:
        if rid in self._streams:
            _drop(self.text, rid)
            self._end(rid)


def _child(build, conn) -> None:
    """The engine process: build the TextEngine and hand its tokenizer over, then serve the
    parent's messages between steps and send each step's tokens (with the free slots after it)
    as tuples, which pickle in a seventh of a dataclass's time. Text is the parent's work."""
    try:
        text = build()
    except Exception as e:  # a bad checkpoint: the parent reports it
        conn.send(("failed", str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))
        return
    engine = text.engine
    conn.send(("ready", _free_slots(text), text.tokenizer))
    while True:
        if not conn.poll(0 if engine.has_unfinished() else None):
            outs = [(o.id, o.new_tokens, o.finished, o.finish_reason) for o in engine.step()]
            conn.send(("step", outs, _free_slots(text)))
            continue
        kind, *arg = conn.recv()
        if kind == "add":
            token, ids, params = arg
            try:
                reply = ("added", token, engine.add_request(ids, params))
            except Exception as e:  # bad input: the caller's error, nothing changed here
                reply = ("refused", token, e)
            conn.send(reply)
        elif kind == "abort":
            _drop(text, arg[0])
            conn.send(("ended", arg[0], _free_slots(text)))
        elif kind == "close":
            return


class EngineProcess(_Streams):
    """The engine in a process of its own, stepping on token ids only: this process encodes
    prompts, turns each step's tokens into text (``TextStreams``, with the child's tokenizer)
    and streams, so the engine never waits for this side's GIL nor does its text work.
    ``build``: a picklable callable that returns the TextEngine (it runs in the child; e.g.
    ``functools.partial(TextEngine.load, ...)``)."""

    kind = "process"

    def __init__(self, build, max_requests: int | None = None, start_timeout: float = 600.0):
        super().__init__(max_requests)
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA starts in the child
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_child, args=(build, child), name="mambastep-engine", daemon=True)
        self._process.start()
        child.close()
        if not self._conn.poll(start_timeout):
            self._process.kill()
            raise RuntimeError(f"the engine process did not start within {start_timeout:.0f} s")
        try:
            kind, *arg = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited ({self._process.exitcode}) before it was ready") from None
        if kind == "failed":
            self._process.join()
            raise ValueError(arg[0])
        self._free, tokenizer = arg
        self._texts = TextStreams(tokenizer)  # touched by the reader thread only
        self._send_lock = threading.Lock()
        # submissions the child has not answered: (future, its event loop, prompt ids, stop strings)
        self._pending: dict[int, tuple[Future, asyncio.AbstractEventLoop, list[int], tuple]] = {}
        self._tokens = itertools.count()
        self._reader = threading.Thread(target=self._read, name="mambastep-engine-reader", daemon=True)
        self._reader.start()

    def _send(self, *msg) -> None:
        with self._send_lock:
            self._conn.send(msg)

    async def submit(self, prompt, params, stop=()) -> Stream:
        """As EngineLoop.submit."""
        if self._closed.is_set():
            raise RuntimeError("the engine loop is closed")
        if (refused := self._overloaded(len(self._pending))) is not None:
            raise refused
        ids, params, stop = self._texts.encode(prompt, params, stop)  # raises on bad input
        done: Future = Future()
        token = next(self._tokens)
        self._pending[token] = (done, asyncio.get_running_loop(), ids, stop)
        try:
            self._send("add", token, ids, params)
        except OSError:
            self._pending.pop(token, None)
            raise RuntimeError("the engine loop is closed") from None
        return await asyncio.wrap_future(done)

    def abort(self, request_id: int) -> None:
        if request_id in self._streams and not self._closed.is_set():
            try:
                self._send("abort", request_id)
            except OSError:
                pass

    def free_slots(self) -> int:
        return self._free

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine process; every open stream ends with finish_reason "abort"."""
        try:
            self._send("close")
        except OSError:
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
        self._reader.join(timeout)

    def _text(self, outs) -> list[TextOutput]:
        """A step's tokens as text; a request a stop string ended is aborted in the child."""
        texts = []
        for rid, tokens, finished, reason in outs:
            if rid in self._texts:  # else aborted meanwhile
                text, stopped = self._texts.text(rid, tokens, finished, reason)
                if stopped:
                    self.abort(rid)
                texts.append(text)
        return texts

    def _read(self) -> None:
        try:
            while True:
                kind, *arg = self._conn.recv()
                if kind == "step":
                    self.steps += 1
                    outs, self._free = arg
                    self._deliver(self._text(outs))
                elif kind == "added":
                    token, rid = arg
                    done, loop, ids, stop = self._pending.pop(token)
                    self._texts.open(rid, ids, stop)
                    done.set_result(self._open(rid, len(ids), loop))
                elif kind == "refused":
                    token, error = arg
                    self._pending.pop(token)[0].set_exception(error)
                elif kind == "ended":
                    rid, self._free = arg
                    self._texts.drop(rid)
                    self._end(rid)
        except (EOFError, OSError):
            pass
        finally:
            self._closed.set()
            for rid in list(self._streams):
                self._end(rid)
            for done, *_ in self._pending.values():
                done.set_exception(RuntimeError("the engine loop is closed"))
            self._pending.clear()
