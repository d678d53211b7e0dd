"""Text in, text out, over the token-id Engine: prompts or chat messages are encoded with the
checkpoint's tokenizer, each step's tokens are detokenized incrementally, stop strings end a
request (the text is cut before them, and text that may begin one is held back until it cannot).

    text = TextEngine(engine, Tokenizer.from_pretrained(path))
    rid = text.add("The capital of France is", SamplingParams(max_tokens=16), stop=["."])
    while text.has_unfinished():
        for out in text.step():
            print(out.text, end="", flush=True)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .detokenizer import IncrementalDetokenizer
from ..engine import Engine
from ..request import SamplingParams
from .tokenizer import load_tokenizer

__all__ = ["TextEngine", "TextOutput", "TextStreams", "text_chars"]


def text_chars(prompt) -> int:
    """The characters of a prompt's text: a string's, or chat messages' contents; 0 for token
    ids (or anything else, which ``TextStreams.encode`` refuses by name)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(m["content"]) for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))
    return 0


@dataclass
class TextOutput:
    """What one step produced for one request: its new text and token ids, and whether it is
    done (finish_reason "stop" or "length"; in the serving loops also "abort", the caller
    aborted it, or "error", the engine failed or the loop ended it)."""

    id: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list | None = None  # a TokenLogprobs per token id, where the request asked for them


@dataclass
class _Stream:
    detok: IncrementalDetokenizer
    stop: tuple[str, ...]
    prompt_tokens: int
    pending: str = ""  # text held back: it may be the start of a stop string


class TextStreams:
    """The text half of a TextEngine, apart from the engine: what a prompt encodes to, and each
    request's text as its tokens come. ``TextEngine`` keeps one beside its engine; the engine
    process's parent keeps its own (``loop.EngineProcess``), so the engine only steps."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._streams: dict[int, _Stream] = {}

    def encode(self, prompt: str | list, params: SamplingParams | None = None, stop=(),
               max_context: int | None = None, cap: bool = False) -> tuple[list[int], SamplingParams, tuple[str, ...]]:
        """(token ids, params with the tokenizer's EOS ids, stop strings) of a request, as
        ``TextEngine.add`` takes them; raises ValueError (or TokenizerError) on bad input.
        ``max_context``: prompt plus output tokens at most; a max_tokens past what the prompt
        leaves is refused, or with ``cap`` (the caller named none) cut to it."""
        params = SamplingParams() if params is None else params
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop: expected non-empty strings, got {stop!r}")
        if max_context is not None:
            self._check_length(prompt, max_context)
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            if not all({"role", "content"} <= set(m) for m in prompt):
                raise ValueError("prompt: chat messages need a role and a content")
            ids = self.tokenizer.encode_chat(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)  # token ids as they are
        else:
            raise ValueError("prompt: expected a string, token ids, or a list of {'role', 'content'} messages")
        if max_context is not None:
            room = max_context - len(ids)
            if room < 1:
                raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within the context of "
                                 f"{max_context} tokens")
            if cap:
                params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
            elif params.max_tokens > room:
                raise ValueError(f"max_tokens: {params.max_tokens} past the {room} tokens the prompt's {len(ids)} "
                                 f"leave in the context of {max_context}")
        eos = getattr(self.tokenizer, "eos_token_ids", ())
        if eos and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=tuple(dict.fromkeys(params.stop_token_ids + eos)))
        return ids, params, stop

    def _check_length(self, prompt, max_context: int) -> None:
        """Refuse, before tokenizing it, a text too long to fit the context whatever its tokens:
        more characters than max_context tokens could spell (with room for normalisers that
        merge characters, 4x)."""
        chars = text_chars(prompt)
        if chars > 4 * max_context * getattr(self.tokenizer, "max_token_chars", 1):
            raise ValueError(f"prompt: {chars} characters cannot fit in the context of {max_context} tokens")

    def open(self, rid: int, ids: list[int], stop: tuple[str, ...]) -> None:
        """Follow request ``rid``, whose prompt was ``ids``."""
        self._streams[rid] = _Stream(IncrementalDetokenizer(self.tokenizer, ids), stop, len(ids))

    def __contains__(self, rid: int) -> bool:
        return rid in self._streams

    def prompt_tokens(self, rid: int) -> int:
        return self._streams[rid].prompt_tokens

    def drop(self, rid: int) -> None:
        self._streams.pop(rid, None)

    def text(self, rid: int, tokens: list[int], finished: bool, reason, logprobs=None) -> tuple[TextOutput, bool]:
        """The text a step's tokens for ``rid`` complete, and whether a stop string ended a
        request the engine still runs (the caller aborts it there). ``logprobs``: the tokens',
        passed on as they are (a stop string cuts the text, not the tokens)."""
        stream = self._streams[rid]
        text = stream.pending + stream.detok.push(tokens)
        if finished:
            text += stream.detok.flush()
        stopped = False
        if stream.stop:
            text, stopped, reason = self._stop(stream, text, finished, reason)
        if finished or stopped:
            del self._streams[rid]
        return TextOutput(rid, text, list(tokens), finished or stopped, reason, logprobs), stopped and not finished

    @staticmethod
    def _stop(stream: _Stream, text: str, finished: bool, reason) -> tuple[str, bool, str | None]:
        """Cut ``text`` at the first stop string, or hold back a tail that could be the start of
        one; (text, whether a stop string was met, finish reason)."""
        cut = min((i for i in (text.find(s) for s in stream.stop) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], True, "stop"
        if not finished:
            hold = max((k for s in stream.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text, stream.pending = text[: len(text) - hold], text[len(text) - hold :]
        return text, False, reason


class TextEngine:
    def __init__(self, engine: Engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        self.streams = TextStreams(tokenizer)

    @classmethod
    def load(cls, model: str | None = None, preset: str | None = None, chat_template=None,
             **engine_kw) -> "TextEngine":
        """Over a checkpoint directory and its tokenizer, or a preset (text as bytes);
        ``chat_template``: a template file in place of the checkpoint's; ``engine_kw`` as
        ``Engine.from_pretrained`` takes them."""
        engine = Engine.from_pretrained(model, **engine_kw) if model else Engine.from_preset(preset, **engine_kw)
        return cls(engine, load_tokenizer(model, engine.cfg.vocab_size, chat_template))

    def add(self, prompt: str | list[dict], params: SamplingParams | None = None, stop=(), cap: bool = False) -> int:
        """Queue a text prompt, token ids, or chat messages ([{"role", "content"}]) rendered with
        the checkpoint's chat template. ``stop``: strings that end the request, cut from its text.
        The tokenizer's EOS ids stop it too unless ``params.ignore_eos``. A max_tokens past the
        room the prompt leaves in the engine's context is refused, or with ``cap`` cut to it.
        Raises ValueError (or TokenizerError) and changes nothing on bad input."""
        ids, params, stop = self.streams.encode(prompt, params, stop, self.engine.max_context, cap)
        rid = self.engine.add_request(ids, params)
        self.streams.open(rid, ids, stop)
        return rid

    def abort(self, request_id: int) -> None:
        self.engine.abort(request_id)
        self.streams.drop(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def prompt_tokens(self, request_id: int) -> int:
        return self.streams.prompt_tokens(request_id)

    def step(self) -> list[TextOutput]:
        """One engine step; the new text of each request that got some, and which finished."""
        outputs = []
        for out in self.engine.step():
            if out.id not in self.streams:  # a request added to the engine directly
                continue
            text, stopped = self.streams.text(out.id, out.new_tokens, out.finished, out.finish_reason, out.logprobs)
            if stopped:
                self.engine.abort(out.id)
            outputs.append(text)
        return outputs

    def generate(self, prompts, params: SamplingParams | None = None, stop=()) -> list[str]:
        """Each prompt's whole text, in order (steps the engine until they are done)."""
        ids = [self.add(p, params, stop) for p in prompts]
        texts = {i: [] for i in ids}
        while any(i in self.streams for i in ids):
            for out in self.step():
                if out.id in texts:
                    texts[out.id].append(out.text)
        return ["".join(texts[i]) for i in ids]
