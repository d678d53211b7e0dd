"""The A/B harness on the CPU (eager steps; the timings mean nothing there, the bookkeeping does):
every variant starts each plan from the same states, its patches are in force around its
steps, and its logits are compared with the first variant's."""

import contextlib

import pytest
import torch

from mambastep.runtime.mixers.base import Norm
from mambastep.runtime.plan import StepPlan
from mambastep.tools.bench_ab import compare, table
from mambastep.tools.bench_steps import decode_plan


@contextlib.contextmanager
def scaled_norms():
    """Every block norm's output times 1.5: a variant whose logits must differ."""
    plain = Norm.__call__

    def scaled(self, x, **kwargs):
        return plain(self, x, **kwargs).mul_(1.5)

    Norm.__call__ = scaled
    try:
        yield
    finally:
        Norm.__call__ = plain


def test_variants_start_from_the_same_states_and_are_told_apart():
    plans = {"decode 2": decode_plan(2), "prefill 24": StepPlan.make([(list(range(3, 27)), 2, 0)])}
    variants = {"main": contextlib.nullcontext, "again": contextlib.nullcontext, "scaled": scaled_norms}
    rows = compare("tiny-hybrid", variants, plans, rounds=2, max_context=300)
    assert [(r["plan"], r["variant"]) for r in rows] == [(p, v) for p in plans for v in variants]
    by = {(r["plan"], r["variant"]): r for r in rows}
    for p in plans:
        # the same code from the same states: equal, though "main" ran first and moved the states
        assert by[p, "again"]["equal"] and by[p, "again"]["max_abs_diff"] == 0.0
        assert len(by[p, "main"]["sync_ms"]) == 2
        assert ("back_to_back_ms" in by[p, "main"]) == torch.cuda.is_available()  # timed on a GPU only
    assert not by["prefill 24", "scaled"]["equal"] and by["prefill 24", "scaled"]["max_abs_diff"] > 0
    assert Norm.__call__.__name__ == "__call__"  # the patch is undone
    text = table(rows)
    assert text.count("\n") == 1 + len(rows) and "| prefill 24 | scaled |" in text and "max diff" in text


def test_a_pool_too_short_for_the_plans_is_refused():
    with pytest.raises(ValueError, match="max_context 8: the plans need 24 positions"):
        compare("tiny-hybrid", {"main": contextlib.nullcontext}, {"p": StepPlan.make([(list(range(3, 27)), 0, 0)])},
                max_context=8)
