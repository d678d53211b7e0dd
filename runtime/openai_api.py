"""An OpenAI-compatible HTTP API over the engine loop, as a Starlette (ASGI) app.

    POST /v1/completions        prompt (text or token ids) -> text; "stream": true for SSE
    POST /v1/chat/completions   messages -> assistant message; "stream": true for SSE
    GET  /v1/models             the one model served
    GET  /health                200 while the engine loop runs and every API process listens

Handlers only validate, submit, await outputs and abort when the client goes away; a bad
request gets a 400 with an OpenAI-style error body and touches nothing else, and a request past
the loop's bound a 503.
"""

from __future__ import annotations

import json
import os
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .request import SamplingParams
from .serving import EngineLoop, EngineProcess, Overloaded
from .tokenizer import TokenizerError

__all__ = ["create_app"]

# request fields that are SamplingParams fields of the same name (OpenAI's, plus top_k and ignore_eos)
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "max_tokens", "ignore_eos")


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def _error(e: BadRequest) -> JSONResponse:
    body = {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": None}}
    return JSONResponse(body, status_code=e.status)


def _sampling(body: dict, default_max_tokens: int, defaults: dict) -> SamplingParams:
    """The request's sampling fields, over the checkpoint's generation_config.json defaults,
    over OpenAI's (temperature 1)."""
    kw = {"max_tokens": default_max_tokens, "temperature": 1.0, **defaults}
    for name in _SAMPLING:
        if body.get(name) is not None:
            kw[name] = body[name]
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        kw["max_tokens"] = body["max_completion_tokens"]
    if body.get("n", 1) != 1:
        raise BadRequest("n: only 1 choice is supported", "n")
    try:
        return SamplingParams(**kw)
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


def create_app(loop: EngineLoop | EngineProcess, model_name: str, default_max_tokens: int = 16,
               listening=None) -> Starlette:
    """The API over ``loop``, serving ``model_name``; ``default_max_tokens`` where a request
    names none. ``listening``: None, or a callable giving how many of the ``loop.api_processes``
    HTTP server processes listen yet; until all do, /health answers 503 "starting" (a client
    that waits for it then finds every process taking connections)."""

    async def read_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("model") not in (None, model_name):
            raise BadRequest(f"model {body.get('model')!r} is not served here; this server serves {model_name!r}",
                             "model", kind="model_not_found")
        return body

    async def submit(prompt, body: dict):
        params, stop = _sampling(body, default_max_tokens, loop.sampling_defaults), _stop(body)
        try:
            return await loop.submit(prompt, params, stop)
        except Overloaded as e:
            raise BadRequest(f"server overloaded: {e}", status=503, kind="server_error") from None
        except RuntimeError as e:  # the loop has stopped
            raise BadRequest(f"server unavailable: {e}", status=503, kind="server_error") from None
        except (ValueError, TokenizerError, KeyError) as e:
            raise BadRequest(str(e), "prompt" if "prompt" in str(e) else None) from None

    async def completions(request: Request):
        try:
            body = await read_body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise BadRequest("prompt: expected a string or a list of token ids", "prompt")
            if not isinstance(prompt, (str, list)):
                raise BadRequest("prompt: expected a string or a list of token ids", "prompt")
            stream = await submit(prompt, body)
        except BadRequest as e:
            return _error(e)
        return await respond(request, body, stream, chat=False)

    async def chat(request: Request):
        try:
            body = await read_body(request)
            messages = body.get("messages")
            if not (isinstance(messages, list) and messages and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages)):
                raise BadRequest("messages: expected a non-empty list of {role, content} strings", "messages")
            stream = await submit([{"role": m["role"], "content": m["content"]} for m in messages], body)
        except BadRequest as e:
            return _error(e)
        return await respond(request, body, stream, chat=True)

    async def respond(request: Request, body: dict, stream, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def usage(tokens: int) -> dict:
            return {"prompt_tokens": stream.prompt_tokens, "completion_tokens": tokens,
                    "total_tokens": stream.prompt_tokens + tokens}

        if not body.get("stream"):
            pieces, tokens, reason = [], 0, None
            try:
                while True:
                    out = await stream.next()
                    pieces.append(out.text)
                    tokens += len(out.token_ids)
                    if out.finished:
                        reason = out.finish_reason
                        break
            finally:
                if reason is None:  # cancelled: the client went away
                    loop.abort(stream.id)
            text = "".join(pieces)
            choice = {"index": 0, "finish_reason": reason, "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": model_name,
                                 "choices": [choice], "usage": usage(tokens)})

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        chunk = _Chunks(rid, kind, created, model_name, chat)

        async def events():
            tokens, finished = 0, False
            try:
                if chat:
                    yield chunk(None, role=True)
                while not finished:
                    # a chunk a step (empty text included: a piece of a character, held back), or
                    # every step's output waiting since the last chunk when this stream fell behind
                    outs = await stream.next_all()
                    tokens += sum(len(o.token_ids) for o in outs)
                    finished = outs[-1].finished
                    text = "".join(o.text for o in outs)
                    yield chunk(text, outs[-1].finish_reason) if finished else chunk.text(text)
                if include_usage:
                    yield chunk.usage(usage(tokens))
                yield "data: [DONE]\n\n"
            finally:
                if not finished:  # the client went away mid-stream: free its slot
                    loop.abort(stream.id)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "mambastep"}]})

    async def health(request: Request):
        if loop.closed:
            return JSONResponse({"status": "stopped"}, status_code=503)
        if listening is not None and listening() < loop.api_processes:
            return JSONResponse({"status": "starting", "api_processes": loop.api_processes,
                                 "listening": listening()}, status_code=503)
        return JSONResponse({"status": "ok", "open_requests": loop.open_requests(), "steps": loop.steps,
                             "engine": loop.kind, "api_processes": loop.api_processes,
                             "pid": os.getpid()})  # which API process answered

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ])
