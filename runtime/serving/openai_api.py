"""An OpenAI-compatible HTTP API over the engine loop, as a Starlette (ASGI) app.

    POST /v1/completions        prompt (text or token ids, or a batch of them: n choices each,
                                each prompt prefilled once) -> text; "stream": true for SSE;
                                "echo": the prompt first
    POST /v1/chat/completions   messages (text content, text parts, an assistant's null) ->
                                assistant message; "stream": true for SSE
    GET  /v1/models             the model served, under each of its names
    GET  /v1/models/{id}        that model, or a 404
    POST /tokenize              vLLM's: a prompt or messages -> token ids (no engine work)
    POST /detokenize            vLLM's: token ids -> text
    GET  /health                200 while the engine loop runs and every API process listens;
                                503 "starting", "draining", "failed" (the engine's fault) or "stopped"
    GET  /version               the package's version
    GET  /metrics               Prometheus metrics (``metrics``)

Handlers only validate, submit, await outputs and abort when the client goes away (streamed or
not, queued or running). A request is checked whole before it reaches the engine: a bad one
gets a 4xx with an OpenAI-style error body and touches nothing else, a request past the loop's
bound or during shutdown a 503. A request the engine cannot finish (it failed, or the server is
shutting down) gets a 500 or 503, or in a stream an error event: never a 200 with partial text.
Every error, unknown routes and methods included, has the OpenAI-style JSON body. Request bodies
are read and checked by ``openai_request``: a field this server does not do yet (tools,
response_format, suffix, ...) is a 400 naming it unless it asks for nothing; a field no endpoint
knows is refused too, as OpenAI refuses it. Log-probabilities come in each endpoint's shape
(``openai_logprobs``), streamed or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
import json
import logging
import os
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import openai_request as fields
from .loop import EngineLoop, EngineProcess, Overloaded
from .openai_logprobs import LogprobFormat
from .openai_request import BadRequest
from .tokenizer import TokenizerError

__all__ = ["create_app"]

_access = logging.getLogger("mambastep.access")


def _error_body(e: BadRequest) -> dict:
    return {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": None}}


def _error(e: BadRequest) -> JSONResponse:
    return JSONResponse(_error_body(e), status_code=e.status)


class _Chunks:
    """The server-sent events of one streamed response, as bytes."""

    def __init__(self, rid: str, kind: str, created: int, model: str, chat: bool, index: int = 0):
        """index: the choice these chunks carry (a batch of prompts streams one choice each)."""
        self.rid, self.created, self.model, self.chat, self.index = rid, created, model, chat, index
        self.object = kind + (".chunk" if chat else "")
        # a step's chunk mid-stream, tens of thousands a second at high concurrency: the same
        # bytes as the general one's, with only the text encoded each time (its last string)
        self._head, self._tail = self("\0").rsplit(json.dumps("\0").encode(), 1)

    def __call__(self, text: str | None, reason: str | None = None, role: bool = False,
                 logprobs: dict | None = None) -> bytes:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text or ""}
            choice = {"index": self.index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": self.index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        data = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice]}
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def usage(self, usage: dict) -> bytes:
        """The closing chunk of ``stream_options.include_usage``: no choices, the counts."""
        data = {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage}
        return f"data: {json.dumps(data)}\n\n".encode()

    def text(self, text: str) -> bytes:
        """The chunk of text mid-stream (no finish reason): equal to ``self(text)``."""
        return self._head + json.dumps(text, ensure_ascii=False).encode() + self._tail


def create_app(loop: EngineLoop | EngineProcess, model_name: str | list[str], default_max_tokens: int | None = None,
               listening=None, api_key: str | None = None, max_body_bytes: int = 16 << 20,
               draining=lambda: False, access_log: bool = False, request_timeout: float | None = None,
               body_timeout: float = 30.0):
    """The API over ``loop``, serving ``model_name`` (or several names for it: a request may
    ask for any, and the response names the one asked for); ``default_max_tokens`` where a request
    names none (None: the rest of the context). ``listening``: None, or a callable giving how
    many of the ``loop.api_processes`` HTTP server processes listen yet; until all do, /health
    answers 503 "starting". ``api_key``: a Bearer token every /v1 route asks for.
    ``max_body_bytes``: a larger body is a 413, read no further; ``body_timeout``: seconds to
    receive the whole body, past which a 408 (a slow sender holds no connection for long).
    ``draining``: a callable, true once the server is shutting down: /health and new requests
    then get a 503 "draining".
    Every response carries an X-Request-Id (the client's, where it sent one); ``access_log``:
    a line a request on the "mambastep.access" logger. ``request_timeout``: seconds a request
    may take from arrival; past them it is aborted with a 504 (or an error event). /metrics:
    Prometheus's text format (``metrics.Metrics``)."""
    from .metrics import CONTENT_TYPE, Metrics

    metrics = Metrics(loop)
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    logprob_format = LogprobFormat(loop.tokenizer)

    def served(body: dict) -> str:
        """The name a response gives: the one the request asked for, else the first."""
        return body.get("model") or names[0]

    def authorize(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise BadRequest("missing or wrong API key (Authorization: Bearer ...)", status=401,
                             kind="authentication_error")

    async def read_body(request: Request) -> dict:
        authorize(request)
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise BadRequest("the request body must be JSON (Content-Type: application/json)", status=415)
        if int(request.headers.get("content-length") or 0) > max_body_bytes:
            raise BadRequest(f"the request body is larger than {max_body_bytes} bytes", status=413)
        raw = bytearray()

        async def read():
            async for piece in request.stream():
                raw.extend(piece)
                if len(raw) > max_body_bytes:
                    raise BadRequest(f"the request body is larger than {max_body_bytes} bytes", status=413)

        try:
            await asyncio.wait_for(read(), body_timeout)
        except asyncio.TimeoutError:
            raise BadRequest(f"the request body did not arrive within {body_timeout:g} s", status=408) from None
        try:
            body = json.loads(raw)
            # a lone surrogate (\ud800) parses, but is no text: refuse it here, not in the tokenizer
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest("the request body holds a lone surrogate (not valid Unicode text)") from None
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("model") not in (None, *names):
            raise BadRequest(f"model {body.get('model')!r} is not served here; this server serves "
                             f"{' or '.join(map(repr, names))}",
                             "model", status=404, kind="model_not_found")
        if draining() or loop.closed:
            raise BadRequest(f"server unavailable: {loop.failure or 'shutting down'}", status=503,
                             kind="server_error")
        return body

    async def submit(prompts: list, body: dict, chat: bool) -> tuple[list, bool]:
        """Every field checked, then each prompt handed to the engine as a request of its own
        choices (``best_of`` of them, else ``n``), in order; their Streams, and whether they report
        log-probabilities. All or nothing: where one is refused, those admitted are aborted."""
        (params, cap), stop = fields.sampling(body, default_max_tokens, loop.sampling_defaults, chat), fields.stop(body)
        n = fields.choices(body)
        logprobs = params.logprobs is not None
        if not chat and (best := fields.best_of(body, n)) > n:
            # the best are ranked by their tokens' log-probabilities: drawn whether asked for or not
            params, n = dataclasses.replace(params, logprobs=params.logprobs or 0), best
        streams = []
        try:
            for prompt in prompts:
                streams += await loop.submit_choices(prompt, params, stop, cap=cap, n=n)
        except Overloaded as e:
            refused = BadRequest(f"server overloaded: {e}", status=503, kind="server_error")
        except RuntimeError as e:  # the loop has stopped
            refused = BadRequest(f"server unavailable: {e}", status=503, kind="server_error")
        except (ValueError, TokenizerError, KeyError) as e:
            message = str(e)
            refused = BadRequest(message, next((f for f in ("max_tokens", "prompt", "logit_bias", "n")
                                                if message.startswith(f + ":")), None))
        else:
            return streams, logprobs
        for stream in streams:
            loop.abort(stream.id)
        raise refused

    async def completions(request: Request):
        arrived = time.monotonic()
        try:
            body = await read_body(request)
            prompts = fields.prompts(body)
            fields.known_fields(body, "completions")
            streaming, echo = fields.streaming(body), fields.echo(body)
            streams, logprobs = await submit(prompts, body, chat=False)
        except BadRequest as e:
            metrics.rejected()
            return _error(e)
        # echo: each prompt's text before its completion (token ids decoded, special tokens kept)
        per_prompt = len(streams) // len(prompts)
        echoes = [p if isinstance(p, str) else loop.tokenizer.decode(p, skip_special_tokens=False)
                  for p in prompts for _ in range(per_prompt)] if echo else None
        return await respond(request, streams, streaming, False, arrived, served(body), echoes, logprobs, per_prompt,
                             fields.choices(body))

    async def chat(request: Request):
        arrived = time.monotonic()
        try:
            body = await read_body(request)
            messages = fields.messages(body)
            fields.known_fields(body, "chat")
            streaming = fields.streaming(body)
            streams, logprobs = await submit([messages], body, chat=True)
        except BadRequest as e:
            metrics.rejected()
            return _error(e)
        return await respond(request, streams, streaming, True, arrived, served(body), logprobs=logprobs,
                             per_prompt=len(streams))

    def failed() -> BadRequest:
        """The error of a request the engine could not finish (it failed, or the server is
        shutting down): a 500 or 503 with an OpenAI-style body, never partial text."""
        if loop.failure:
            return BadRequest(f"the engine failed: {loop.failure}", status=500, kind="server_error")
        return BadRequest("the server is shutting down", status=503, kind="server_error")

    async def respond(request: Request, streams: list, streaming: tuple[bool, bool], chat: bool, arrived: float,
                      model: str, echoes: list[str] | None = None, logprobs: bool = False, per_prompt: int = 1,
                      best: int | None = None):
        """The answer to one request of one or more prompts, ``streams`` its choices (each prompt's
        in turn, ``per_prompt`` each); ``logprobs``: with each choice's log-probabilities;
        ``best``: of each prompt's choices, answer with this many, those of the highest cumulative
        log-probability, best first (``best_of``; not streamed)."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        streamed, include_usage = streaming
        deadline = None if request_timeout is None else arrived + request_timeout
        n = len(streams)
        for stream in streams:
            metrics.admitted(stream.prompt_tokens)
        # a prompt counts once however many choices it has
        prompt_tokens = sum(stream.prompt_tokens for stream in streams[::per_prompt])
        # each choice's tokens, time of its first token and outcome ("aborted" unless it ends otherwise)
        tokens, first, outcome = [0] * n, [None] * n, ["aborted"] * n

        def ended() -> None:
            """Each choice's end, counted once; a choice left unfinished frees its slot."""
            for i, stream in enumerate(streams):
                if outcome[i] not in ("stop", "length"):
                    loop.abort(stream.id)
                metrics.ended(outcome[i], tokens[i], arrived, first[i], time.monotonic())

        def usage() -> dict:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": sum(tokens),
                    "total_tokens": prompt_tokens + sum(tokens)}

        def timed_out() -> BadRequest:
            return BadRequest(f"the request took longer than the server's {request_timeout:g} s limit", status=504,
                              kind="timeout")

        def end_open(outcome_: str) -> None:
            """The choices still open (not finished) end as ``outcome_``."""
            outcome[:] = [o if o != "aborted" else outcome_ for o in outcome]

        offsets = [0] * n  # each choice's text offset, for the completions shape

        def logprobs_of(i: int, outs) -> dict | None:
            """The log-probabilities of choice i's tokens in ``outs``, in the endpoint's shape."""
            if not logprobs:
                return None
            ids = [t for o in outs for t in o.token_ids]
            values = [lp for o in outs for lp in (o.logprobs or ())]
            if chat:
                return logprob_format.chat(ids, values)
            shaped, offsets[i] = logprob_format.completion(ids, values, offsets[i])
            return shaped

        def count(i: int, outs) -> None:
            got = sum(len(o.token_ids) for o in outs)
            if first[i] is None and got:
                first[i] = time.monotonic()
            tokens[i] += got

        if not streamed:
            pieces, outputs = [[] for _ in streams], [[] for _ in streams]

            async def collect(i: int) -> None:
                while True:
                    out = await streams[i].next()
                    count(i, [out])
                    pieces[i].append(out.text)
                    outputs[i].append(out)
                    if out.finished:
                        outcome[i] = out.finish_reason if out.finish_reason in ("stop", "length") else "error"
                        return

            # a plain response is not told that its client left: watch for it beside the request
            collector = asyncio.ensure_future(asyncio.gather(*(collect(i) for i in range(n))))
            watcher = asyncio.ensure_future(_disconnected(request))
            try:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                await asyncio.wait({collector, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watcher.cancel()
                left = watcher.done() and not watcher.cancelled()
                if not collector.done():  # the client left, or the deadline passed: free the slots
                    collector.cancel()
                    if not left:
                        end_open("timeout")
                ended()
            if not collector.done() or collector.cancelled():
                return Response(status_code=499) if left else _error(timed_out())  # 499: nobody reads it
            if "error" in outcome:
                return _error(failed())
            kept = list(range(n))
            if best is not None and best < per_prompt:
                def score(i):
                    return sum(lp.logprob for o in outputs[i] for lp in o.logprobs or ())
                kept = [i for g in range(0, n, per_prompt)
                        for i in sorted(range(g, g + per_prompt), key=score, reverse=True)[:best]]
            choices = []
            for index, i in enumerate(kept):
                text = (echoes[i] if echoes else "") + "".join(pieces[i])
                choice = {"index": index, "finish_reason": outcome[i], "logprobs": logprobs_of(i, outputs[i])}
                choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
                choices.append(choice)
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": model, "choices": choices,
                                 "usage": usage()})

        chunks = [_Chunks(rid, kind, created, model, chat, i) for i in range(n)]

        async def events():
            merged = _Merged(streams)
            try:
                if chat:
                    for chunk in chunks:
                        yield chunk(None, role=True)
                for i, text in enumerate(echoes or ()):
                    yield chunks[i].text(text)
                running = n
                while running:
                    # a chunk a step (empty text included: a piece of a character, held back), or
                    # every step's output waiting since the last chunk when a stream fell behind;
                    # the per-chunk path stays lean: tens of thousands a second at high concurrency
                    if deadline is None:
                        i, outs = await merged.next()
                    else:
                        try:
                            i, outs = await asyncio.wait_for(merged.next(), max(0.0, deadline - time.monotonic()))
                        except asyncio.TimeoutError:
                            end_open("timeout")
                            yield f"data: {json.dumps(_error_body(timed_out()))}\n\n".encode()
                            return
                    count(i, outs)
                    last = outs[-1]
                    text = last.text if len(outs) == 1 else "".join(o.text for o in outs)
                    if not last.finished:
                        yield chunks[i](text, logprobs=logprobs_of(i, outs)) if logprobs else chunks[i].text(text)
                        continue
                    if last.finish_reason not in ("stop", "length"):
                        # the engine failed or the server is going down: an error event, no [DONE]
                        end_open("error")
                        yield f"data: {json.dumps(_error_body(failed()))}\n\n".encode()
                        return
                    outcome[i] = last.finish_reason
                    running -= 1
                    yield chunks[i](text, last.finish_reason, logprobs=logprobs_of(i, outs))
                if include_usage:
                    yield chunks[0].usage(usage())
                yield "data: [DONE]\n\n"
            finally:
                merged.close()
                ended()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "mambastep", "max_model_len": loop.max_context}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_card(name) for name in names]})

    async def model(request: Request):
        if request.path_params["model"] not in names:
            return _error(BadRequest(f"model {request.path_params['model']!r} is not served here; this server "
                                     f"serves {' or '.join(map(repr, names))}", "model", status=404,
                                     kind="model_not_found"))
        return JSONResponse(model_card(request.path_params["model"]))

    async def tokenize(request: Request):
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} (the chat template's prompt),
        and "add_special_tokens" (default: true for a prompt, false for messages, as vLLM)
        -> {"count", "max_model_len", "tokens"}; the engine is not involved."""
        try:
            body = await read_body(request)
            fields.only(body, {"model", "prompt", "messages", "add_special_tokens"}, "tokenize")
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise BadRequest(f"add_special_tokens: expected true or false, got {special!r}", "add_special_tokens")
            if "messages" in body:  # the template writes its own special tokens: none added unless asked
                text = loop.tokenizer.apply_chat_template(fields.messages(body))
                work = functools.partial(loop.tokenizer.encode, text,
                                         add_special_tokens=body.get("add_special_tokens", False))
            elif isinstance(body.get("prompt"), str):
                work = functools.partial(loop.tokenizer.encode, body["prompt"], add_special_tokens=special)
            else:
                raise BadRequest("prompt: expected a string (or give messages)", "prompt")
            ids = await asyncio.to_thread(work)  # a long text stalls no stream
        except TokenizerError as e:
            return _error(BadRequest(str(e), "messages"))
        except BadRequest as e:
            return _error(e)
        return JSONResponse({"count": len(ids), "max_model_len": loop.max_context, "tokens": ids})

    async def detokenize(request: Request):
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        try:
            body = await read_body(request)
            fields.only(body, {"model", "tokens"}, "detokenize")
            ids = body.get("tokens")
            vocab = loop.tokenizer.vocab_size
            if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                  for t in ids)):
                raise BadRequest(f"tokens: expected a list of token ids in [0, {vocab})", "tokens")
            text = await asyncio.to_thread(loop.tokenizer.decode, ids, False)
        except BadRequest as e:
            return _error(e)
        return JSONResponse({"prompt": text})

    async def health(request: Request):
        if loop.closed:
            return JSONResponse({"status": "failed" if loop.failure else "stopped", "error": loop.failure},
                                status_code=503)
        if draining():
            return JSONResponse({"status": "draining", "open_requests": loop.open_requests(), "pid": os.getpid()},
                                status_code=503)
        if listening is not None and listening() < loop.api_processes:
            return JSONResponse({"status": "starting", "api_processes": loop.api_processes,
                                 "listening": listening()}, status_code=503)
        return JSONResponse({"status": "ok", "open_requests": loop.open_requests(), "free_slots": loop.free_slots(),
                             "steps": loop.steps,
                             "engine": loop.kind, "api_processes": loop.api_processes,
                             "pid": os.getpid()})  # which API process answered

    def guarded(handler):
        """The API key on a GET route too (POST routes check it with their body)."""
        async def route(request: Request):
            try:
                authorize(request)
            except BadRequest as e:
                return _error(e)
            return await handler(request)
        return route

    async def http_error(request: Request, exc: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _error(BadRequest(message, status=exc.status_code, kind=kind))

    async def server_error(request: Request, exc: Exception):
        return _error(BadRequest(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error"))

    async def version(request: Request):
        return JSONResponse({"version": _version()})

    async def metrics_text(request: Request):
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(model), methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error, Exception: server_error})
    return _RequestIds(app, access_log)


def _version() -> str:
    try:
        return importlib.metadata.version("mambastep")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _RequestIds:
    """ASGI middleware: an X-Request-Id on every response (the client's, where it sent one) and,
    with ``log``, one access-log line a request: client, method, path, status, time, id."""

    def __init__(self, app, log: bool):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        status, start = None, time.monotonic()

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.log:
                client = scope.get("client") or ("-", 0)
                _access.info('%s:%s "%s %s" %s %.1f ms id=%s', client[0], client[1], scope["method"], scope["path"],
                             status if status is not None else "-", 1e3 * (time.monotonic() - start), rid)


class _Merged:
    """The outputs of a request's streams as they come, ``(index, outputs)`` a step (a stream's
    ``next_all``); a lone stream is read directly, several through a task each."""

    def __init__(self, streams: list):
        self._streams = streams
        self._queue: asyncio.Queue | None = None
        if len(streams) > 1:
            self._queue = asyncio.Queue()
            self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, i: int, stream) -> None:
        while True:
            outs = await stream.next_all()
            self._queue.put_nowait((i, outs))
            if outs[-1].finished:
                return

    async def next(self):
        if self._queue is None:
            return 0, await self._streams[0].next_all()
        return await self._queue.get()

    def close(self) -> None:
        for task in self._tasks if self._queue is not None else ():
            task.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
