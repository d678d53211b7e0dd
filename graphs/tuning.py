"""Choose graph buckets from measured step times: the bucket set that minimises a workload's
expected step time under a maximum number of graphs and a graph-pool budget.

The inputs are plain numbers, so this module knows nothing of models:

- ``StepCosts``: for candidate buckets, the measured time of a step replayed in each one's graph,
  each graph's pool need, and the eager time of steps of candidate sizes (a step above every
  chosen bucket runs eagerly at its own size, timed by interpolating those).
- a workload: how many decode-only steps of each batch size, and how many mixed steps of each
  (decode rows, prefill tokens).

The pool model: graphs share one pool, each graph's transient buffers reused by the next graph of
its kind, so a set's pool is its largest decode-only graph's plus its largest mixed graph's (each
measured alone). Measured on the H200, the two kinds reuse each other's blocks little: the
default set of Mamba2-130M took 1240 MiB, against 552 + 626 modelled and 626 for the largest
member alone. The graph budget is shared by the decode-only sizes and the mixed grid (mixed
decode sizes x prefill sizes, every pair a graph, as ``BucketSet`` builds them).

Both choices are exact. Decode-only: a dynamic program over the sorted candidates (a chosen size
serves the steps from the previous chosen size up). Mixed: every subset of the prefill
candidates (a handful) with the same dynamic program over the mixed decode sizes; the two tables
(best cost by graph count) are then combined. Under a pool budget, every split of it between
the two kinds is tried (one per distinct decode-only pool).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import numpy as np

from .buckets import BucketSet

__all__ = ["Choice", "StepCosts", "choose", "expected_ms"]

INF = float("inf")


@dataclass(frozen=True)
class StepCosts:
    """Measured costs (ms, MiB) over candidate buckets.

    decode: candidate decode-only sizes, ascending; decode_graph_ms, decode_eager_ms and
        decode_pool_mib: per size.
    mixed_decode (0 first: prefill only) x prefill: the candidate grid; mixed_graph_ms,
        mixed_eager_ms, mixed_pool_mib: [i][j] for (mixed_decode[i], prefill[j]).
    """

    decode: tuple[int, ...]
    decode_graph_ms: tuple[float, ...]
    decode_eager_ms: tuple[float, ...]
    decode_pool_mib: tuple[float, ...]
    mixed_decode: tuple[int, ...]
    prefill: tuple[int, ...]
    mixed_graph_ms: tuple[tuple[float, ...], ...]
    mixed_eager_ms: tuple[tuple[float, ...], ...]
    mixed_pool_mib: tuple[tuple[float, ...], ...]

    def decode_eager(self, d: int) -> float:
        """An eager decode-only step of ``d`` rows, interpolated over the measured sizes."""
        return _interp(d, self.decode, self.decode_eager_ms)

    def mixed_eager(self, d: int, t: int) -> float:
        """An eager mixed step: linear in prefill tokens at the nearest measured decode size
        at or above ``d`` (the largest beyond them)."""
        i = min(np.searchsorted(self.mixed_decode, d), len(self.mixed_decode) - 1)
        return _interp(t, self.prefill, self.mixed_eager_ms[i])


def _interp(x: float, xs, ys) -> float:
    """Piecewise linear through (xs, ys), extended linearly beyond both ends."""
    xs, ys = np.asarray(xs, float), np.asarray(ys, float)
    if len(xs) == 1:
        return float(ys[0] * x / xs[0]) if xs[0] else float(ys[0])
    if x <= xs[0]:
        a, b = 0, 1
    elif x >= xs[-1]:
        a, b = len(xs) - 2, len(xs) - 1
    else:
        return float(np.interp(x, xs, ys))
    return float(ys[a] + (ys[b] - ys[a]) * (x - xs[a]) / (xs[b] - xs[a]))


@dataclass(frozen=True)
class Choice:
    """A chosen bucket set with its expected cost under the costs it was chosen with."""

    buckets: BucketSet
    total_ms: float  # the workload's expected time
    steps: int
    graphs: int
    pool_mib: float
    eager_steps: int  # steps above every chosen bucket

    @property
    def mean_ms(self) -> float:
        return self.total_ms / max(self.steps, 1)


def _best_by_count(sizes, serve, eager_above, max_graphs: int, unit: int = 1):
    """Exact DP over sorted candidate ``sizes`` (the row axis of one table of graphs).

    ``serve(j, lo)``: the summed graph time of the steps of sizes in (lo, sizes[j]] served by
    candidate j; ``eager_above(lo)``: the eager time of the steps above size lo. A chosen size
    costs ``unit`` graphs. Returns (best[g], picks[g]) for g = 0..max_graphs: the least cost
    with at least one and at most g graphs (INF where none fits) and the sizes chosen.
    """
    n, k = len(sizes), max_graphs // unit
    best = np.full(max_graphs + 1, INF)
    picks: list[tuple] = [()] * (max_graphs + 1)
    if not (n and k):
        return best, picks
    # step[i, j]: serving (sizes[i - 1], sizes[j]] by j, i = 0 the steps from the smallest up
    step = np.full((n + 1, n), INF)
    for j in range(n):
        step[0, j] = serve(j, -1)
        for i in range(j):
            step[i + 1, j] = serve(j, sizes[i])
    # dp[c, j]: the least cost of the steps up to sizes[j] with c sizes chosen, the largest sizes[j]
    dp = np.full((k + 1, n), INF)
    back = np.full((k + 1, n), -1, dtype=int)
    dp[1] = step[0]
    for c in range(2, k + 1):
        via = dp[c - 1][:, None] + step[1:]  # via[i, j]: sizes[i] chosen just below sizes[j]
        back[c] = via.argmin(0)
        dp[c] = via[back[c], np.arange(n)]
    tail = np.array([eager_above(x) for x in sizes])
    for c in range(1, k + 1):
        j = int(np.argmin(dp[c] + tail))
        if dp[c, j] + tail[j] < INF:
            chosen, cc, jj = [], c, j
            while jj >= 0 and cc >= 1:
                chosen.append(sizes[jj])
                jj, cc = back[cc, jj], cc - 1
            best[c * unit], picks[c * unit] = dp[c, j] + tail[j], tuple(sorted(chosen))
    return _at_most(best, picks)


def _at_most(best, picks):
    """Tables by exact graph count -> by at most that many graphs (fewer may do as well); g = 0
    (no graph) stays apart, a set always has one."""
    for g in range(2, len(best)):
        if best[g - 1] <= best[g]:
            best[g], picks[g] = best[g - 1], picks[g - 1]
    return best, picks


def _up_to(keys, values):
    """x -> the sum of ``values`` whose key is at most x (keys need not be sorted)."""
    order = np.argsort(keys, kind="stable")
    k = np.asarray(keys, float)[order]
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(values, float)[order])])
    return lambda x: float(cum[np.searchsorted(k, x, side="right")])


def _decode_table(costs: StepCosts, steps: Counter, allowed, max_graphs: int):
    """Best decode-only sizes by graph count."""
    ok = [j for j in range(len(costs.decode)) if allowed(j)]
    sizes = [costs.decode[j] for j in ok]
    rows, counts = list(steps), list(steps.values())
    count = _up_to(rows, counts)
    eager = _up_to(rows, [n * costs.decode_eager(d) for d, n in steps.items()])
    eager_total = eager(float("inf"))

    def serve(jj, lo):
        return costs.decode_graph_ms[ok[jj]] * (count(sizes[jj]) - count(lo))

    return _best_by_count(sizes, serve, lambda lo: eager_total - eager(lo), max_graphs)


def _mixed_table(costs: StepCosts, steps: Counter, allowed, max_graphs: int):
    """Best mixed grids by graph count: every subset of the prefill candidates, each with the
    DP over the mixed decode sizes (a size then costs as many graphs as the subset holds)."""
    best = np.full(max_graphs + 1, INF)
    picks: list = [((), ())] * (max_graphs + 1)
    for r in range(1, min(len(costs.prefill), max_graphs) + 1):
        for subset in itertools.combinations(range(len(costs.prefill)), r):
            ps = [costs.prefill[j] for j in subset]
            rows = [i for i in range(len(costs.mixed_decode)) if all(allowed(i, j) for j in subset)]
            if not rows:
                continue
            # steps with more prefill tokens than the largest chosen run eagerly, whatever their rows
            over = sum(n * costs.mixed_eager(d, t) for (d, t), n in steps.items() if t > ps[-1])
            under = [(d, t, n) for (d, t), n in steps.items() if t <= ps[-1]]
            ds = [d for d, _, _ in under]
            # by candidate row: the graph time of the steps up to a decode size, each step in
            # its prefill bucket of the subset
            in_row = [_up_to(ds, [n * costs.mixed_graph_ms[i][subset[int(np.searchsorted(ps, t))]]
                                  for _, t, n in under]) for i in rows]
            eager = _up_to(ds, [n * costs.mixed_eager(d, t) for d, t, n in under])
            eager_total = eager(float("inf"))
            sizes = [costs.mixed_decode[i] for i in rows]

            def serve(jj, lo, in_row=in_row, sizes=sizes):
                return in_row[jj](sizes[jj]) - in_row[jj](lo)

            table, chosen = _best_by_count(sizes, serve, lambda lo, e=eager, tot=eager_total: tot - e(lo),
                                           max_graphs, unit=r)
            for g in range(1, max_graphs + 1):
                if table[g] + over < best[g]:
                    best[g], picks[g] = table[g] + over, (chosen[g], tuple(ps))
    return _at_most(best, picks)


def choose(costs: StepCosts, decode_steps: Counter, mixed_steps: Counter, max_graphs: int,
           pool_mib: float = INF, max_prefill_seqs: int = 8) -> Choice:
    """The bucket set of least expected time for the workload (``decode_steps[d]`` decode-only
    steps of d rows, ``mixed_steps[d, t]`` mixed steps of d rows and t prefill tokens) with at
    most ``max_graphs`` graphs (at least one decode size and one mixed graph, as a BucketSet
    has) and a pool (the module's model) within ``pool_mib``. Raises ValueError when nothing
    fits."""
    # the decode-only kind's share of the pool: every distinct candidate pool that leaves room
    shares = sorted({p for p in costs.decode_pool_mib if p <= pool_mib}) if pool_mib < INF else [INF]
    mixed_tables = {}
    total, pick = INF, None
    for share in shares:
        rest = pool_mib - share if pool_mib < INF else INF
        d_best, d_picks = _decode_table(costs, decode_steps, lambda j: costs.decode_pool_mib[j] <= share,
                                        max_graphs)
        admitted = tuple(p <= rest for row in costs.mixed_pool_mib for p in row)
        if admitted not in mixed_tables:
            mixed_tables[admitted] = _mixed_table(costs, mixed_steps,
                                                  lambda i, j: costs.mixed_pool_mib[i][j] <= rest, max_graphs)
        m_best, m_picks = mixed_tables[admitted]
        for g in range(1, max_graphs):
            v = d_best[g] + m_best[max_graphs - g]
            if v < total:
                total, pick = v, (d_picks[g], m_picks[max_graphs - g])
    if pick is None:
        raise ValueError(f"no bucket set of at most {max_graphs} graphs within {pool_mib} MiB of pool "
                         "has a decode size and a mixed graph")
    decode, (mixed_decode, prefill) = pick
    return expected_ms(costs, BucketSet(decode, mixed_decode, prefill, max_prefill_seqs), decode_steps, mixed_steps)


def expected_ms(costs: StepCosts, buckets: BucketSet, decode_steps: Counter, mixed_steps: Counter) -> Choice:
    """The workload's expected time over ``buckets`` (every size must be a measured candidate)."""
    di = {s: j for j, s in enumerate(costs.decode)}
    mi = {s: i for i, s in enumerate(costs.mixed_decode)}
    pj = {s: j for j, s in enumerate(costs.prefill)}
    missing = ([s for s in buckets.decode if s not in di] + [s for s in buckets.mixed_decode if s not in mi]
               + [s for s in buckets.prefill if s not in pj])
    if missing:
        raise ValueError(f"buckets: sizes {missing} were not measured; measure them as candidates")
    total, eager = 0.0, 0
    for d, n in decode_steps.items():
        b = buckets.choose(d)
        if b is None:
            total, eager = total + n * costs.decode_eager(d), eager + n
        else:
            total += n * costs.decode_graph_ms[di[b.decode]]
    for (d, t), n in mixed_steps.items():
        b = buckets.choose(d, t, 1)
        if b is None:
            total, eager = total + n * costs.mixed_eager(d, t), eager + n
        else:
            total += n * costs.mixed_graph_ms[mi[b.decode]][pj[b.prefill]]
    pool = (max(costs.decode_pool_mib[di[s]] for s in buckets.decode)
            + max(costs.mixed_pool_mib[mi[d]][pj[t]] for d in buckets.mixed_decode for t in buckets.prefill))
    steps = sum(decode_steps.values()) + sum(mixed_steps.values())
    return Choice(buckets, total, steps, len(buckets.all()), pool, eager)
