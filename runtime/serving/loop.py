"""One loop owns the engine and steps it while requests arrive; callers in an event loop only
submit, await their outputs and abort.

The loop takes submissions (add, abort) between steps, so nothing a caller does waits on a step
or makes a step wait, and hands each request's outputs to the event loop that submitted it. A
bound on the requests in the engine turns away the one past it (``Overloaded``) and changes
nothing else. Two placements, one interface: ``EngineLoop`` runs the engine in a thread of this
process, ``EngineProcess`` in a process of its own (a pipe carries submissions one way and each
step's outputs the other), to which further API processes may attach, each an ``EngineClient``
on a pipe of its own.

Faults (docs/ARCHITECTURE.md, "Serving"): neither side ever blocks on the other (each sends
through an ``_Outbox``, a bounded queue and a thread; a peer that stops reading is given up);
an API process that leaves has its requests aborted and their slots freed; a watchdog ends
every open request when the engine stops making progress or its process dies. A stream that
can get no more ends with finish_reason "abort" (the caller aborted it) or "error" (the engine
failed, or the loop closed under it: ``failure`` says why).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import multiprocessing.connection
import queue
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from .text import TextEngine, TextOutput, TextStreams, text_chars

__all__ = ["EngineClient", "EngineLoop", "EngineProcess", "Overloaded", "Stream"]


class Overloaded(RuntimeError):
    """The engine holds as many requests as it was told to; try again later."""


class _Outbox:
    """Messages to one connection, sent in order by a thread of their own, so that the sender
    never blocks on a peer that stopped reading: past ``bound`` unsent messages, or once a send
    fails, the peer is ``dead`` and ``put`` refuses."""

    def __init__(self, conn, bound: int = 4096, name: str = "mambastep-outbox"):
        self.conn, self.dead = conn, threading.Event()
        self._queue: queue.Queue = queue.Queue(bound)
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def put(self, msg) -> bool:
        """Queue ``msg``; False (and nothing queued) once the peer is dead."""
        if self.dead.is_set():
            return False
        try:
            self._queue.put_nowait(msg)
        except queue.Full:  # the peer has read nothing for ``bound`` messages: wedged
            self.dead.set()
            return False
        return True

    def stop(self) -> None:
        """Send what is queued, then end the thread (it ends at once where the peer is dead)."""
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            self.dead.set()

    def _run(self) -> None:
        while (msg := self._queue.get()) is not None and not self.dead.is_set():
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # the peer is gone (or the connection closed here)
                self.dead.set()


def _past_bound(in_flight: int, bound: int | None) -> Overloaded | None:
    """The refusal of one more request where ``in_flight`` already reach ``bound`` (None: none)."""
    if bound is not None and in_flight >= bound:
        return Overloaded(f"{in_flight} requests in flight, the bound")
    return None


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


def _add(engine, ids: list[int], params, n: int) -> list[int]:
    """Add a request of ``n`` choices to the engine (one choice: a plain request, which any
    engine the loops run takes): their ids; raises on bad input, having changed nothing."""
    return engine.add_choices(ids, params, n) if n > 1 else [engine.add_request(ids, params)]


def _admit(text: TextEngine, ids: list[int], params, stop, n: int = 1) -> list[int]:
    """Add an encoded request (``TextStreams.encode``) of ``n`` choices to the engine and open
    their streams: their ids; raises on bad input, having changed nothing."""
    rids = _add(text.engine, ids, params, n)
    for rid in rids:
        text.streams.open(rid, ids, stop)
    return rids


def _drop(text: TextEngine, rid: int) -> None:
    """Abort a request the engine still holds (a no-op for one already finished)."""
    if rid in text.engine.requests:
        text.abort(rid)


def _counts(text: TextEngine) -> tuple[int, int, int, dict | None]:
    """The engine's (free slots, running requests, waiting requests, its prefix cache's counts
    or None)."""
    scheduler, cache = text.engine.scheduler, text.engine.prefix_cache
    return (len(scheduler.free_slots), len(scheduler.running), len(scheduler.waiting),
            None if cache is None else dict(cache.stats))


def _put_all(items) -> None:
    for outputs, out in items:
        outputs.put_nowait(out)


class _Streams:
    """What both loops keep on the caller's side: each open request's stream, handed its outputs
    with one wake-up per event loop a step, and ended when the request can get no more."""

    api_processes = 1  # the API processes in front of the engine (each with a loop of its own)

    def __init__(self, max_requests: int | None, watchdog: float | None = None):
        """watchdog: seconds without a sign of progress from the engine, while it holds requests,
        after which it is taken for wedged and every open request ends with an error (None: off)."""
        self.max_requests = max_requests
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closed = threading.Event()
        self._lock = threading.Lock()  # the streams, between the loop's thread and the watchdog's
        self.steps = 0
        self.failure: str | None = None  # why the loop stopped serving, where it did not choose to
        self._closing = False  # closed on purpose: what ends then is no failure
        self._progress = time.monotonic()
        self._watchdog = watchdog

    def _start_watchdog(self) -> None:
        """Once the loop is set up (the subclass's constructor ends with it)."""
        if self._watchdog is not None:
            threading.Thread(target=self._watch, args=(self._watchdog,), name="mambastep-watchdog",
                             daemon=True).start()

    def open_requests(self) -> int:
        return len(self._streams)

    def free_slots(self) -> int:
        return self.counts()[0]

    @property
    def closed(self) -> bool:
        """Whether the loop has stopped (closed, or its engine failed): nothing more is served."""
        return self._closed.is_set()

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Block until the loop has stopped (or ``timeout`` s); whether it has."""
        return self._closed.wait(timeout)

    def _overloaded(self, pending: int = 0) -> Overloaded | None:
        return _past_bound(len(self._streams) + pending, self.max_requests)

    def _outstanding(self) -> int:
        """Requests the engine owes an answer: open streams (and, in a client, submissions)."""
        return len(self._streams)

    def _alive(self) -> str | None:
        """Why the engine cannot be running (None: it may be)."""
        return None

    def _exit_cause(self) -> str | None:
        """Why the engine's connection closed, where it can be told (its process's exit)."""
        return self._alive()

    def _watch(self, timeout: float) -> None:
        while not self._closed.wait(min(0.5, timeout / 4)):
            if (dead := self._alive()) is not None:
                self._fail(dead)
            elif not self._outstanding():
                self._progress = time.monotonic()  # idle: nothing is owed
            elif time.monotonic() - self._progress > timeout:
                self._fail(f"the engine made no progress for {timeout:g} s (wedged)")

    def end_all(self) -> None:
        """End every open request with an error, aborted in the engine (a shutdown's last step:
        the loop goes on for other API processes)."""
        for rid in list(self._streams):
            self.abort(rid)
            self._end(rid, "error")

    def _fail(self, cause: str) -> None:
        """The engine failed: every open request ends with an error, and nothing more is served."""
        if self.failure is None and not self._closed.is_set() and not self._closing:
            self.failure = cause
        self._closed.set()
        for rid in list(self._streams):
            self._end(rid, "error")

    def _open(self, rid: int, prompt_tokens: int, loop: asyncio.AbstractEventLoop) -> Stream:
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (loop, outputs)
        return Stream(rid, prompt_tokens, outputs)

    def _deliver(self, outs: list[TextOutput]) -> None:
        """Hand a step's outputs over: one wake-up per event loop a step, however many streams."""
        self._progress = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outs:
                if out.id not in self._streams:  # ended meanwhile (aborted, the loop closing)
                    continue
                loop, outputs = self._streams[out.id]
                by_loop.setdefault(loop, []).append((outputs, out))
                if out.finished:
                    del self._streams[out.id]
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _end(self, rid: int, reason: str = "abort") -> None:
        """Close a stream that will get no more outputs: "abort" (the caller aborted it) or
        "error" (the engine failed, or the loop closed under it)."""
        with self._lock:
            entry = self._streams.pop(rid, None)
        if entry is not None:
            loop, outputs = entry
            _call_soon(loop, outputs.put_nowait, TextOutput(rid, "", [], True, reason))


# prompts with more characters than this are tokenized in a worker thread; shorter ones (and
# token ids) here, where a thread hop would cost more than the tokenizing (2 ms of TTFT at 64)
_INLINE_CHARS = 4096


async def _encode(texts: TextStreams, prompt, params, stop, max_context: int, cap: bool):
    """``texts.encode`` of a request, off the event loop where the prompt is long."""
    if text_chars(prompt) <= _INLINE_CHARS:
        return texts.encode(prompt, params, stop, max_context, cap)
    return await asyncio.get_running_loop().run_in_executor(None, texts.encode, prompt, params, stop, max_context, cap)


def _call_soon(loop: asyncio.AbstractEventLoop, *call) -> None:
    try:
        loop.call_soon_threadsafe(*call)
    except RuntimeError:  # that event loop has closed: nobody is waiting there
        pass


class EngineLoop(_Streams):
    """The engine in a thread of this process (embedding, tests). The thread lets go of the GIL
    while it waits for the GPU, but a busy event loop can hold it up; see EngineProcess."""

    kind = "thread"

    def __init__(self, text: TextEngine, max_requests: int | None = None, watchdog: float | None = None):
        """max_requests: requests queued or running at once, beyond which ``submit`` raises
        Overloaded (None: unbounded, the engine queues); watchdog: see ``_Streams``."""
        super().__init__(max_requests, watchdog)
        self.text = text
        self.max_context = text.engine.max_context
        self.tokenizer = text.tokenizer  # the API's /tokenize and echo read it here, off the engine
        self.sampling_defaults = text.tokenizer.sampling_defaults
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mambastep-engine", daemon=True)
        self._thread.start()
        self._start_watchdog()

    async def submit(self, prompt, params, stop=(), cap: bool = False) -> Stream:
        """Add a request; its Stream. ``cap``: the request named no max_tokens, so
        ``params.max_tokens`` is cut to the room its prompt leaves in the context (a max_tokens
        asked for past it is a ValueError). Raises what the engine raises for bad input
        (ValueError, TokenizerError), Overloaded, or RuntimeError once closed."""
        return (await self.submit_choices(prompt, params, stop, cap))[0]

    async def submit_choices(self, prompt, params, stop=(), cap: bool = False, n: int = 1) -> list[Stream]:
        """As ``submit``, for ``n`` choices of one prompt (``Engine.add_choices``): a Stream each."""
        if self._closed.is_set():
            raise RuntimeError(self.failure or "the engine loop is closed")
        # tokenizing in the engine's thread would stall every stream: here, or for a long prompt
        # in a worker thread (off the event loop too)
        ids, params, stop = await _encode(self.text.streams, prompt, params, stop, self.max_context, cap)
        done: Future = Future()
        self._inbox.put(("add", (ids, params, stop, n, asyncio.get_running_loop(), done)))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: int) -> None:
        """Drop a request (a client went away); a no-op for one already finished."""
        self._inbox.put(("abort", request_id))

    def counts(self) -> tuple[int, int, int, dict | None]:
        """The engine's (free slots, running requests, waiting requests, prefix cache counts)."""
        return _counts(self.text)

    def close(self, timeout: float = 10.0) -> None:
        """Abort every request in flight, end their streams (with "error"), and stop the thread."""
        self._closing = True
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
        except BaseException as e:
            self._fail(f"the engine failed: {type(e).__name__}: {e}")
            raise
        finally:
            self._closed.set()
            for rid in list(self._streams):
                if self.failure is None:
                    _drop(self.text, rid)
                self._end(rid, "error")

    def _handle(self, kind: str, arg) -> None:
        if kind == "add":
            ids, params, stop, n, loop, done = arg
            if (refused := self._overloaded()) is not None:
                done.set_exception(refused)
                return
            try:
                rids = _admit(self.text, ids, params, stop, n)
            except Exception as e:  # bad input: the caller's error, nothing changed here
                done.set_exception(e)
                return
            done.set_result([self._open(rid, len(ids), loop) for rid in rids])
        elif kind == "abort":
            self._abort(arg)
        elif kind == "close":
            self._closed.set()

    def _abort(self, rid: int) -> None:
        _drop(self.text, rid)
        self._end(rid)


def _child(build, conns, max_requests: int | None = None) -> None:
    """The engine process: build the TextEngine, then serve its clients (``_EngineServer``). It
    ignores SIGINT and SIGTERM (a Ctrl-C or a supervisor's signal reaches the whole group): the
    server drains first, then closes the owner's connection, which ends this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        text = build()
    except Exception as e:  # a bad checkpoint: the parent reports it
        conns[0].send(("failed", str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))
        return
    _EngineServer(text, conns, max_requests).run()


class _EngineServer:
    """The engine process's side of its connections, one per API process: the engine's tokenizer
    handed to each at start; between steps their messages (add, abort, close); after each step
    every connection its own requests' tokens (with the free slots after it) as tuples, which
    pickle in a seventh of a dataclass's time. Text is the API side's work. The first connection
    is the owner's: when it closes (or is gone) the process ends; another one leaving has its
    requests dropped, the rest are told the counts that frees, and they go on. ``max_requests``
    bounds the requests of all of them together (each API process also checks it against its own,
    before sending)."""

    def __init__(self, text: TextEngine, conns, max_requests: int | None = None):
        self.text, self.engine, self.max_requests = text, text.engine, max_requests
        self.live = dict(enumerate(conns))
        # each connection's messages go through a bounded outbox: an API process that stops
        # reading (stopped, wedged) is given up on, never waited for
        self.outboxes = {i: _Outbox(c, name=f"mambastep-outbox-{i}") for i, c in self.live.items()}
        self.owner: dict[int, int] = {}  # request id -> the index of the connection that added it

    def run(self) -> None:
        for i in list(self.live):
            self._send(i, "ready", _counts(self.text), self.text.tokenizer, len(self.live),
                       self.engine.max_context)
        while 0 in self.live:
            for i in [i for i in self.live if self.outboxes[i].dead.is_set()]:
                self._leave(i)
            if 0 not in self.live:
                break
            busy = self.engine.has_unfinished()
            ready = multiprocessing.connection.wait(list(self.live.values()), 0 if busy else None)
            if not ready:
                self._step()
            for conn in ready:
                i = next((i for i, c in self.live.items() if c is conn), None)
                if i is None:  # it left while this round's messages were handled
                    continue
                try:
                    kind, *arg = conn.recv()
                except (EOFError, OSError):
                    kind, arg = "close", ()
                self._handle(i, kind, arg)

    def _step(self) -> None:
        outs: dict[int, list] = {i: [] for i in self.live}
        for o in self.engine.step():
            i = self.owner.pop(o.id, None) if o.finished else self.owner.get(o.id)
            if i in outs:
                outs[i].append((o.id, o.new_tokens, o.finished, o.finish_reason, o.logprobs))
        counts = _counts(self.text)
        for i in list(self.live):
            self._send(i, "step", outs[i], counts)

    def _handle(self, i: int, kind: str, arg) -> None:
        if kind == "add":
            token, ids, params, n = arg
            if (refused := _past_bound(len(self.owner), self.max_requests)) is not None:
                self._send(i, "refused", token, refused)
                return
            try:
                rids = _add(self.engine, ids, params, n)
            except Exception as e:  # bad input: the caller's error, nothing changed here
                self._send(i, "refused", token, e)
                return
            for rid in rids:
                self.owner[rid] = i
            self._send(i, "added", token, rids)
        elif kind == "abort":
            _drop(self.text, arg[0])
            self.owner.pop(arg[0], None)
            self._send(i, "ended", arg[0], _counts(self.text))
        elif kind == "close":
            self._leave(i)

    def _send(self, i: int, *msg) -> None:
        if i in self.live and not self.outboxes[i].put(msg):  # that API process is gone or wedged
            self._leave(i)

    def _leave(self, i: int) -> None:
        """Connection i is done: closed (so its reader ends), its requests dropped."""
        if i not in self.live:
            return
        self.outboxes[i].stop()
        self.live.pop(i).close()
        for rid in [r for r, j in self.owner.items() if j == i]:
            _drop(self.text, rid)
            del self.owner[rid]
        # the slots it held are free: tell the others, whose counts otherwise come with steps
        # (and with nothing left to step, none would come)
        counts = _counts(self.text)
        for j in list(self.live):
            self._send(j, "counts", counts)


class EngineClient(_Streams):
    """An API process's side of the engine process, over one connection to it: this process
    encodes prompts, turns each step's tokens into text (``TextStreams``, with the engine's
    tokenizer, handed over at start) and streams, so the engine never waits for this side's GIL
    nor does its text work. ``EngineProcess`` starts the engine and is the first client; the
    connections it ``attach``es serve further API processes (``mambastep serve --api-processes``)."""

    kind = "process"

    def __init__(self, conn, max_requests: int | None = None, start_timeout: float = 600.0,
                 watchdog: float | None = None):
        super().__init__(max_requests, watchdog)
        self._conn = conn
        if not conn.poll(start_timeout):
            raise RuntimeError(f"the engine process did not start within {start_timeout:.0f} s")
        try:
            kind, *arg = conn.recv()
        except EOFError:
            raise RuntimeError("the engine process exited before it was ready") from None
        if kind == "failed":
            raise ValueError(arg[0])
        self._counts, tokenizer, self.api_processes, self.max_context = arg
        self._texts = TextStreams(tokenizer)  # touched by the reader thread only
        self.tokenizer = tokenizer  # the API's /tokenize and echo read it here, off the engine
        self.sampling_defaults = tokenizer.sampling_defaults
        self._outbox = _Outbox(conn, name="mambastep-outbox")
        # submissions the engine has not answered: (future, its event loop, prompt ids, stop strings)
        self._pending: dict[int, tuple[Future, asyncio.AbstractEventLoop, list[int], tuple]] = {}
        self._tokens = itertools.count()
        self._reader = threading.Thread(target=self._read, name="mambastep-engine-reader", daemon=True)
        self._reader.start()
        self._start_watchdog()

    def _send(self, *msg) -> None:
        """Queue a message to the engine; OSError where it no longer reads (wedged or gone)."""
        if not self._outbox.put(msg):
            self._fail(self._alive() or "the engine process stopped reading its connection (wedged)")
            raise OSError("the engine process is not reading")

    def _outstanding(self) -> int:
        return len(self._streams) + len(self._pending)

    async def submit(self, prompt, params, stop=(), cap: bool = False) -> Stream:
        """As EngineLoop.submit."""
        return (await self.submit_choices(prompt, params, stop, cap))[0]

    async def submit_choices(self, prompt, params, stop=(), cap: bool = False, n: int = 1) -> list[Stream]:
        """As EngineLoop.submit_choices."""
        if self._closed.is_set():
            raise RuntimeError(self.failure or "the engine loop is closed")
        if (refused := self._overloaded(len(self._pending))) is not None:
            raise refused
        ids, params, stop = await _encode(self._texts, prompt, params, stop, self.max_context, cap)  # raises on bad input
        done: Future = Future()
        token = next(self._tokens)
        self._pending[token] = (done, asyncio.get_running_loop(), ids, stop)
        try:
            self._send("add", token, ids, params, n)
        except OSError:
            self._pending.pop(token, None)
            raise RuntimeError(self.failure or "the engine loop is closed") from None
        return await asyncio.wrap_future(done)

    def abort(self, request_id: int) -> None:
        if request_id in self._streams and not self._closed.is_set():
            try:
                self._send("abort", request_id)
            except OSError:
                pass

    def counts(self) -> tuple[int, int, int, dict | None]:
        return self._counts

    def close(self, timeout: float = 10.0) -> None:
        """Leave the engine process, its requests from here aborted; every open stream ends with
        finish_reason "error"."""
        self._leave()
        self._reader.join(timeout)  # it ends as the engine process closes its end
        self._conn.close()

    def _leave(self) -> None:
        """Tell the engine process this connection is done (what ends now is no failure)."""
        self._closing = True
        try:
            self._send("close")
        except OSError:
            pass
        self._outbox.stop()

    def _text(self, outs) -> list[TextOutput]:
        """A step's tokens as text; a request a stop string ended is aborted in the child."""
        texts = []
        for rid, tokens, finished, reason, logprobs in outs:
            if rid in self._texts:  # else aborted meanwhile
                text, stopped = self._texts.text(rid, tokens, finished, reason, logprobs)
                if stopped:
                    self.abort(rid)
                texts.append(text)
        return texts

    def _read(self) -> None:
        try:
            while True:
                kind, *arg = self._conn.recv()
                self._progress = time.monotonic()
                if kind == "step":
                    self.steps += 1
                    outs, self._counts = arg
                    self._deliver(self._text(outs))
                elif kind == "added":
                    token, rids = arg
                    done, loop, ids, stop = self._pending.pop(token)
                    for rid in rids:
                        self._texts.open(rid, ids, stop)
                    done.set_result([self._open(rid, len(ids), loop) for rid in rids])
                elif kind == "refused":
                    token, error = arg
                    self._pending.pop(token)[0].set_exception(error)
                elif kind == "ended":
                    rid, self._counts = arg
                    self._texts.drop(rid)
                    self._end(rid)
                elif kind == "counts":  # another API process left (``_EngineServer._leave``)
                    (self._counts,) = arg
        except (EOFError, OSError):
            pass
        finally:
            if not self._closing:
                self._fail(self._exit_cause() or "the engine process closed its connection")
            self._closed.set()
            for rid in list(self._streams):
                self._end(rid, "error")
            for done, *_ in self._pending.values():
                done.set_exception(RuntimeError(self.failure or "the engine loop is closed"))
            self._pending.clear()


class EngineProcess(EngineClient):
    """The engine in a process of its own, stepping on token ids only, and this process its first
    client. ``build``: a picklable callable that returns the TextEngine (it runs in the child;
    e.g. ``functools.partial(TextEngine.load, ...)``). ``attach``: connections made for that many
    more API processes, in ``self.attached``, each for an ``EngineClient`` there."""

    def __init__(self, build, max_requests: int | None = None, start_timeout: float = 600.0, attach: int = 0,
                 watchdog: float | None = None):
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: CUDA starts in the child
        pipes = [ctx.Pipe() for _ in range(1 + attach)]
        self._process = ctx.Process(target=_child, args=(build, [child for _, child in pipes], max_requests),
                                    name="mambastep-engine", daemon=True)
        self._process.start()
        for _, child in pipes:
            child.close()
        self.attached = [conn for conn, _ in pipes[1:]]
        try:
            super().__init__(pipes[0][0], max_requests, start_timeout, watchdog)
        except RuntimeError:  # it did not start in time, or exited before it was ready
            self._process.kill()
            raise
        except ValueError:  # it could not build the engine, and said why
            self._process.join()
            raise

    def _alive(self) -> str | None:
        code = self._process.exitcode
        if code is None:
            return None
        return f"the engine process was killed by signal {-code}" if code < 0 else \
            f"the engine process exited with code {code}"

    def _exit_cause(self) -> str | None:
        self._process.join(2.0)  # its pipe closes a moment before it can be reaped
        return self._alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine process (attached API processes lose it too); every open stream here
        ends with finish_reason "error"."""
        self._leave()
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
        self._reader.join(timeout)
