"""Continuous batching: every running decode each step, plus prompt chunks under a token budget.

FCFS: prompts already being prefilled continue first (chunked prefill carries a long prompt over
several steps, its state kept in its slot), then waiting requests are admitted while a state slot
is free. A full engine queues; it never fails a request for lack of slots.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .plan import StepPlan
from .request import Request

__all__ = ["Scheduler"]


class Scheduler:
    def __init__(self, num_slots: int, token_budget: int, max_prefill_seqs: int, max_decode: int):
        self.token_budget, self.max_prefill_seqs, self.max_decode = token_budget, max_prefill_seqs, max_decode
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def release(self, req: Request) -> None:
        """Give a finished or aborted request's slot back."""
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
        ``drawn``."""
        decodes = [r for r in self.running if r.prompt_done and not r.finished][: self.max_decode]
        budget = self.token_budget
        chunks: list[tuple[Request, int]] = []
        for r in self.running:
            if not r.prompt_done and budget > 0 and len(chunks) < self.max_prefill_seqs:
                n = min(len(r.prompt) - r.computed, budget)
                chunks.append((r, n))
                budget -= n
        while self.waiting and self.free_slots and budget > 0 and len(chunks) < self.max_prefill_seqs:
            r = self.waiting.popleft()
            r.slot = self.free_slots.pop()
            self.running.append(r)
            n = min(len(r.prompt), budget)
            chunks.append((r, n))
            budget -= n
        return self._plan(chunks, decodes)

    def _plan(self, chunks, decodes) -> tuple[StepPlan, list[Request | None]]:
        rows: list[Request | None] = []
        pre_tokens, pre_ctx = [], []
        for r, n in chunks:
            pre_tokens.append(r.prompt[r.computed : r.computed + n])
            pre_ctx.append(r.computed)
            r.computed += n
            rows.append(r if r.prompt_done else None)
        dec_ctx = []
        for r in decodes:
            dec_ctx.append(r.computed)
            r.computed += 1
            rows.append(r)
        i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
        params = [r.params if r is not None else None for r in rows]
        # a draw's position counts the draws scheduled before it, not the tokens collected: in
        # pipelined mode the previous step's token is still on its way
        positions = []
        for r in rows:
            positions.append(r.drawn if r is not None else 0)
            if r is not None:
                r.drawn += 1
        plan = StepPlan(
            prefill_tokens=np.concatenate(pre_tokens) if pre_tokens else np.zeros(0, np.int64),
            prefill_lens=i32([n for _, n in chunks]),
            prefill_slots=i32([r.slot for r, _ in chunks]),
            prefill_context=i32(pre_ctx),
            # decode inputs are the tokens the previous steps drew, already on the device
            decode_tokens=np.full(len(decodes), -1, dtype=np.int64),
            decode_slots=i32([r.slot for r in decodes]),
            decode_context=i32(dec_ctx),
            temperature=np.array([p.temperature if p else 0.0 for p in params], dtype=np.float32),
            top_k=i32([p.top_k if p else 0 for p in params]),
            top_p=np.array([p.top_p if p else 1.0 for p in params], dtype=np.float32),
            seed=np.array([r.seed if r else 0 for r in rows], dtype=np.int64),
            position=np.array(positions, dtype=np.int64),
            sample_slots=i32([r.slot if r is not None else -1 for r in rows]),
        )
        return plan, rows
