"""Continuous batching: every running decode each step, plus prompt chunks under a token budget.

FCFS: prompts already being prefilled continue first (chunked prefill carries a long prompt over
several steps, its state kept in its slot), then waiting requests are admitted while a state slot
is free. A full engine queues; it never fails a request for lack of slots.

A prompt of several choices is prefilled once by a prefix request (all but its last token),
which draws nothing. It is admitted only when a slot is free for every choice, and reserves
them (two prefixes each holding a slot while waiting for more could wait for ever). Once its
last chunk is scheduled it forks: its slot becomes the first choice's, and ``forks`` names the
copies of its state into the others' reserved slots, which the engine makes before the next
step. Each choice then runs the prompt's last token as a chunk of its own and draws with its
own seed.

With a prefix cache (``runtime.prefix_cache``), an admitted prompt starts from the longest
cached prefix (``restores``: copies the engine makes before the step), and the cache names the
boundaries its prefill snapshots at: the step's kernels write the conv and SSM states there into
the snapshot's slot (the plan's ``snapshot_slots``), and the engine copies the keys and values
after the step (``snapshots``). A chunk holds one such boundary at most. A prompt of several
choices prefills whole.

With speculative decoding (``runtime.speculative``), decode requests may run as verify
sequences in prefill form, first in the step: their pending tokens and their drafts
(``_verifying``, ``_verify_sequence``); their rows feed the next step through the host. In a
step that verifies drafts, a sequence's pending tokens but the last (the drafts the step before
kept) are replayed from the record by the Mamba2 layers alone (``_replayed``); a step without
drafts runs them through the model, as a prompt's chunk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ..kernels.logits_processors import MAX_BIASED
from ..kernels.varlen import PAD_SLOT_ID
from .plan import StepPlan
from .prefix_cache import PrefixCache
from .request import Request
from .speculative import Gate, Speculative, draft_ladder

__all__ = ["Scheduler"]


class Scheduler:
    def __init__(self, num_slots: int, token_budget: int, max_prefill_seqs: int, max_decode: int,
                 prefix_cache: PrefixCache | None = None, speculative: Speculative | None = None,
                 max_context: int = 1 << 62):
        self.token_budget, self.max_prefill_seqs, self.max_decode = token_budget, max_prefill_seqs, max_decode
        self.speculative, self.max_context = speculative, max_context
        # where speculating pays, from the steps' times the engine reports (``Gate``)
        self.gate = (Gate(draft_ladder(speculative.num_drafts)) if speculative is not None and speculative.adaptive
                     else None)
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.cache = prefix_cache
        # (snapshot slot, request, tokens) to restore before the last schedule()'s step, and
        # (request slot, snapshot slot, tokens) to snapshot after it
        self.restores: list[tuple[int, Request, int]] = []
        self.snapshots: list[tuple[int, int, int]] = []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # (source slot, destination slots, tokens) of the prefix requests forked by the last
        # schedule(): the engine copies them before launching its step
        self.forks: list[tuple[int, list[int], int]] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def release(self, req: Request) -> None:
        """Give a finished or aborted request's slot back (a choice not forked yet: its place)."""
        for prefix in self.running + list(self.waiting):
            if prefix.choices and req in prefix.choices:
                prefix.choices.remove(req)
                if req.slot >= 0:  # its reserved slot
                    self.free_slots.append(req.slot)
                if not prefix.choices:
                    self.release(prefix)
                return
        if req in self.running:
            self.running.remove(req)
            self.free_slots.append(req.slot)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[StepPlan, list[Request | None]]:
        """The next step's plan and, per logit row, the request whose token it draws (None for a
        prompt chunk that does not end its prompt). Advances each request's ``computed`` and
        ``drawn``; forks the prefix requests that are ready (``forks``); with a prefix cache,
        names the copies around the step (``restores`` before it, ``snapshots`` after)."""
        self.forks = [self._fork(r) for r in list(self.running) if r.choices and r.prompt_done]
        self.restores, self.snapshots = [], []
        if self.cache is not None:  # the last plan's step, which writes its snapshots, was launched
            self.cache.settle()
        decodes = [r for r in self.running if r.prompt_done and not r.finished and not r.choices][: self.max_decode]
        verify = self._verifying(decodes)
        # the rest decode a token each; one with more pending that found no room waits a step
        decodes = [r for r in decodes if r.verify is None and _pending(r) <= 1]
        budget = self.token_budget
        seqs = []
        for r in verify:
            q = self._verify_sequence(r, budget)
            if q is not None:
                seqs.append(q)
                budget -= len(q.tokens)
        if any(q.drafts for q in seqs):  # a verify step: its Mamba2 layers replay the kept drafts
            for q in seqs:
                budget += _replayed(q)
        chunks: list[tuple[Request, int]] = []
        for r in self.running:
            if not r.prompt_done and budget > 0 and len(seqs) + len(chunks) < self.max_prefill_seqs:
                n = self._chunk(r, budget)
                chunks.append((r, n))
                budget -= n
        while (self.waiting and self.free_slots and budget > 0
               and len(seqs) + len(chunks) < self.max_prefill_seqs):
            if len(self.free_slots) < len(self.waiting[0].choices or [None]):
                break  # FCFS: a prefix waits for a slot per choice, and those behind it wait too
            r = self.waiting.popleft()
            r.slot = self.free_slots.pop()
            for c in (r.choices or [])[1:]:
                c.slot = self.free_slots.pop()
            self.running.append(r)
            if self._cached(r):
                admission = self.cache.admit(r.prompt)
                if admission.restore is not None:
                    slot, r.computed = admission.restore
                    self.restores.append((slot, r, r.computed))
                r.snapshot_at = list(admission.snapshot_at)
            n = self._chunk(r, budget)
            chunks.append((r, n))
            budget -= n
        for r, n in chunks:
            q = _Sequence(r, r.prompt[r.computed : r.computed + n], r.computed,
                          draws=r.computed + n >= len(r.prompt) and not r.choices)
            if r.snapshot_at and r.snapshot_at[0].end <= r.computed + n:
                at = r.snapshot_at.pop(0)
                snapshot = self.cache.claim(r.prompt, at)
                if snapshot is not None:
                    self.snapshots.append((r.slot, snapshot, at.end))
                    q.snapshot = (snapshot, at.end - r.computed)
            r.computed += n
            seqs.append(q)
        return self._plan(seqs, decodes)

    def _verifying(self, decodes: list[Request]) -> list[Request]:
        """The decode requests the step runs in prefill form, their ``verify`` set. Every one,
        each that speculates with the drafts its drafter proposes and the others with none (a
        decode in prefill form, beside them in the step), where there are at most ``max_batch``
        (and room in the step's sequences), none has logits processors (whose counts a verify
        step does not keep), the gate finds verifying pays at that batch size (and with how
        many drafts; without a gate ``num_drafts``), and one of them drafts anything. Else
        those with more than one token pending (a verify step's accepted drafts), which catch
        up without drafts, while the rest decode as usual."""
        spec = self.speculative
        if (spec is not None and 0 < len(decodes) <= min(spec.max_batch, self.max_prefill_seqs)
                and any(r.drafter is not None for r in decodes)
                and not any(r.params.processed for r in decodes)):
            k = spec.num_drafts if self.gate is None else self.gate.choose(len(decodes))
            for r in decodes if k else ():
                r.verify = self._drafts(r, k) if r.drafter is not None else []
            if any(r.verify for r in decodes):
                return decodes
            for r in decodes:
                r.verify = None
        verify = [r for r in decodes if _pending(r) > 1][: self.max_prefill_seqs]
        for r in verify:
            r.verify = []
        return verify

    def _drafts(self, r: Request, k: int) -> list[int]:
        """Up to ``k`` drafts from ``r``'s drafter, as many as its remaining tokens and its
        context allow."""
        known = len(r.prompt) + len(r.output)
        k = min(k, r.params.max_tokens - len(r.output) - 1, self.max_context - known)
        if k <= 0:
            return []
        context = np.concatenate([r.prompt, np.asarray(r.output, dtype=np.int64)])
        return [int(t) for t in r.drafter.draft(context, k)[:k]]

    def _verify_sequence(self, r: Request, budget: int) -> "_Sequence | None":
        """``r``'s pending tokens and its drafts (as many as the step's ``budget`` leaves room
        for); the state after the pending tokens is snapshotted into its own slot and the one
        after the drafts dropped (``runtime.speculative``). None where the budget has no room
        (it waits a step)."""
        pending = np.asarray(r.output[r.computed - len(r.prompt) :], dtype=np.int64)
        if len(pending) > budget:
            r.verify = None
            return None
        r.verify = r.verify[: budget - len(pending)]
        q = _Sequence(r, np.concatenate([pending, np.asarray(r.verify, dtype=np.int64)]), r.computed, draws=True,
                      drafts=len(r.verify))
        if r.verify:
            q.snapshot, q.final = (r.slot, len(pending)), PAD_SLOT_ID
        r.computed += len(pending)
        return q

    def _cached(self, r: Request) -> bool:
        return self.cache is not None and not r.choices

    def _chunk(self, r: Request, budget: int) -> int:
        """The tokens of ``r``'s prompt the step prefills: what the budget allows, with one
        boundary to snapshot at, at most (the step's kernels take it inside the chunk; where a
        second boundary falls inside too, the chunk ends at the first)."""
        n = min(len(r.prompt) - r.computed, budget)
        inside = [b for b in r.snapshot_at if b.end < r.computed + n]
        if len(inside) > 1:
            n = inside[0].end - r.computed
        return n

    def _fork(self, prefix: Request) -> tuple[int, list[int], int]:
        """Hand ``prefix``'s slot to its first choice (the others hold theirs); the copy."""
        self.running.remove(prefix)
        first, *others = prefix.choices
        if first.slot >= 0:  # the first choice was aborted: this one's reserved slot goes back
            self.free_slots.append(first.slot)
        first.slot = prefix.slot
        for r in prefix.choices:
            r.computed = prefix.computed
            self.running.append(r)
        prefix.choices = None
        return prefix.slot, [r.slot for r in others], prefix.computed

    def _plan(self, seqs: list["_Sequence"], decodes: list[Request]) -> tuple[StepPlan, list[Request | None]]:
        rows: list[Request | None] = []
        for q in seqs:
            rows += [q.req if q.draws else None] * (1 + q.drafts)
        dec_ctx, dec_tokens = [], []
        for r in decodes:
            dec_ctx.append(r.computed)
            # a speculating request's input is on the host (a verify step's rows feed no slot's
            # next input); otherwise the token the previous step drew, already on the device
            dec_tokens.append(r.output[r.computed - len(r.prompt)] if r.drafter is not None else -1)
            r.computed += 1
            rows.append(r)
        i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
        params = [r.params if r is not None else None for r in rows]
        # a draw's position counts the draws scheduled before it, not the tokens collected: in
        # pipelined mode the previous step's token is still on its way (a verify step's rows
        # draw the positions after it; the engine sets ``drawn`` from what it accepted)
        positions = []
        for r in rows:
            positions.append(r.drawn if r is not None else 0)
            if r is not None:
                r.drawn += 1
        verifying = any(q.drafts for q in seqs)
        plan = StepPlan(
            prefill_tokens=np.concatenate([q.tokens for q in seqs]) if seqs else np.zeros(0, np.int64),
            prefill_lens=i32([len(q.tokens) for q in seqs]),
            prefill_slots=i32([q.req.slot for q in seqs]),
            prefill_context=i32([q.context for q in seqs]),
            snapshot_slots=i32([q.snapshot[0] if q.snapshot else -1 for q in seqs]
                               if any(q.snapshot for q in seqs) else []),
            snapshot_tokens=i32([q.snapshot[1] if q.snapshot else 0 for q in seqs]
                                if any(q.snapshot for q in seqs) else []),
            final_slots=i32([q.req.slot if q.final is None else q.final for q in seqs] if verifying else []),
            prefill_logits=i32([1 + q.drafts for q in seqs] if verifying else []),
            replay_lens=i32([q.replay for q in seqs] if verifying else []),
            decode_tokens=np.asarray(dec_tokens, dtype=np.int64),
            decode_slots=i32([r.slot for r in decodes]),
            decode_context=i32(dec_ctx),
            temperature=np.array([p.temperature if p else 0.0 for p in params], dtype=np.float32),
            top_k=i32([p.top_k if p else 0 for p in params]),
            top_p=np.array([p.top_p if p else 1.0 for p in params], dtype=np.float32),
            seed=np.array([r.seed if r else 0 for r in rows], dtype=np.int64),
            position=np.array(positions, dtype=np.int64),
            # a verify sequence's tokens reach the next step through the host; one without drafts
            # draws its slot's next input, as a decode row does
            sample_slots=i32([-1 if r is None or r.verify else r.slot for r in rows]),
            logprobs=any(p is not None and p.logprobs is not None for p in params),
        )
        if any(q.req.params.processed for q in seqs) or any(r.params.processed for r in decodes):
            _processors(plan, [q.req for q in seqs], rows)
        return plan, rows


def _replayed(q: "_Sequence") -> int:
    """Make verify sequence ``q`` of a verify step replay its pending tokens but the last (the
    drafts the step before kept, whose in_proj rows its Mamba2 layers recorded) from the record,
    and run only its last pending token and its drafts through the model (``runtime.replay``);
    the tokens it no longer runs."""
    n = len(q.tokens) - q.drafts - 1
    q.tokens, q.context, q.replay = q.tokens[n:], q.context + n, n
    if q.snapshot is not None:  # its checkpoint: after the last pending token
        q.snapshot = (q.snapshot[0], 1)
    return n


def _pending(r: Request) -> int:
    """Tokens ``r`` drew that its slot's state has not taken in (pipelined: 0 while the last
    step's draw is on its way)."""
    return len(r.prompt) + len(r.output) - r.computed


@dataclass
class _Sequence:
    """A sequence of the step in prefill form: a prompt's chunk, or a decode request's pending
    tokens and ``drafts`` drafts after them (a verify sequence). ``draws``: whether its logit
    rows draw for the request; ``snapshot``: (slot, its tokens before the snapshot), or None;
    ``final``: where its state after the last token goes (None: its own slot); ``replay``: the
    rows its Mamba2 layers replay from its slot's record before ``tokens`` (``_replayed``)."""

    req: Request
    tokens: np.ndarray
    context: int
    draws: bool
    drafts: int = 0
    snapshot: tuple[int, int] | None = None
    final: int | None = None
    replay: int = 0


def _processors(plan: StepPlan, chunked: list[Request], rows: list[Request | None]) -> None:
    """Fill ``plan``'s processor fields: each row's penalties (neutral for a prompt chunk that
    does not end its prompt), each prefill sequence's bias entries (zeros: none)."""
    params = [r.params if r is not None else None for r in rows]
    f32 = lambda v: np.asarray(v, dtype=np.float32)  # noqa: E731
    plan.presence = f32([p.presence_penalty if p else 0.0 for p in params])
    plan.frequency = f32([p.frequency_penalty if p else 0.0 for p in params])
    plan.repetition = f32([p.repetition_penalty if p else 1.0 for p in params])
    plan.processor_slots = np.asarray([r.slot if r is not None and r.params.processed else -1 for r in rows], np.int32)
    n = len(chunked)
    plan.bias_ids = np.zeros((n, MAX_BIASED), np.int32)
    plan.bias_values = np.zeros((n, MAX_BIASED), np.float32)
    plan.bias_until = np.zeros((n, MAX_BIASED), np.int32)
    for i, r in enumerate(chunked):
        if r.bias is not None:
            plan.bias_ids[i], plan.bias_values[i], plan.bias_until[i] = r.bias
