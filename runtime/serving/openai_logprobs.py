"""Log-probabilities in OpenAI's two shapes, from the engine's ``TokenLogprobs``.

    completions  {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
                  "text_offset": [int]}: each top dict holds the ``logprobs`` most likely tokens
                  and the drawn one (up to logprobs + 1 entries, as OpenAI documents)
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                  "bytes"}]}], "refusal": null}

A token's string is its id decoded alone, special tokens kept; ``bytes`` its UTF-8 bytes. A
token a processor banned has log-probability -inf, which JSON cannot write: it is written as
-9999.0, as vLLM writes it. A text offset counts the characters of the token strings before it,
from the start of the completion (a stream carries it on from chunk to chunk).
"""

from __future__ import annotations

import functools
import math

__all__ = ["LogprobFormat"]

_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


class LogprobFormat:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.token = functools.lru_cache(maxsize=1 << 16)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, token_ids: list[int], logprobs: list, offset: int = 0) -> tuple[dict, int]:
        """The completions shape of these tokens, their text starting at ``offset``; and the
        offset after them."""
        tokens, values, tops, offsets = [], [], [], []
        for token_id, lp in zip(token_ids, logprobs):
            text = self.token(token_id)
            tokens.append(text)
            values.append(_value(lp.logprob))
            top = {self.token(t): _value(v) for t, v in lp.top}
            top.setdefault(text, _value(lp.logprob))
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset

    def chat(self, token_ids: list[int], logprobs: list) -> dict:
        """The chat shape of these tokens."""
        return {"content": [{**self._entry(token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                            for token_id, lp in zip(token_ids, logprobs)],
                "refusal": None}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}
