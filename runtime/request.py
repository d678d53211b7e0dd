"""A request's bookkeeping on the host, and what a step reports about it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sampling import SamplingParams

__all__ = ["Request", "RequestOutput"]


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
