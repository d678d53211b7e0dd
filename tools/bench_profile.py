"""Where a step's device time goes, two ways (CUDA only):

- ``profile``: each kernel's own time over eager steps, summed by name (the same kernels as the
  graph, unforked).
- ``timeline``: the captured graph's replays as the device ran them, every stream merged: each
  kernel is charged the time from the end of the kernel that ended before it to its own end, so
  the charges add up to the step's span and kernels that overlap (programmatic dependents, a
  forked stream) are charged only what they add. A kernel is named with its neighbours in that
  order (``prev > KERNEL > next``), which tells apart the projections that share one kernel.
  Above the table, the kernels a replay and how long the device sat idle between them (the span
  less the union of their runs): what launches cost that no kernel's own time shows. With a
  window, also a stretch of one replay kernel by kernel, each with its start and end, so
  what ran beside what (a forked stream, a programmatic dependent's early start) shows.
"""

from __future__ import annotations

import collections
import time

import torch

from ..graphs import BucketSet
from ..runtime.model import Model
from ..runtime.mtp import MTPModel
from ..runtime.plan import StepPlan
from ..runtime.state_pool import StatePool
from ..runtime.step_runner import StepRunner
from .bench_spec import verify_plan
from .bench_steps import CONTEXT, decode_rows, prefill_plan, step_ms


def _step(preset: str, batch: int, prefill: int, overlap: bool, quantization: str | None = None,
          mtp: bool = False, verify: int = 0) -> tuple[StepRunner, StepPlan]:
    """A runner over ``preset`` (random bf16 weights, quantized as ``quantization`` says), or
    with ``mtp`` over its MTP layers as the drafter runs them (decode rows: chained drafts; a
    prefill chunk: a catch-up), and the plan of a step of ``batch`` decode rows plus one prefill
    chunk of ``prefill`` tokens (none at 0); with ``verify`` k, a verify step of ``batch``
    sequences of 1 + k tokens instead (``bench_spec.verify_plan``)."""
    torch.manual_seed(0)
    model = Model.from_preset(preset, dtype=torch.bfloat16, device="cuda", quantization=quantization, mtp=mtp)
    if mtp:
        model = MTPModel(model, model.mtp_weights, num_slots=batch + 1, max_tokens=max(prefill, 16) + batch)
    pool = StatePool(model.cfg, batch + 1, max_context=CONTEXT + max(prefill, verify + 1) + 2, dtype=torch.bfloat16,
                     device="cuda", drafts=verify)
    if verify:
        tokens = batch * (1 + verify)
        buckets = BucketSet(decode=(1,), mixed_decode=(0,), prefill=(tokens,), max_prefill_seqs=batch, drafts=verify,
                            verify=(tokens,))
        plan = verify_plan(batch, verify, model.cfg.vocab_size, CONTEXT)
        return StepRunner(model, pool, buckets, overlap=overlap), plan
    buckets = BucketSet(decode=(max(batch, 1),), mixed_decode=tuple(sorted({0, batch})), prefill=(max(prefill, 16),),
                        max_prefill_seqs=1)
    chunk = [(prefill_plan(prefill, batch, model.cfg.vocab_size).prefill_tokens.tolist(), batch, 0)] if prefill else []
    return StepRunner(model, pool, buckets, overlap=overlap), StepPlan.make(chunk, decode_rows(batch))


def _kernels(prof) -> list[tuple[float, float, str]]:
    """(start, end, name) of every CUDA kernel and copy the profiler saw, in microseconds."""
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def profile(preset: str, batch: int, prefill: int = 0, top: int = 25, quantization: str | None = None,
            mtp: bool = False, verify: int = 0) -> str:
    """Per-kernel device time of a step: ``batch`` decode rows, plus one prefill chunk of
    ``prefill`` tokens if nonzero (run eagerly and unforked: the same kernels as the graph);
    ``mtp``: a step of the preset's MTP layers; ``verify`` k: a verify step of ``batch``
    sequences of 1 + k tokens."""
    runner, plan = _step(preset, batch, prefill, overlap=False, quantization=quantization, mtp=mtp, verify=verify)
    runner.logits(plan)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            runner.logits(plan)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top)


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and signature, at most 48 characters."""
    return name.split("(")[0].split("<")[0].strip()[:48]


def split_replays(kernels: list[tuple[float, float, str]], gap_us: float = 200.0) -> list[list]:
    """The kernels of each replay: runs separated by more than ``gap_us`` of idle device (the
    replays are launched apart), keeping those that span at least half the longest."""
    groups: list[list] = []
    for k in sorted(kernels):
        if groups and k[0] - max(e[1] for e in groups[-1]) <= gap_us:
            groups[-1].append(k)
        else:
            groups.append([k])
    spans = [max(e[1] for e in g) - g[0][0] for g in groups]
    return [g for g, s in zip(groups, spans) if s >= max(spans, default=0) / 2]


def kernel_shares(replays: list[list[tuple[float, float, str]]]) -> tuple[float, list[dict]]:
    """(mean span, rows): each (prev, name, next) of the replays' kernels in end order, with its
    charge per step (``share_us``), per call (``per_call_us``), its own mean duration and its
    calls per step; rows by charge, largest first."""
    acc = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for replay in replays:
        ends = sorted(replay, key=lambda k: k[1])
        names = [short_name(k[2]) for k in ends]
        prev_end = ends[0][0]
        for i, (start, end, _) in enumerate(ends):
            key = (names[i - 1] if i else "-", names[i], names[i + 1] if i + 1 < len(ends) else "-")
            a = acc[key]
            a[0] += end - prev_end
            a[1] += end - start
            a[2] += 1
            prev_end = end
    n = max(1, len(replays))
    rows = [{"prev": p, "kernel": k, "next": nx, "share_us": s / n, "per_call_us": s / c, "duration_us": d / c,
             "calls": c / n} for (p, k, nx), (s, d, c) in acc.items()]
    rows.sort(key=lambda r: -r["share_us"])
    return sum(r["share_us"] for r in rows), rows


def busy_us(replays: list[list[tuple[float, float, str]]]) -> tuple[float, float]:
    """(mean kernels a replay, mean time a replay some kernel runs): the union of its kernels'
    intervals, kernels side by side on two streams counted once; the span less it is the device
    idle between kernels (launch gaps, a dependent waiting on a drained grid)."""
    if not replays:
        return 0.0, 0.0
    total = 0.0
    for replay in replays:
        end = None
        for start, stop, _ in sorted(replay):
            if end is None or start > end:
                total += stop - start
                end = stop
            elif stop > end:
                total += stop - end
                end = stop
    return sum(len(r) for r in replays) / len(replays), total / len(replays)


def kernel_window(replay: list[tuple[float, float, str]], lo: int, hi: int) -> list[str]:
    """Kernels ``lo`` to ``hi - 1`` of one replay in start order, as markdown table rows: index,
    start and end (us from the replay's first kernel's start), own duration, short name."""
    by_start = sorted(replay)
    t0 = by_start[0][0] if by_start else 0.0
    return [f"| {i} | {start - t0:.2f} | {end - t0:.2f} | {end - start:.2f} | {short_name(name)} |"
            for i, (start, end, name) in enumerate(by_start[lo:hi], start=lo)]


def timeline(preset: str, batch: int, prefill: int = 0, replays: int = 5, top: int = 30,
             window: tuple[int, int] | None = None, quantization: str | None = None, mtp: bool = False,
             verify: int = 0) -> str:
    """The step's graph replayed ``replays`` times under the profiler: each kernel's charge of
    the step (see the module doc), the largest ``top``; with ``window`` (lo, hi), also kernels lo
    to hi - 1 of the middle replay, each with its start and end. Beside the replay's span, the
    whole step as the engine runs it (refill, replay, draw; synchronised): what the host adds.
    ``mtp``: a step of the preset's MTP layers; ``verify``: as ``profile``'s."""
    runner, plan = _step(preset, batch, prefill, overlap=True, quantization=quantization, mtp=mtp, verify=verify)
    bucket = runner.bucket_for(plan)
    runner.capture([bucket], progress=False)
    whole_ms = step_ms(runner, plan)
    runner.logits(plan)  # fills the buffers the replays read
    for _ in range(3):
        runner.graphs.forward(bucket)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            runner.graphs.forward(bucket)
            torch.cuda.synchronize()
            time.sleep(0.002)  # idle between replays, so they split apart
    split = split_replays(_kernels(prof))
    span, rows = kernel_shares(split)
    count, busy = busy_us(split)
    out = [f"{preset}" + (" MTP layers" if mtp else "") + (f" ({quantization})" if quantization else "")
           + (f", {batch} verify sequences of {1 + verify} tokens" if verify else f", {batch} decode rows")
           + (f" + a {prefill}-token chunk" if prefill else "")
           + f": graph replay span {span:.1f} us (mean of {replays}); the whole step, refilled, replayed and "
           f"drawn, synchronised: {1e3 * whole_ms:.1f} us (median)",
           f"{count:g} kernels a replay; some kernel running {busy:.1f} us of its span, the device idle between "
           f"them {span - busy:.1f} us ({(span - busy) / span if span else 0:.1%})", "",
           "| charge a step (us) | a call (us) | own duration (us) | calls a step | prev > KERNEL > next |",
           "| --- | --- | --- | --- | --- |"]
    for r in rows[:top]:
        out.append(f"| {r['share_us']:.1f} | {r['per_call_us']:.2f} | {r['duration_us']:.2f} | {r['calls']:g} | "
                   f"{r['prev']} > **{r['kernel']}** > {r['next']} |")
    if window is not None and split:
        out += ["", f"Kernels {window[0]} to {window[1] - 1} of replay {len(split) // 2 + 1}, by start (us from its "
                f"first kernel's start):", "", "| # | start | end | own duration | kernel |", "| --- | --- | --- | --- | --- |"]
        out += kernel_window(split[len(split) // 2], *window)
    return "\n".join(out)
