"""Draft tokens by prompt lookup, for speculative decoding (issue 58): no weights, strong where
the output repeats its context (code edits, retrieval, summaries).

The draft for a request is what followed the latest earlier occurrence of its context's suffix:
the longest suffix of ``max_n`` down to ``min_n`` tokens that occurred before, and up to ``k``
tokens after that occurrence. An index from each n-gram to where its latest continued
occurrence ends is kept as tokens arrive, so a draft costs ``max_n - min_n + 1`` lookups and a
token costs as many updates, whatever the context's length.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NgramDrafter"]


class NgramDrafter:
    """One request's drafter: ``extend`` with every token as it arrives (the prompt first), then
    ``propose(k)``; or ``draft(context, k)``, which extends with what the context adds."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramDrafter: expected 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> the position after its latest occurrence that a token followed
        self._after: dict[tuple[int, ...], int] = {}

    def extend(self, tokens) -> None:
        """Append ``tokens`` (ints) to the context."""
        for t in np.asarray(tokens, dtype=np.int64).ravel().tolist():
            # the n-grams ending just before t now have a continuation: t, at len(self.tokens)
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._after[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(t)

    def draft(self, context, k: int) -> list[int]:
        """``propose(k)`` after extending with the tokens ``context`` holds beyond those seen
        (``runtime.speculative.Drafter``)."""
        self.extend(context[len(self.tokens) :])
        return self.propose(k)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens (none where no suffix of ``min_n`` or more tokens occurred
        before); the longest matching suffix wins, its latest occurrence among equals."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self._after.get(tuple(self.tokens[end - n :]))
            if start is not None:
                return self.tokens[start : start + k]
        return []
