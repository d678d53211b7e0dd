"""Variants of a step side by side on one model in one process: the A/B method of
docs/experiments.md as code.

A variant is a factory of context managers whose patches (a module constant, a kernel wrapper, a
mixer's method) are in force while its runner captures its graphs, and around each of its steps
(so that an eager step, a CPU's or one past the captured buckets, runs them too). One model and
one state pool serve every variant. Before a variant's first step of a plan the states are put
back as they were, so its logits are compared with the first variant's from the same start.
Timings alternate variant by variant, round after round, so drift over the run (a GPU at its
power cap heating up) falls on every variant alike.

    import contextlib
    from mambastep.tools.bench_ab import compare, table
    from mambastep.tools.bench_steps import decode_plan
    rows = compare("nemotron-3-nano-30b-a3b", {"main": contextlib.nullcontext, "new": my_patch},
                   {"decode 1": decode_plan(1)})
    print(table(rows))
"""

from __future__ import annotations

import statistics
from typing import Callable, ContextManager, Mapping

import torch

from ..graphs import BucketSet
from ..runtime.model import Model
from ..runtime.plan import StepPlan
from ..runtime.state_pool import StatePool
from ..runtime.step_runner import StepRunner
from .bench_steps import step_ms

__all__ = ["compare", "table"]

Variant = Callable[[], ContextManager]


def _buckets(plans: Mapping[str, StepPlan]) -> BucketSet:
    """The graph buckets of exactly these plans' shapes (verify plans': verify buckets of the
    most drafts any carries)."""
    decode = {p.num_decode for p in plans.values() if not p.num_prefill}
    mixed = [p for p in plans.values() if p.num_prefill]
    verify = {p.num_prefill_tokens for p in mixed if p.num_drafts}
    return BucketSet(decode=tuple(sorted(decode or {1})),
                     mixed_decode=tuple(sorted({0} | {p.num_decode for p in mixed})),
                     prefill=tuple(sorted({p.num_prefill_tokens for p in mixed} or {16})),
                     max_prefill_seqs=max([p.num_prefill for p in mixed] or [1]),
                     drafts=max([p.num_drafts for p in mixed] or [0]), verify=tuple(sorted(verify or {16})))


def _pool(model: Model, plans: Mapping[str, StepPlan], max_context: int | None, drafts: int) -> StatePool:
    """A pool holding every slot the plans name, ``max_context`` long (default: as long as their
    contexts need), recording ``drafts`` a slot; random states."""
    slots, context = 1, 1
    for p in plans.values():
        slots = max(slots, 1 + int(max(p.decode_slots.max(initial=0), p.prefill_slots.max(initial=0))))
        context = max(context, int((p.decode_context + 1).max(initial=0)),
                      int((p.prefill_context + p.prefill_lens).max(initial=0)))
    if max_context is not None and max_context < context:
        raise ValueError(f"max_context {max_context}: the plans need {context} positions")
    pool = StatePool(model.cfg, slots, max_context=max_context or context + 1, dtype=model.dtype,
                     device=model.device, drafts=drafts)
    for t in pool.tensors():
        t.normal_(0, 0.1)
    return pool


def compare(preset: str, variants: Mapping[str, Variant], plans: Mapping[str, StepPlan], *, rounds: int = 3,
            back_to_back: int = 50, max_context: int | None = None, dtype: torch.dtype = torch.bfloat16,
            device: str | None = None, seed: int = 0, quantization: str | None = None) -> list[dict]:
    """One row a (plan, variant): its synchronised step times (ms, one median a round), steps
    launched back to back (ms a step, the median over the first two rounds; CUDA only), and
    whether its logits equal the first variant's (else the largest difference, the first's standard
    deviation, and the share of rows whose top token agrees). ``preset``:
    random weights of that shape; ``variants``: name -> context manager factory, the first the
    baseline; ``max_context``: the pool's length (what a decode attention's split sizes follow;
    ``bench steps`` pools ``CONTEXT + 2 * 2048``); ``quantization``: as ``Model.from_preset``'s
    (``"fp8"``: the weights quantized at load)."""
    if not variants or not plans:
        raise ValueError("compare needs at least one variant and one plan")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    model = Model.from_preset(preset, dtype=dtype, device=device, seed=seed, quantization=quantization)
    buckets = _buckets(plans)
    pool = _pool(model, plans, max_context, buckets.drafts)
    runners = {}
    for name, variant in variants.items():
        runner = StepRunner(model, pool, buckets, overlap=True)
        if runner.cuda:
            with variant():
                runner.capture(sorted({runner.bucket_for(p) for p in plans.values()}, reverse=True), progress=False)
        runners[name] = runner
    start = [t.clone() for t in pool.tensors()]
    rows = []
    for plan_name, plan in plans.items():
        logits = {}
        for name, runner in runners.items():
            for t, s in zip(pool.tensors(), start):
                t.copy_(s)
            with variants[name]():
                logits[name] = runner.logits(plan).float().clone()
        times = {name: [] for name in runners}
        streamed = {name: [] for name in runners}
        for i in range(rounds):
            for name, runner in runners.items():
                with variants[name]():
                    times[name].append(step_ms(runner, plan))
                    if runner.cuda and i < 2:
                        streamed[name].append(step_ms(runner, plan, steps=back_to_back, rounds=5))
        base = logits[next(iter(variants))]
        for name in runners:
            row = {"plan": plan_name, "variant": name, "sync_ms": times[name],
                   "median_ms": statistics.median(times[name]), "equal": torch.equal(logits[name], base),
                   "max_abs_diff": (logits[name] - base).abs().max().item(), "base_std": base.std().item(),
                   "top1": (logits[name].argmax(-1) == base.argmax(-1)).float().mean().item()}
            if streamed[name]:
                row["back_to_back_ms"] = statistics.median(streamed[name])
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The rows in markdown, each plan's variants beside its first."""
    out = ["| plan | variant | synchronised (ms) | median | vs first | back to back (ms) | logits |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    first: dict[str, float] = {}
    for r in rows:
        base = first.setdefault(r["plan"], r["median_ms"])
        b2b = f"{r['back_to_back_ms']:.3f}" if "back_to_back_ms" in r else "n/a"
        same = "equal" if r["equal"] else (f"max diff {r['max_abs_diff']:.3g} (std {r['base_std']:.3g}), "
                                           f"top-1 {r['top1']:.0%}")
        out.append(f"| {r['plan']} | {r['variant']} | {' '.join(f'{t:.3f}' for t in r['sync_ms'])} | "
                   f"{r['median_ms']:.3f} | {r['median_ms'] / base - 1:+.1%} | {b2b} | {same} |")
    return "\n".join(out)
