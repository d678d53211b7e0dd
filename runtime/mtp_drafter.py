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

A request whose positions the MTP did not see (a choice forked from its prompt's prefix) drafts
nothing and decodes as usual. The MTP runs on a pool and a runner of its own, captured in
buckets of the target's sizes where the engine captures (a larger catch-up runs eagerly).
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
from .step_runner import StepRunner

__all__ = ["MTPDrafter", "MTPDrafting"]


class MTPDrafter:
    """One request's drafter over the engine's ``MTPDrafting``: where its MTP state stands."""

    def __init__(self, drafting: "MTPDrafting"):
        self.drafting = drafting
        self.slot = -1
        self.consumed = 0  # the positions whose keys and values the MTP holds for the request
        self.lost = False  # the target ran positions the MTP never saw: it drafts nothing
        self.known = -1  # the context length ``drafts`` follow (-1: none yet)
        self.drafts: list[int] = []

    def draft(self, context, k: int) -> list[int]:
        return self.drafting.drafts(self, len(context))[:k]


class MTPDrafting:
    def __init__(self, target: Model, target_runner: StepRunner, num_slots: int, max_context: int, num_drafts: int,
                 graphs: bool = False):
        """target: a model loaded with its MTP layers (``mtp=True``); target_runner: its runner,
        keeping its steps' hidden states; num_slots: the request slots; num_drafts: k; graphs:
        capture the MTP's steps, in buckets of the target's sizes (else they run eagerly)."""
        if target_runner.hidden is None:
            raise ValueError("MTP drafting reads the target's hidden states: its runner needs keep_hidden=True")
        buffers = target_runner.buffers
        max_tokens = buffers.max_prefill_tokens + buffers.max_decode  # a step's every row, as prefill rows
        self.model = MTPModel(target, target.mtp_weights, num_slots=num_slots, max_tokens=max_tokens)
        self.pool = StatePool(self.model.cfg, num_slots, max_context, dtype=target.dtype, device=target.device)
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
        self.num_drafts, self.max_context = num_drafts, max_context
        # [k, slots]: what each chained step drew for the requests that draft, read back at once
        self._drawn = torch.zeros(num_drafts, num_slots, dtype=torch.int64, device=target.device)
        self._ready: list[MTPDrafter] = []  # the drafters whose first draft the last follow drew

    def follow(self, plan: StepPlan, bucket: Bucket, by_slot: dict[int, Request]) -> None:
        """After the target ran ``plan`` in ``bucket`` and its tokens were collected: take each
        speculating request's newly certain positions in (``by_slot``: the running requests)."""
        starts = np.concatenate([[0], np.cumsum(plan.prefill_lens)])
        # (slot, its first position, positions, its first packed row of the target step)
        pieces = [(int(s), int(c), int(n), int(row)) for s, c, n, row in
                  zip(plan.prefill_slots, plan.prefill_context, plan.prefill_lens, starts)]
        pieces += [(int(s), int(c), 1, bucket.prefill + b) for b, (s, c) in
                   enumerate(zip(plan.decode_slots, plan.decode_context))]
        seqs, rows, self._ready = [], [], []
        for slot, first, n, row in pieces:
            req = by_slot.get(slot)
            d = None if req is None else req.drafter
            if not isinstance(d, MTPDrafter) or d.lost or req.finished:
                continue
            if first > d.consumed:  # its prompt's prefix ran without it (a forked choice)
                d.lost = True
                continue
            context = np.concatenate([req.prompt, np.asarray(req.output, dtype=np.int64)])
            start, end = d.consumed, min(first + n, len(context) - 1)
            if start >= end:
                continue
            seqs.append((context[start + 1 : end + 1], slot, start))
            rows.extend(range(row + start - first, row + end - first))
            d.slot, d.consumed, d.known = slot, end, -1
            if req.prompt_done and end == len(context) - 1:
                self._ready.append(d)
        if not seqs:
            return
        with torch.inference_mode():
            index = _on_device(rows, self.target_hidden.device)
            self.model.hidden_in[: len(rows)].copy_(self.target_hidden.index_select(0, index))
            self.runner.launch(_greedy(StepPlan.make(prefill=seqs)))
            self._keep(0, self._ready)

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
            for j in range(1, k):
                self.runner.launch(_greedy(StepPlan.make(decode=[(-1, d.slot, d.consumed + j - 1) for d in ready])))
                self._keep(j, ready)
            drawn = self._drawn[:k].cpu().numpy()  # the one wait
        for d in ready:
            d.drafts, d.known = drawn[:, d.slot].tolist(), d.consumed + 1

    def _keep(self, j: int, drafters: list[MTPDrafter]) -> None:
        """Keep what the last MTP step drew for ``drafters``' slots as their j-th draft."""
        slots = [d.slot for d in drafters]
        if slots:
            slots = _on_device(slots, self._drawn.device)
            self._drawn[j].index_copy_(0, slots, self.runner.slot_tokens.index_select(0, slots))


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 ``values`` on ``device``, through pinned memory: the host does not wait for the device."""
    t = torch.as_tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _greedy(plan: StepPlan) -> StepPlan:
    """``plan`` with a greedy row per sequence and decode row, each drawing its slot's next input
    (the MTP leaves the row's h' there too)."""
    n = plan.num_rows
    plan.sample_slots = np.concatenate([plan.prefill_slots, plan.decode_slots]).astype(np.int32)
    plan.temperature, plan.top_p = np.zeros(n, np.float32), np.ones(n, np.float32)
    plan.top_k, plan.seed, plan.position = np.zeros(n, np.int32), np.zeros(n, np.int64), np.zeros(n, np.int64)
    return plan
