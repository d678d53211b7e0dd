"""Speculative decoding: a request's drafts verified in one step, a rejected draft leaving no trace.

A request that speculates runs each decode step as a sequence in prefill form, a verify
sequence: its pending tokens (drawn but not yet in its slot's state: the last token drawn, and
after a verify step the drafts it accepted too), then the drafts its drafter proposes. The step
yields logits at the last pending token and at each draft. Its kernels snapshot the conv and SSM
states after the pending tokens into the request's own slot and write the state after the
drafts nowhere (``PrefillMetadata.final_slot``), so the slot only ever holds a checkpoint of
certain tokens. The drafts the step accepts are replayed from it by the next verify step, as in
ReplaySSM, through the Mamba2 recurrence alone: each Mamba2 layer recorded the drafts' in_proj
rows, and scans the kept ones before the sequence's own tokens, which are then only the last
token drawn and the new drafts (``runtime.replay``). Attention layers' keys and values at the
kept drafts' positions were written by the step that verified them; those past them are
overwritten before they are read. A step that verifies no drafts runs the pending tokens through
the whole model instead.

Acceptance: each logit row draws as the plain path draws that position (the request's seed, the
token's index in its output), and the drafts are taken while each equals the draw before it;
the first draw that differs, or the one after the last draft, is the step's last token. For a
greedy row this is the longest matching prefix. For a sampled row and a drafter that proposes
single tokens (prompt lookup, a greedy draft model: a point mass q) it is exact rejection
sampling: a draft d is kept with probability p(d), and otherwise the draw is p conditioned on
not being d, the residual (p - q)+ normalised. Either way the tokens are the ones the plain path
draws, wherever the logits are equal.

What runs where: the scheduler turns a decode request into a verify sequence
(``Scheduler._verifying``), where the gate finds that pays (``Gate``, from the step times the
engine reports), the step buffers give it ``1 + drafts`` logit rows (a verify bucket,
``graphs.Bucket``), and the engine takes the accepted tokens from the drawn ones (``accepted``)
when it reads the step, before it schedules the next: a speculating engine is not pipelined.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from .ngram_drafter import NgramDrafter

__all__ = ["Drafter", "Gate", "Speculative", "accepted", "draft_ladder"]


class Drafter(Protocol):
    """One request's drafter."""

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``context`` (the request's prompt and output so far,
        which only grows between calls)."""


@dataclass(frozen=True)
class Speculative:
    """An engine's speculative decoding.

    drafter:    a new drafter per request (default: prompt lookup, ``NgramDrafter``)
    num_drafts: k, the drafts a verify sequence carries at most (its logit rows: 1 + k)
    max_batch:  speculate only while at most this many requests decode (at larger batches the
                products are no longer memory-bound, and a verify step costs more than the
                tokens it adds); at most the buckets' ``max_prefill_seqs``
    default:    whether a request speculates when its ``SamplingParams.speculative`` is None
    adaptive:   speculate at a batch size only while it pays there, and with the number of
                drafts (1, 2, 4, ... up to ``num_drafts``) that pays best, as measured (``Gate``)
    draft_model: instead of ``drafter``, a small model of the target's vocabulary drafts its
                greedy continuation on an engine of its own (``runtime.draft_model``): an HF
                checkpoint directory or a preset name, loaded by the engine in the target's
                dtype and device (a string, so the engine's process can be given it)
    draft_seed: a preset draft model's weight seed (None: 0); refused beside a checkpoint's
    mtp:        instead of ``drafter``, the target checkpoint's own multi-token prediction layers
                draft (``runtime.mtp_drafter``; the model loaded with ``mtp=True``)
    """

    drafter: Callable[[], Drafter] = NgramDrafter
    num_drafts: int = 4
    max_batch: int = 4
    default: bool = True
    adaptive: bool = True
    draft_model: str | None = None
    draft_seed: int | None = None
    mtp: bool = False

    def __post_init__(self):
        if not (isinstance(self.num_drafts, int) and self.num_drafts >= 1):
            raise ValueError(f"num_drafts: expected an int >= 1, got {self.num_drafts!r}")
        if not (isinstance(self.max_batch, int) and self.max_batch >= 1):
            raise ValueError(f"max_batch: expected an int >= 1, got {self.max_batch!r}")
        if self.draft_model is not None and self.drafter is not NgramDrafter:
            raise ValueError("drafter and draft_model: give one of them (a draft model is its own drafter)")
        if self.mtp and (self.draft_model is not None or self.drafter is not NgramDrafter):
            raise ValueError("mtp: the MTP layers are the drafter; give no drafter or draft_model beside them")


def accepted(drafts: Sequence[int], drawn: Sequence[int]) -> int:
    """How many of ``drafts`` a verify step keeps: each while it equals the draw of the row
    before it (``drawn[i]`` is drawn where ``drafts[i]`` was proposed)."""
    n = 0
    while n < len(drafts) and drafts[n] == drawn[n]:
        n += 1
    return n


class Gate:
    """Whether speculating pays at a batch size, and with how many drafts, from what the engine's
    steps took and what their drafts yielded.

    Each choice at a batch size b is an arm: decoding, a token a row for a decode step's seconds, or
    verifying with at most k drafts a sequence (k in ``drafts``), a sequence's expected tokens for a
    verify step's seconds (``rate``). The seconds are measured per arm and batch size (a MoE's
    verify step costs more with every draft, each reading its own experts; a dense model's hardly
    more): the least of the arm's last ``window`` steps, as a step's time only ever gains from noise
    (a first replay, the host). The tokens are modelled from one acceptance rate pooled over every
    verify step of every arm and batch size, the share of the drafts tried that were kept (a draft
    is tried when those before it were kept): with rate p and m drafts offered a sequence (measured
    per arm: a drafter may offer fewer), a sequence yields 1 + p + ... + p^m tokens. Pooling is what
    makes it quick: a verify step of any arm tells every arm's yield, where one arm's own tokens a
    step vary from 1 to k + 1. The counts fade by ``decay`` each decision; beside them a prior of
    one draft kept of one tried does not. While the gate decodes, what it knew of the drafts fades
    towards that optimistic prior until a verify arm is worth another look, so a drafter that starts
    to hold is found, at a cost that falls with how long it has failed.

    Each arm is first measured ``samples`` times, most drafts first, then decoding; then the
    best is taken, and the others in turn once after ``explore`` decisions at a batch size,
    again after twice as many, and so on up to ``max_explore`` while the best arm holds (back
    to ``explore`` when it changes). It decides step shapes only: the tokens are the same either
    way.
    """

    def __init__(self, drafts: Sequence[int] = (4,), explore: int = 32, max_explore: int = 256, samples: int = 2,
                 window: int = 4, decay: float = 0.99):
        if not drafts or any(not (isinstance(k, int) and k >= 1) for k in drafts):
            raise ValueError(f"drafts: expected ints >= 1, got {drafts!r}")
        for name, v in (("explore", explore), ("max_explore", max_explore), ("samples", samples), ("window", window)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay: expected a fraction in (0, 1], got {decay!r}")
        self.drafts = tuple(sorted(set(drafts), reverse=True))
        self.explore, self.max_explore, self.samples, self.window, self.decay = (explore, max_explore, samples,
                                                                                 window, decay)
        # per (batch size, arm; 0: decoding): its last steps' seconds
        self.seconds: dict[tuple[int, int], deque[float]] = {}
        # drafts kept and tried, fading; per verify arm, the drafts a sequence was offered (a
        # moving average)
        self.kept, self.tried = 0.0, 0.0
        self.offered: dict[int, float] = {}
        # per batch size: the best arm last found, decisions since the last exploration, how many
        # the next one waits for, the arm explored last, and the arm the last decision took
        self._best: dict[int, int] = {}
        self._since: dict[int, int] = {}
        self._interval: dict[int, int] = {}
        self._explored: dict[int, int] = {}
        self._last: dict[int, int] = {}

    def choose(self, batch: int) -> int:
        """The drafts a step of ``batch`` decoding requests verifies at most a sequence, or 0:
        the step decodes."""
        self.kept, self.tried = self.decay * self.kept, self.decay * self.tried
        arm = self._choose(batch)
        self._last[batch] = arm
        return arm

    def _choose(self, batch: int) -> int:
        arms = [*self.drafts, 0]
        for arm in arms:
            if len(self.seconds.get((batch, arm), ())) < self.samples:
                return arm
        best = max(arms, key=lambda a: self.rate(batch, a))
        if self._best.get(batch) != best:
            self._best[batch], self._since[batch], self._interval[batch] = best, 0, self.explore
        self._since[batch] += 1
        if self._since[batch] < self._interval[batch]:
            return best
        self._since[batch], self._interval[batch] = 0, min(2 * self._interval[batch], self.max_explore)
        others = sorted(a for a in arms if a != best)
        after = [a for a in others if a > self._explored.get(batch, -1)]
        self._explored[batch] = (after or others)[0]
        return self._explored[batch]

    @property
    def acceptance(self) -> float:
        """The share of the drafts tried that were kept, beside a prior of one of one."""
        return (self.kept + 1) / (self.tried + 1)

    def tokens(self, arm: int) -> float:
        """A sequence's expected tokens at an arm (decoding: 1)."""
        p, m = self.acceptance, self.offered.get(arm, arm)
        return m + 1 if p >= 1 else (1 - p ** (m + 1)) / (1 - p)

    def rate(self, batch: int, arm: int) -> float:
        """A row's expected tokens a second at an arm."""
        return self.tokens(arm) / min(self.seconds[batch, arm])

    def decoded(self, batch: int, seconds: float) -> None:
        """A step of ``batch`` decode rows took ``seconds``."""
        self._time(batch, 0, seconds)

    def verified(self, batch: int, seconds: float, outcomes: Sequence[tuple[int, int]]) -> None:
        """A step of ``batch`` verify sequences took ``seconds``; ``outcomes``: each sequence's
        drafts offered and kept. It counts for the arm ``choose`` last took at that batch size
        (before any, the most drafts)."""
        arm = self._last.get(batch, self.drafts[0])
        self._time(batch, arm, seconds)
        for offered, kept in outcomes:
            if not 0 <= kept <= offered:
                raise ValueError(f"a verify outcome of {kept} drafts kept of {offered}")
            self.kept += kept
            self.tried += kept + (kept < offered)
        mean = sum(o for o, _ in outcomes) / max(1, len(outcomes))
        self.offered[arm] = mean if arm not in self.offered else 0.75 * self.offered[arm] + 0.25 * mean

    def _time(self, batch: int, arm: int, seconds: float) -> None:
        self.seconds.setdefault((batch, arm), deque(maxlen=self.window)).append(seconds)


def draft_ladder(num_drafts: int) -> tuple[int, ...]:
    """The drafts an adaptive engine tries at most a sequence: 1, 2, 4, ... below ``num_drafts``,
    and ``num_drafts``."""
    ladder, k = {num_drafts}, 1
    while k < num_drafts:
        ladder.add(k)
        k *= 2
    return tuple(sorted(ladder))
