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
from .engine import Engine
from .request import SamplingParams
from .tokenizer import load_tokenizer

__all__ = ["TextEngine", "TextOutput"]


@dataclass
class TextOutput:
    """What one step produced for one request: its new text and token ids, and whether it is
    done (finish_reason "stop", "length" or "abort")."""

    id: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None


@dataclass
class _Stream:
    detok: IncrementalDetokenizer
    stop: tuple[str, ...]
    prompt_tokens: int
    pending: str = ""  # text held back: it may be the start of a stop string


class TextEngine:
    def __init__(self, engine: Engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        self._streams: dict[int, _Stream] = {}


    @classmethod
    def load(cls, model: str | None = None, preset: str | None = None, **engine_kw) -> "TextEngine":
        """Over a checkpoint directory and its tokenizer, or a preset (text as bytes);
        ``engine_kw`` as ``Engine.from_pretrained`` takes them."""
        engine = Engine.from_pretrained(model, **engine_kw) if model else Engine.from_preset(preset, **engine_kw)
        return cls(engine, load_tokenizer(model, engine.cfg.vocab_size))

    def add(self, prompt: str | list[dict], params: SamplingParams | None = None, stop=()) -> int:
        """Queue a text prompt, token ids, or chat messages ([{"role", "content"}]) rendered with
        the checkpoint's chat template. ``stop``: strings that end the request, cut from its text.
        The tokenizer's EOS ids stop it too unless ``params.ignore_eos``. Raises ValueError
        (or TokenizerError) and changes nothing on bad input."""
        params = SamplingParams() if params is None else params
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop: expected non-empty strings, got {stop!r}")
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
        eos = getattr(self.tokenizer, "eos_token_ids", ())
        if eos and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=tuple(dict.fromkeys(params.stop_token_ids + eos)))
        rid = self.engine.add_request(ids, params)
        self._streams[rid] = _Stream(IncrementalDetokenizer(self.tokenizer, ids), stop, len(ids))
        return rid

    def abort(self, request_id: int) -> None:
        self.engine.abort(request_id)
        self._streams.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def prompt_tokens(self, request_id: int) -> int:
        return self._streams[request_id].prompt_tokens

    def step(self) -> list[TextOutput]:
        """One engine step; the new text of each request that got some, and which finished."""
        outputs = []
        for out in self.engine.step():
            stream = self._streams.get(out.id)
            if stream is None:  # a request added to the engine directly
                continue
            outputs.append(self._text(out.id, stream, out.new_tokens, out.finished, out.finish_reason))
        return outputs

    def generate(self, prompts, params: SamplingParams | None = None, stop=()) -> list[str]:
        """Each prompt's whole text, in order (steps the engine until they are done)."""
        ids = [self.add(p, params, stop) for p in prompts]
        texts = {i: [] for i in ids}
        while any(i in self._streams for i in ids):
            for out in self.step():
                if out.id in texts:
                    texts[out.id].append(out.text)
        return ["".join(texts[i]) for i in ids]

    def _text(self, rid: int, stream: _Stream, tokens: list[int], finished: bool, reason) -> TextOutput:
        text = stream.pending + stream.detok.push(tokens)
        if finished:
            text += stream.detok.flush()
        if stream.stop:
            text, finished, reason = self._stop(rid, stream, text, finished, reason)
        if finished:
            del self._streams[rid]
        return TextOutput(rid, text, list(tokens), finished, reason)

    def _stop(self, rid: int, stream: _Stream, text: str, finished: bool, reason):
        """Cut ``text`` at the first stop string (ending the request), or hold back a tail that
        could be the start of one."""
        cut = min((i for i in (text.find(s) for s in stream.stop) if i >= 0), default=-1)
        if cut >= 0:
            if not finished:
                self.engine.abort(rid)
            return text[:cut], True, "stop"
        if not finished:
            hold = max((k for s in stream.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text, stream.pending = text[: len(text) - hold], text[len(text) - hold :]
        return text, finished, reason
