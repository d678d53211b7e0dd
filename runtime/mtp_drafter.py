"""Drafting with the checkpoint's own MTP layers (``Speculative(mtp=True)``, ``runtime.mtp``).

The MTP's position i needs the target's hidden state at i and token i + 1, so it follows the
target one step behind. After every target step (its tokens collected), ``MTPDrafting.follow``
takes each speculating request's positions that the step made certain (a prompt chunk's, a
decode row's, a verify sequence's pending tokens and accepted drafts: every position before the
last token drawn, whose hidden state comes with the next step) into one MTP step, prefill rows
fed from the target runner's ``hidden`` (``StepRunner(keep_hidden=True)``). The last row of a
request that now decodes drafts its first token. The rest of its drafts chain when the scheduler
first asks for them (``MTPDrafter.draft``): k - 1 MTP decode steps for every such request at
once, each row fed the token drafted before it and that row's h', all on the device, read back
once. Those steps write the MTP's keys and values past the certain positions, which the next
``follow`` overwrites.

With a prefix cache, a snapshot of a request's first T positions (``snapshot``, after
``follow``) keeps the MTP's keys and values of its first T - 1 and the target's hidden state at
T - 1 (the MTP's position T - 1 also reads token T, which a prompt restoring the snapshot may
have otherwise); a restore (``restore``) copies them back, and the request's first catch-up
starts at T - 1 from that hidden state. A prompt of several choices is followed through its
prefix request (as the full prompt, whose last token the choices hold), and ``fork`` copies the
MTP's keys and values into the choices' slots beside the target's state. A request whose
positions the MTP did not see (a snapshot it holds nothing of) drafts nothing and decodes as
usual. The MTP runs on a pool and a runner of its own, captured in buckets of the target's sizes
where the engine captures (a larger catch-up runs eagerly).
"""

from __future__ import annotations

import numpy as np
import torch

from ..graphs import Bucket, BucketSet
from .model import Model
from .mtp import MTPModel
from .plan import StepPlan
from .request import Request
from .state_pool import StatePool
from .step_runner import StepRunner, on_device

__all__ = ["MTPDrafter", "MTPDrafting"]


class MTPDrafter:
    """One request's drafter over the engine's ``MTPDrafting``: where its MTP state stands."""

    def __init__(self, drafting: "MTPDrafting"):
        self.drafting = drafting
        self.slot = -1
        self.consumed = 0  # the positions whose keys and values the MTP holds for the request
        self.lost = False  # the target ran positions the MTP never saw: it drafts nothing
        self.stashed = 0  # positions after ``consumed`` whose hidden states wait in the stash
        # a snapshot slot whose kept hidden state is the target's at position ``consumed`` (a
        # restored prompt's first catch-up starts there), or None
        self.carry: int | None = None
        self.known = -1  # the context length ``drafts`` follow (-1: none yet)
        self.drafts: list[int] = []

    def draft(self, context, k: int) -> list[int]:
        return self.drafting.drafts(self, len(context))[:k]


class MTPDrafting:
    def __init__(self, target: Model, target_runner: StepRunner, num_slots: int, max_context: int, num_drafts: int,
                 max_batch: int, snapshot_slots: int = 0, graphs: bool = False, stash: int = 64):
        """target: a model loaded with its MTP layers (``mtp=True``); target_runner: its runner,
        keeping its steps' hidden states; num_slots: the requests' slots, and snapshot_slots a
        prefix cache's beyond them; num_drafts: k; max_batch: the most decoding requests a step
        verifies (``Speculative.max_batch``); graphs: capture the MTP's steps, in buckets of the
        target's sizes (else they run eagerly); stash: the positions a request's hidden states
        may wait while more requests decode than verify (``follow``)."""
        if target_runner.hidden is None:
            raise ValueError("MTP drafting reads the target's hidden states: its runner needs keep_hidden=True")
        buffers = target_runner.buffers
        max_tokens = buffers.max_prefill_tokens + buffers.max_decode  # a step's every row, as prefill rows
        self.model = MTPModel(target, target.mtp_weights, num_slots=num_slots, max_tokens=max_tokens)
        self.pool = StatePool(self.model.cfg, num_slots + snapshot_slots, max_context, dtype=target.dtype,
                              device=target.device)
        # catch-ups in prefill form, a sequence a request, as many tokens as a target step's
        # certain positions; chained drafts in decode rows
        sizes = target_runner.buckets
        buckets = BucketSet(decode=tuple(sorted({b for b in sizes.decode if b < num_slots} | {num_slots})),
                            mixed_decode=(0,), prefill=tuple(sorted(set(sizes.verify) | set(sizes.prefill))),
                            max_prefill_seqs=num_slots)
        self.runner = StepRunner(self.model, self.pool, buckets, max_decode=num_slots, max_prefill_tokens=max_tokens,
                                 overlap=False, greedy_only=True)
        if graphs:
            self.runner.capture(progress=False)
        self.target_hidden = target_runner.hidden
        self.num_drafts, self.max_context, self.max_batch, self.stash = num_drafts, max_context, max_batch, stash
        self._stash = torch.zeros(num_slots * stash, target.cfg.hidden_size, dtype=target.dtype, device=target.device)
        # [k, slots]: what each chained step drew for the requests that draft, read back at once
        self._drawn = torch.zeros(num_drafts, num_slots, dtype=torch.int64, device=target.device)
        self._ready: list[MTPDrafter] = []  # the drafters whose first draft the last follow drew
        # per snapshot slot: the MTP's positions it holds (keys and values) and, in ``_boundary``,
        # the target's hidden state at the next one
        self._held: dict[int, int] = {}
        self._boundary = torch.zeros(num_slots + snapshot_slots, target.cfg.hidden_size, dtype=target.dtype,
                                     device=target.device)
        self._rows: dict[int, tuple[int, int]] = {}  # slot -> (first position, its packed row) of the last follow
        self._prefixes: dict[int, int] = {}  # a prefix request's slot -> the positions the MTP holds of it

    def follow(self, plan: StepPlan, bucket: Bucket, by_slot: dict[int, Request]) -> None:
        """After the target ran ``plan`` in ``bucket`` and its tokens were collected: take each
        speculating request's newly certain positions in (``by_slot``: the running requests).
        While more requests decode than may verify (``max_batch``), a decoding request's new
        positions wait in the stash instead (their hidden states copied, no MTP step), at most
        ``stash`` of them: past that it drafts nothing more. A prompt's positions that run then
        are not taken in at all: the request drafts nothing (its catch-up, an MTP prefill that
        reads most of the experts of a MoE layer, cost 2.4% of the output tokens/s at
        concurrency 64 where no request verifies; docs/experiments.md)."""
        starts = np.concatenate([[0], np.cumsum(plan.prefill_lens)])
        # (slot, its first position, positions, its first packed row of the target step)
        pieces = [(int(s), int(c), int(n), int(row)) for s, c, n, row in
                  zip(plan.prefill_slots, plan.prefill_context, plan.prefill_lens, starts)]
        pieces += [(int(s), int(c), 1, bucket.prefill + b) for b, (s, c) in
                   enumerate(zip(plan.decode_slots, plan.decode_context))]
        wide = sum(r.prompt_done and r.choices is None for r in by_slot.values()) > self.max_batch
        seqs, self._ready = [], []
        # (row of the destination, row of the source) per source: the target's packed rows, the
        # snapshots' kept hidden states, the stash; into hidden_in, or (stashed) into the stash
        into_mtp = {"target": [], "boundary": [], "stash": []}
        into_stash = []
        self._rows = {slot: (first, row) for slot, first, _, row in pieces}
        for slot, first, n, row in pieces:
            req = by_slot.get(slot)
            d = None if req is None else req.drafter
            if not isinstance(d, MTPDrafter) or d.lost or req.finished:
                continue
            have = d.consumed + d.stashed  # positions whose hidden states the MTP has or holds
            carry = d.carry is not None and first == d.consumed + 1
            if first > have and not carry:  # its prompt's prefix ran without it
                d.lost = True
                continue
            # a prefix request's positions read its choices' prompt, whose last token it lacks
            prompt = req.prompt if req.choices is None else req.choices[0].prompt
            known = len(prompt) + len(req.output)
            new, end = max(have, first), min(first + n, known - 1)
            if new >= end:
                continue
            if wide and new < len(req.prompt):  # a prompt's positions while none may verify
                d.lost = True
                continue
            d.slot, d.known = slot, -1
            if wide and d.carry is None:  # decode positions: stashed
                if d.stashed + end - new > self.stash:
                    d.lost = True
                    continue
                into_stash += [(slot * self.stash + d.stashed + i, row + p - first)
                               for i, p in enumerate(range(new, end))]
                d.stashed += end - new
                continue
            at = sum(len(t) for t, _, _ in seqs)  # this sequence's first row in hidden_in
            seqs.append((_span(prompt, req.output, d.consumed + 1, end + 1), slot, d.consumed))
            if carry:
                into_mtp["boundary"].append((at, d.carry))
            into_mtp["stash"] += [(at + i, slot * self.stash + i) for i in range(d.stashed)]
            at += carry + d.stashed
            into_mtp["target"] += [(at + i, row + p - first) for i, p in enumerate(range(new, end))]
            d.consumed, d.stashed, d.carry = end, 0, None
            if req.choices is not None:
                self._prefixes[slot] = end
            elif req.prompt_done and end == known - 1:
                self._ready.append(d)
        with torch.inference_mode():
            sources = {"target": self.target_hidden, "boundary": self._boundary, "stash": self._stash}
            for name, pairs in into_mtp.items():
                _gather(self.model.hidden_in, pairs, sources[name])
            _gather(self._stash, into_stash, self.target_hidden)
            if seqs:
                self.runner.launch(_greedy(StepPlan.make(prefill=seqs)))
                self._keep(0, self._slots(self._ready))

    def fork(self, src: int, dsts: list[int], tokens: int, choices: list[Request]) -> None:
        """A prompt's prefix request in ``src`` forked into its choices (``Engine.add_choices``),
        its first ``tokens`` positions copied into ``dsts``: the MTP's go with them, where it
        holds them all (else the choices draft nothing)."""
        if self._prefixes.pop(src, None) != tokens:
            return
        with torch.inference_mode():
            self.pool.copy_slot(src, dsts, tokens, recurrent=False)
        for r in choices:
            if isinstance(r.drafter, MTPDrafter):
                r.drafter.consumed = tokens

    def snapshot(self, slot: int, snapshot: int, tokens: int, req: Request | None) -> None:
        """After ``follow``: the prefix cache snapshotted ``slot``'s first ``tokens`` positions in
        ``snapshot``. The MTP keeps its keys and values of the first ``tokens`` - 1 there, and the
        target's hidden state at the last, where it holds them (else the snapshot holds nothing
        of the MTP's)."""
        d = None if req is None else req.drafter
        first, row = self._rows.get(slot, (tokens, -1))
        if not isinstance(d, MTPDrafter) or d.lost or d.consumed < tokens - 1 or first >= tokens:
            self._held.pop(snapshot, None)
            return
        with torch.inference_mode():
            self.pool.copy_slot(slot, [snapshot], tokens - 1, recurrent=False)
            self._boundary[snapshot].copy_(self.target_hidden[row + tokens - 1 - first])
        self._held[snapshot] = tokens - 1

    def restore(self, snapshot: int, req: Request, tokens: int) -> None:
        """Before the step that goes on from a restored snapshot: ``req`` starts from the MTP's
        keys and values there, and its first catch-up from the kept hidden state (a snapshot
        the MTP holds nothing of leaves it drafting nothing)."""
        d = req.drafter
        if not isinstance(d, MTPDrafter):
            return
        if self._held.get(snapshot) != tokens - 1:
            d.lost = True
            return
        with torch.inference_mode():
            self.pool.copy_slot(snapshot, [req.slot], tokens - 1, recurrent=False)
        d.consumed, d.carry = tokens - 1, snapshot

    def drafts(self, d: MTPDrafter, known: int) -> list[int]:
        """``d``'s drafts after a context of ``known`` tokens; the chain runs for every ready
        drafter on the first ask after a ``follow``."""
        if d.lost or d.consumed != known - 1:
            return []
        if d.known != known and d in self._ready:
            self._chain()
        return d.drafts if d.known == known else []

    def _chain(self) -> None:
        ready, self._ready = self._ready, []
        # each chained row writes the MTP's position consumed + j - 1: within its pool
        k = min(self.num_drafts, self.max_context - max(d.consumed for d in ready))
        with torch.inference_mode():
            slots = self._slots(ready)  # on the device once for the chain
            for j in range(1, k):
                self.runner.launch(_greedy(StepPlan.make(decode=[(-1, d.slot, d.consumed + j - 1) for d in ready])))
                self._keep(j, slots)
            drawn = self._drawn[:k].cpu().numpy()  # the one wait
        for d in ready:
            d.drafts, d.known = drawn[:, d.slot].tolist(), d.consumed + 1

    def _slots(self, drafters: list[MTPDrafter]) -> torch.Tensor | None:
        """``drafters``' slots on the device (None: no drafter)."""
        return on_device([d.slot for d in drafters], torch.int64, self._drawn.device) if drafters else None

    def _keep(self, j: int, slots: torch.Tensor | None) -> None:
        """Keep what the last MTP step drew for the drafters in ``slots`` (``_slots``) as their j-th draft."""
        if slots is not None:
            self._drawn[j].index_copy_(0, slots, self.runner.slot_tokens.index_select(0, slots))


def _span(prompt, output: list[int], lo: int, hi: int) -> np.ndarray:
    """Tokens ``lo`` to ``hi`` - 1 of the prompt followed by the output, not joining the whole (a
    step's few new positions of a long context)."""
    p = len(prompt)
    return np.concatenate([np.asarray(prompt[lo:min(hi, p)], dtype=np.int64),
                           np.asarray(output[max(lo - p, 0) : max(hi - p, 0)], dtype=np.int64)])


def _gather(out: torch.Tensor, pairs: list[tuple[int, int]], source: torch.Tensor) -> None:
    """out[dst] = source[src] for each (dst, src) of ``pairs``, on the device."""
    if pairs:
        dst, src = (on_device(v, torch.int64, source.device) for v in zip(*pairs))
        out.index_copy_(0, dst, source.index_select(0, src))


def _greedy(plan: StepPlan) -> StepPlan:
    """``plan`` with a greedy row per sequence and decode row, each drawing its slot's next input
    (the MTP leaves the row's h' there too)."""
    n = plan.num_rows
    plan.sample_slots = np.concatenate([plan.prefill_slots, plan.decode_slots]).astype(np.int32)
    plan.temperature, plan.top_p = np.zeros(n, np.float32), np.ones(n, np.float32)
    plan.top_k, plan.seed, plan.position = np.zeros(n, np.int32), np.zeros(n, np.int64), np.zeros(n, np.int64)
    return plan
