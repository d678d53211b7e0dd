"""A request on the host: how it samples, its bookkeeping, and what a step reports about it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..kernels.logits_processors import MAX_LOGPROBS

__all__ = ["Request", "RequestOutput", "SamplingParams", "TokenLogprobs"]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request samples. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 are off
    (top-k applies first, then top-p on the renormalised rest). ``seed`` None lets the engine
    assign one from its own counter. ``stop_token_ids`` may be any iterable of ints.

    The logits processors (``kernels.logits_processors``), each off at its default:
    ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (OpenAI's), ``repetition_penalty``
    > 0 (HF's; 1 is off), ``logit_bias`` a mapping of token id to a bias in [-100, 100], and
    ``min_tokens``: the stop tokens (``stop_token_ids`` and, unless ``ignore_eos``, EOS) cannot
    be drawn before that many tokens. ``logprobs``: None, or how many alternatives (0 to 20) to
    report beside each drawn token's log-probability. ``speculative``: whether to draft and
    verify tokens on an engine that can (``runtime.speculative``; None: the engine's default;
    a request with logits processors never does); the tokens are the same either way."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    speculative: bool | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_real(v) and -2 <= v <= 2):
                raise ValueError(f"{name}: expected a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not (_is_real(r) and math.isfinite(r) and r > 0):
            raise ValueError(f"repetition_penalty: expected a finite number > 0 (1 = off), got {r!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens: expected an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        n = self.logprobs
        if n is not None and not (_is_int(n) and 0 <= n <= MAX_LOGPROBS):
            raise ValueError(f"logprobs: expected None or an int in [0, {MAX_LOGPROBS}], got {n!r}")
        if self.speculative is not None and not isinstance(self.speculative, (bool, np.bool_)):
            raise ValueError(f"speculative: expected None or a bool, got {self.speculative!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def processed(self) -> bool:
        """Whether any logits processor is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """A mapping (or pairs) of token id to bias, as sorted (id, bias) pairs of plain numbers."""
    try:
        pairs = list(value.items() if hasattr(value, "items") else value)
        pairs = [(t, b) for t, b in pairs]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias: expected a mapping of token id to bias, got {value!r}") from None
    for t, b in pairs:
        if not (_is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100):
            raise ValueError(f"logit_bias: expected token ids >= 0 mapped to biases in [-100, 100], got {t!r}: {b!r}")
    if len({t for t, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias: a token id appears twice")
    return tuple(sorted((int(t), float(b)) for t, b in pairs))


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
    # the bias entries (ids, values, until) [MAX_BIASED] each, when params.processed
    bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # a prefix request (``Engine.add_choices``): the choices that continue from its state; it
    # prefills all but their prompt's last token and draws nothing
    choices: list["Request"] | None = None
    # with a prefix cache: the block boundaries its prefill snapshots at (``prefix_cache.Boundary``), in order
    snapshot_at: list = field(default_factory=list)
    # speculating (``runtime.speculative``): its drafter, and while a step runs it in prefill
    # form, the drafts that step verifies (None otherwise)
    drafter: object | None = None
    verify: list[int] | None = None

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
    logprobs: list["TokenLogprobs"] | None = None  # one per new token, when params.logprobs is set


@dataclass
class TokenLogprobs:
    """A drawn token's log-probability and the ``params.logprobs`` most likely tokens' (id,
    log-probability), highest first (``kernels.logits_processors.logprobs``)."""

    logprob: float
    top: list[tuple[int, float]]
