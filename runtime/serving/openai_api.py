"""An OpenAI-compatible HTTP API over the engine loop, as a Starlette (ASGI) app.

    POST /v1/completions        prompt (text or token ids) -> text; "stream": true for SSE
    POST /v1/chat/completions   messages -> assistant message; "stream": true for SSE
    GET  /v1/models             the one model served
    GET  /v1/models/{id}        that model, or a 404
    GET  /health                200 while the engine loop runs and every API process listens;
                                503 "starting", "draining", "failed" (the engine's fault) or "stopped"
    GET  /version               the package's version
    GET  /metrics               Prometheus metrics (``metrics``)

Handlers only validate, submit, await outputs and abort when the client goes away (streamed or
not, queued or running). A request is checked whole before it reaches the engine: a bad one
gets a 4xx with an OpenAI-style error body and touches nothing else, a request past the loop's
bound or during shutdown a 503. A request the engine cannot finish (it failed, or the server is
shutting down) gets a 500 or 503, or in a stream an error event: never a 200 with partial text.
Every error, unknown routes and methods included, has the OpenAI-style JSON body. A request field
this server does not do yet (logprobs, penalties, logit_bias, echo, tools, ...) is a 400 naming it
unless it asks for nothing; a field no endpoint knows is refused too, as OpenAI refuses it.
"""

from __future__ import annotations

import asyncio
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

from ..request import SamplingParams
from .loop import EngineLoop, EngineProcess, Overloaded
from .tokenizer import TokenizerError

__all__ = ["create_app"]

_access = logging.getLogger("mambastep.access")

# request fields that are SamplingParams fields of the same name (OpenAI's, plus top_k and ignore_eos)
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "max_tokens", "ignore_eos")


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def _error_body(e: BadRequest) -> dict:
    return {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": None}}


def _error(e: BadRequest) -> JSONResponse:
    return JSONResponse(_error_body(e), status_code=e.status)


_UNBOUNDED = 1 << 30  # max_tokens where neither the request nor the server names one: the context's room


def _sampling(body: dict, default_max_tokens: int | None, defaults: dict) -> tuple[SamplingParams, bool]:
    """The request's sampling fields, over the checkpoint's generation_config.json defaults,
    over OpenAI's (temperature 1); and whether max_tokens is the server's to cap (the request
    named none: the default, or the rest of the context)."""
    kw = {"temperature": 1.0, **defaults}
    for name in _SAMPLING:
        if body.get(name) is not None:
            kw[name] = body[name]
    if body.get("max_completion_tokens") is not None:
        kw["max_tokens"] = body["max_completion_tokens"]
    cap = "max_tokens" not in kw
    if cap:
        kw["max_tokens"] = default_max_tokens or _UNBOUNDED
    if body.get("n", 1) != 1:
        raise BadRequest("n: only 1 choice is supported", "n")
    try:
        return SamplingParams(**kw), cap
    except ValueError as e:
        raise BadRequest(str(e), str(e).split(":")[0]) from None


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise BadRequest("stop: expected a string or up to 4 non-empty strings", "stop")
    return tuple(stop)


# the fields each endpoint reads (``model``, ``user``: a name and a caller's tag, nothing to do)
_READ = {"model", "user", "stream", "stream_options", "stop", "n", *_SAMPLING}
_FIELDS = {"completions": _READ | {"prompt"}, "chat": _READ | {"messages", "max_completion_tokens"}}
# OpenAI's (and vLLM's) fields not done yet: accepted at the value that asks for nothing, else a
# 400 naming them, never silently ignored
_NOT_YET = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "logit_bias": (None, {}), "min_tokens": (None, 0), "stop_token_ids": (None, []), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "functions": (None, []), "function_call": (None, "none", "auto"),
}


def _known_fields(body: dict, endpoint: str) -> None:
    """Every field of the request is one this server reads, or one it does not do yet left at
    the value that asks for nothing; else a 400 naming it (as OpenAI refuses what it does not take)."""
    for name, value in body.items():
        if name in _FIELDS[endpoint]:
            continue
        if name not in _NOT_YET:
            raise BadRequest(f"{name}: unrecognized request argument", name)
        if not any(_same(value, ok) for ok in _NOT_YET[name]):
            raise BadRequest(f"{name}: not supported by this server yet (got {value!r})", name)


def _same(value, ok) -> bool:
    """JSON equality, where true is not 1 nor false 0 (but 0.0 is 0)."""
    if isinstance(value, bool) or isinstance(ok, bool) or value is None or ok is None:
        return value is ok
    return value == ok


def _streaming(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage), checked."""
    stream, options = body.get("stream", False), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"stream: expected true or false, got {stream!r}", "stream")
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)):
        raise BadRequest(f"stream_options: expected {{\"include_usage\": true|false}}, got {options!r}",
                         "stream_options")
    if options is not None and not stream:
        raise BadRequest("stream_options: only with \"stream\": true", "stream_options")
    return bool(stream), bool((options or {}).get("include_usage"))


class _Chunks:
    """The server-sent events of one streamed response, as bytes."""

    def __init__(self, rid: str, kind: str, created: int, model: str, chat: bool):
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.object = kind + (".chunk" if chat else "")
        # a step's chunk mid-stream, tens of thousands a second at high concurrency: the same
        # bytes as the general one's, with only the text encoded each time (its last string)
        self._head, self._tail = self("\0").rsplit(json.dumps("\0").encode(), 1)

    def __call__(self, text: str | None, reason: str | None = None, role: bool = False) -> bytes:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text or ""}
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}
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


def create_app(loop: EngineLoop | EngineProcess, model_name: str, default_max_tokens: int | None = None,
               listening=None, api_key: str | None = None, max_body_bytes: int = 16 << 20,
               draining=lambda: False, access_log: bool = False, request_timeout: float | None = None,
               body_timeout: float = 30.0):
    """The API over ``loop``, serving ``model_name``; ``default_max_tokens`` where a request
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
        if body.get("model") not in (None, model_name):
            raise BadRequest(f"model {body.get('model')!r} is not served here; this server serves {model_name!r}",
                             "model", status=404, kind="model_not_found")
        if draining() or loop.closed:
            raise BadRequest(f"server unavailable: {loop.failure or 'shutting down'}", status=503,
                             kind="server_error")
        return body

    async def submit(prompt, body: dict):
        """Every field checked, then the request handed to the engine; its Stream."""
        (params, cap), stop = _sampling(body, default_max_tokens, loop.sampling_defaults), _stop(body)
        try:
            return await loop.submit(prompt, params, stop, cap=cap)
        except Overloaded as e:
            raise BadRequest(f"server overloaded: {e}", status=503, kind="server_error") from None
        except RuntimeError as e:  # the loop has stopped
            raise BadRequest(f"server unavailable: {e}", status=503, kind="server_error") from None
        except (ValueError, TokenizerError, KeyError) as e:
            message = str(e)
            raise BadRequest(message, next((f for f in ("max_tokens", "prompt") if message.startswith(f)), None)) \
                from None

    async def completions(request: Request):
        arrived = time.monotonic()
        try:
            body = await read_body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise BadRequest("prompt: expected a string or a list of token ids", "prompt")
            if not isinstance(prompt, (str, list)):
                raise BadRequest("prompt: expected a string or a list of token ids", "prompt")
            _known_fields(body, "completions")
            streaming = _streaming(body)
            stream = await submit(prompt, body)
        except BadRequest as e:
            metrics.rejected()
            return _error(e)
        return await respond(request, stream, streaming, chat=False, arrived=arrived)

    async def chat(request: Request):
        arrived = time.monotonic()
        try:
            body = await read_body(request)
            messages = body.get("messages")
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages)):
                raise BadRequest("messages: expected a non-empty list of {role, content} strings", "messages")
            _known_fields(body, "chat")
            streaming = _streaming(body)
            stream = await submit([{"role": m["role"], "content": m["content"]} for m in messages], body)
        except BadRequest as e:
            metrics.rejected()
            return _error(e)
        return await respond(request, stream, streaming, chat=True, arrived=arrived)

    def failed() -> BadRequest:
        """The error of a request the engine could not finish (it failed, or the server is
        shutting down): a 500 or 503 with an OpenAI-style body, never partial text."""
        if loop.failure:
            return BadRequest(f"the engine failed: {loop.failure}", status=500, kind="server_error")
        return BadRequest("the server is shutting down", status=503, kind="server_error")

    async def respond(request: Request, stream, streaming: tuple[bool, bool], chat: bool, arrived: float):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        streamed, include_usage = streaming
        deadline = None if request_timeout is None else arrived + request_timeout
        metrics.admitted(stream.prompt_tokens)

        def ended(outcome: str, tokens: int, first: float | None) -> None:
            metrics.ended(outcome, tokens, arrived, first, time.monotonic())

        def usage(tokens: int) -> dict:
            return {"prompt_tokens": stream.prompt_tokens, "completion_tokens": tokens,
                    "total_tokens": stream.prompt_tokens + tokens}

        def timed_out() -> BadRequest:
            return BadRequest(f"the request took longer than the server's {request_timeout:g} s limit", status=504,
                              kind="timeout")

        if not streamed:
            pieces, tokens, first = [], 0, None

            async def collect() -> str:
                nonlocal tokens, first
                while True:
                    out = await stream.next()
                    if first is None and out.token_ids:
                        first = time.monotonic()
                    tokens += len(out.token_ids)
                    pieces.append(out.text)
                    if out.finished:
                        return out.finish_reason

            # a plain response is not told that its client left: watch for it beside the request
            collector, watcher = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(request))
            try:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                await asyncio.wait({collector, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watcher.cancel()
                unfinished = not collector.done()
                if unfinished:  # the client left, or the deadline passed (queued or running): free its slot
                    collector.cancel()
                    loop.abort(stream.id)
            if unfinished:
                if watcher.done() and not watcher.cancelled():
                    ended("aborted", tokens, first)
                    return Response(status_code=499)  # nobody reads it
                ended("timeout", tokens, first)
                return _error(timed_out())
            reason = collector.result()
            if reason not in ("stop", "length"):
                ended("error", tokens, first)
                return _error(failed())
            ended(reason, tokens, first)
            text = "".join(pieces)
            choice = {"index": 0, "finish_reason": reason, "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": model_name,
                                 "choices": [choice], "usage": usage(tokens)})

        chunk = _Chunks(rid, kind, created, model_name, chat)

        async def events():
            tokens, first = 0, None
            outcome = "aborted"  # unless it ends otherwise: the client went away mid-stream
            try:
                if chat:
                    yield chunk(None, role=True)
                while True:
                    # a chunk a step (empty text included: a piece of a character, held back), or
                    # every step's output waiting since the last chunk when this stream fell behind;
                    # the per-chunk path stays lean: tens of thousands a second at high concurrency
                    if deadline is None:
                        outs = await stream.next_all()
                    else:
                        try:
                            outs = await asyncio.wait_for(stream.next_all(), max(0.0, deadline - time.monotonic()))
                        except asyncio.TimeoutError:
                            outcome = "timeout"
                            yield f"data: {json.dumps(_error_body(timed_out()))}\n\n".encode()
                            return
                    last = outs[-1]
                    if len(outs) == 1:
                        n, text = len(last.token_ids), last.text
                    else:
                        n, text = sum(len(o.token_ids) for o in outs), "".join(o.text for o in outs)
                    if first is None and n:
                        first = time.monotonic()
                    tokens += n
                    if not last.finished:
                        yield chunk.text(text)
                        continue
                    if last.finish_reason not in ("stop", "length"):
                        # the engine failed or the server is going down: an error event, no [DONE]
                        outcome = "error"
                        yield f"data: {json.dumps(_error_body(failed()))}\n\n".encode()
                        return
                    outcome = last.finish_reason
                    yield chunk(text, last.finish_reason)
                    if include_usage:
                        yield chunk.usage(usage(tokens))
                    yield "data: [DONE]\n\n"
                    return
            finally:
                if outcome in ("aborted", "timeout"):  # free its slot
                    loop.abort(stream.id)
                ended(outcome, tokens, first)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "mambastep"}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request):
        if request.path_params["model"] != model_name:
            return _error(BadRequest(f"model {request.path_params['model']!r} is not served here; this server "
                                     f"serves {model_name!r}", "model", status=404, kind="model_not_found"))
        return JSONResponse(model_card())

    async def health(request: Request):
        if loop.closed:
            return JSONResponse({"status": "failed" if loop.failure else "stopped", "error": loop.failure},
                                status_code=503)
        if draining():
            return JSONResponse({"status": "draining", "open_requests": loop.open_requests()}, status_code=503)
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


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
