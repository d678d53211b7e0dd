"""An OpenAI request body, checked whole and read into what the engine takes: sampling
parameters, stop strings, prompts (a completion's one or several; a chat's messages, their
content a string, a list of text parts, or null for an assistant's), and how to answer
(streamed, usage, echo, log-probabilities, choices). Anything wrong is a ``BadRequest`` naming
the field; a field this server does not do yet is refused by name unless it asks for nothing
(``known_fields``)."""

from __future__ import annotations

from ...kernels.logits_processors import MAX_LOGPROBS
from ..request import SamplingParams

__all__ = ["BadRequest", "best_of", "choices", "echo", "known_fields", "messages", "only", "prompts", "sampling", "stop",
           "streaming"]

# request fields that are SamplingParams fields of the same name (OpenAI's, plus vLLM's top_k,
# ignore_eos, stop_token_ids, repetition_penalty and min_tokens)
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "max_tokens", "ignore_eos", "stop_token_ids",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
_UNBOUNDED = 1 << 30  # max_tokens where neither the request nor the server names one: the context's room


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


def sampling(body: dict, default_max_tokens: int | None, defaults: dict, chat: bool = False
             ) -> tuple[SamplingParams, bool]:
    """The request's sampling fields, over the checkpoint's generation_config.json defaults,
    over OpenAI's (temperature 1); and whether max_tokens is the server's to cap (the request
    named none: the default, or the rest of the context). ``chat``: read logprobs as the chat
    endpoint has them (``logprobs`` true and ``top_logprobs``), else as completions' (a count)."""
    kw = {"temperature": 1.0, **defaults}
    for name in _SAMPLING:
        if body.get(name) is not None:
            kw[name] = body[name]
    if body.get("logit_bias") is not None:
        kw["logit_bias"] = _logit_bias(body["logit_bias"])
    kw["logprobs"] = _chat_logprobs(body) if chat else _completion_logprobs(body)
    if body.get("max_completion_tokens") is not None:
        kw["max_tokens"] = body["max_completion_tokens"]
    cap = "max_tokens" not in kw
    if cap:
        kw["max_tokens"] = default_max_tokens or _UNBOUNDED
    if isinstance(kw.get("stop_token_ids"), (str, dict)):
        raise BadRequest(f"stop_token_ids: expected a list of token ids, got {kw['stop_token_ids']!r}", "stop_token_ids")
    try:
        return SamplingParams(**kw), cap
    except ValueError as e:
        raise BadRequest(str(e), str(e).split(":")[0]) from None


def _logit_bias(value) -> dict[int, float]:
    """OpenAI's logit_bias: a JSON object of token ids (as strings) to biases."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isdigit() for k in value):
        raise BadRequest(f"logit_bias: expected an object of token ids to biases, got {value!r}", "logit_bias")
    return {int(k): v for k, v in value.items()}


def _completion_logprobs(body: dict) -> int | None:
    n = body.get("logprobs")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise BadRequest(f"logprobs: expected null or how many alternatives (0 to 20), got {n!r}", "logprobs")
    if n is not None and body.get("echo"):
        raise BadRequest("logprobs: not with echo (the prompt's log-probabilities are not computed)", "logprobs")
    return n


def _chat_logprobs(body: dict) -> int | None:
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise BadRequest(f"logprobs: expected true or false, got {on!r}", "logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise BadRequest(f"top_logprobs: expected an int from 0 to {MAX_LOGPROBS}, got {top!r}", "top_logprobs")
    if top is not None and not on:
        raise BadRequest("top_logprobs: only with \"logprobs\": true", "top_logprobs")
    return (top or 0) if on else None


def choices(body: dict) -> int:
    """``n``: the choices of each prompt (each prompt prefilled once, ``Engine.add_choices``)."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(f"n: expected an int >= 1, got {n!r}", "n")
    return n


def best_of(body: dict, n: int) -> int:
    """``best_of``: choices drawn per prompt, of which the ``n`` with the highest cumulative
    log-probability are returned (at least n; not with ``stream``, as OpenAI has it)."""
    value = body.get("best_of")
    if value is None:
        return n
    if isinstance(value, bool) or not isinstance(value, int) or value < n:
        raise BadRequest(f"best_of: expected an int >= n ({n}), got {value!r}", "best_of")
    if value > n and body.get("stream"):
        raise BadRequest("best_of: not with \"stream\": true (the best are known only at the end)", "best_of")
    return value


def stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value) or len(value) > 4:
        raise BadRequest("stop: expected a string or up to 4 non-empty strings", "stop")
    return tuple(value)


def _token_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def prompts(body: dict) -> list:
    """A completion's prompts: one string or token-id list, or a batch of them (a list of
    strings, or of token-id lists), each answered as a choice of its own."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        return list(prompt)
    raise BadRequest("prompt: expected a string, a list of token ids, or a non-empty list of either", "prompt")


def echo(body: dict) -> bool:
    value = body.get("echo")
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"echo: expected true or false, got {value!r}", "echo")
    return bool(value)


def messages(body: dict) -> list[dict]:
    """A chat's messages as {role, content} with text content: a string, the text parts of a
    list (joined by newlines, as vLLM joins them), or null for an assistant's (a turn that only
    called tools, or refused)."""
    value = body.get("messages")
    if not (isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                       for m in value)):
        raise BadRequest("messages: expected a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(value):
        content = m.get("content")
        where = f"messages[{i}].content"
        if content is None and m["role"] == "assistant":
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"{where}[{j}]: only text parts are read ({{\"type\": \"text\", \"text\": ...}}), "
                                     f"got {kind or part!r}", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise BadRequest(f"{where}: expected a string or a list of text parts (null only for an assistant), "
                             f"got {content!r}", "messages")
        out.append({"role": m["role"], "content": content})
    return out


# the fields each endpoint reads (``model``, ``user``: a name and a caller's tag, nothing to do)
_READ = {"model", "user", "stream", "stream_options", "stop", "n", "logit_bias", "logprobs", *_SAMPLING}
_FIELDS = {"completions": _READ | {"prompt", "echo", "best_of"},
           "chat": _READ | {"messages", "max_completion_tokens", "top_logprobs"}}
# OpenAI's (and vLLM's) fields not done yet: accepted at the value that asks for nothing, else a
# 400 naming them, never silently ignored
_NOT_YET = {
    "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "functions": (None, []), "function_call": (None, "none", "auto"),
}


def known_fields(body: dict, endpoint: str) -> None:
    """Every field of the request is one this server reads, or one it does not do yet left at
    the value that asks for nothing; else a 400 naming it (as OpenAI refuses what it does not take)."""
    for name, value in body.items():
        if name in _FIELDS[endpoint]:
            continue
        if name not in _NOT_YET:
            raise BadRequest(f"{name}: unrecognized request argument", name)
        if not any(_same(value, ok) for ok in _NOT_YET[name]):
            raise BadRequest(f"{name}: not supported by this server yet (got {value!r})", name)


def only(body: dict, allowed: set, endpoint: str) -> None:
    """A 400 naming the first field of ``body`` outside ``allowed`` (a utility endpoint's)."""
    for name in body:
        if name not in allowed:
            raise BadRequest(f"{name}: unrecognized argument of {endpoint}", name)


def _same(value, ok) -> bool:
    """JSON equality, where true is not 1 nor false 0 (but 0.0 is 0)."""
    if isinstance(value, bool) or isinstance(ok, bool) or value is None or ok is None:
        return value is ok
    return value == ok


def streaming(body: dict) -> tuple[bool, bool]:
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
