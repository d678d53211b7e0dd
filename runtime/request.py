"""A request on the host: how it samples, its bookkeeping, and what a step reports about it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Request", "RequestOutput", "SamplingParams"]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request samples. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 are off
    (top-k applies first, then top-p on the renormalised rest). ``seed`` None lets the engine
    assign one from its own counter. ``stop_token_ids`` may be any iterable of ints."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        t = self.temperature
        if not (_is_real(t) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature: expected a finite number >= 0, got {t!r}")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k: expected an int >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not (_is_real(p) and 0 < p <= 1):
            raise ValueError(f"top_p: expected a number in (0, 1], got {p!r}")
        if self.seed is not None and not (_is_int(self.seed) and _INT64_MIN <= self.seed <= _INT64_MAX):
            raise ValueError(f"seed: expected None or an int that fits in int64, got {self.seed!r}")
        if not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        try:
            stops = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(f"stop_token_ids: expected an iterable of ints, got {self.stop_token_ids!r}") from None
        if not all(_is_int(s) and s >= 0 for s in stops):
            raise ValueError(f"stop_token_ids: expected token ids >= 0, got {stops!r}")
        # frozen: normalise lists to a hashable tuple of plain ints
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in stops))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise ValueError(f"ignore_eos: expected a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


# identity equality: the scheduler finds a request in its queues by the object, never by
# comparing fields (a prompt is a numpy array)
@dataclass(eq=False)
class Request:
    id: int
    prompt: np.ndarray  # [L] int64
    params: SamplingParams
    seed: int
    slot: int = -1
    computed: int = 0  # tokens already in the slot (prompt chunks and decoded tokens)
    drawn: int = 0  # draws scheduled so far: the next one's position (ahead of output when pipelined)
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def prompt_done(self) -> bool:
        return self.computed >= len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What one step produced for one request: its new tokens, and whether it is done
    (finish_reason "stop", "length" or "abort")."""

    id: int
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None = None
