"""The bucket optimiser is exact: it equals brute force over every bucket set on small random
instances, with the graph and the pool budgets binding."""

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from mambastep.graphs import BucketSet
from mambastep.graphs.tuning import StepCosts, choose, expected_ms


@st.composite
def instances(draw):
    nd, nm, npf = draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    decode = tuple(sorted(draw(st.sets(st.integers(1, 64), min_size=nd, max_size=nd))))
    mixed_decode = tuple(sorted(draw(st.sets(st.integers(0, 64), min_size=nm, max_size=nm))))
    prefill = tuple(sorted(draw(st.sets(st.integers(16, 512), min_size=npf, max_size=npf))))
    ms = st.floats(0.1, 10.0)
    pool = st.integers(10, 100)
    costs = StepCosts(
        decode=decode, decode_graph_ms=tuple(draw(ms) for _ in decode),
        decode_eager_ms=tuple(draw(st.floats(1.0, 30.0)) for _ in decode),
        decode_pool_mib=tuple(draw(pool) for _ in decode),
        mixed_decode=mixed_decode, prefill=prefill,
        mixed_graph_ms=tuple(tuple(draw(ms) for _ in prefill) for _ in mixed_decode),
        mixed_eager_ms=tuple(tuple(draw(st.floats(1.0, 30.0)) for _ in prefill) for _ in mixed_decode),
        mixed_pool_mib=tuple(tuple(draw(pool) for _ in prefill) for _ in mixed_decode),
    )
    decode_steps = Counter(draw(st.dictionaries(st.integers(1, 80), st.integers(1, 9), min_size=1, max_size=6)))
    mixed_steps = Counter(draw(st.dictionaries(st.tuples(st.integers(0, 80), st.integers(1, 600)), st.integers(1, 9),
                                               min_size=1, max_size=6)))
    return costs, decode_steps, mixed_steps, draw(st.integers(2, 7)), draw(st.sampled_from([float("inf"), 40, 70]))


def subsets(xs):
    return [c for r in range(1, len(xs) + 1) for c in itertools.combinations(xs, r)]


def brute_force(costs, decode_steps, mixed_steps, max_graphs, pool_mib):
    best = None
    for d in subsets(costs.decode):
        for md in subsets(costs.mixed_decode):
            for p in subsets(costs.prefill):
                if len(d) + len(md) * len(p) > max_graphs:
                    continue
                c = expected_ms(costs, BucketSet(d, md, p), decode_steps, mixed_steps)
                if c.pool_mib <= pool_mib and (best is None or c.total_ms < best.total_ms):
                    best = c
    return best


@settings(max_examples=200, deadline=None)
@given(instances())
def test_the_choice_equals_brute_force(case):
    costs, decode_steps, mixed_steps, max_graphs, pool_mib = case
    brute = brute_force(costs, decode_steps, mixed_steps, max_graphs, pool_mib)
    if brute is None:
        with pytest.raises(ValueError, match="no bucket set"):
            choose(costs, decode_steps, mixed_steps, max_graphs, pool_mib)
        return
    got = choose(costs, decode_steps, mixed_steps, max_graphs, pool_mib)
    assert got.total_ms == pytest.approx(brute.total_ms, rel=1e-9)
    assert got.graphs <= max_graphs and got.pool_mib <= pool_mib
    # the choice reports the steps that fit no chosen bucket, and prices them eagerly
    assert got.eager_steps == sum(n for d, n in decode_steps.items() if got.buckets.choose(d) is None) + sum(
        n for (d, t), n in mixed_steps.items() if got.buckets.choose(d, t, 1) is None)


def linear_costs(**kw):
    """Graphs cost a little per row, eager steps 20x: covering every step pays."""
    decode, md, pf = (1, 2, 4, 8, 16, 32), (0, 4, 16), (64, 256)
    return StepCosts(
        decode=decode, decode_graph_ms=tuple(0.2 + 0.01 * d for d in decode),
        decode_eager_ms=tuple(4 + 0.2 * d for d in decode), decode_pool_mib=tuple(10 * d for d in decode),
        mixed_decode=md, prefill=pf,
        mixed_graph_ms=tuple(tuple(0.5 + 0.01 * d + 0.003 * t for t in pf) for d in md),
        mixed_eager_ms=tuple(tuple(6 + 0.2 * d + 0.06 * t for t in pf) for d in md),
        mixed_pool_mib=tuple(tuple(10 * d + t / 4 for t in pf) for d in md), **kw)


@settings(max_examples=60, deadline=None)
@given(decode_steps=st.dictionaries(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 20, 30, 40]), st.integers(1, 9),
                                    min_size=1, max_size=6),
       mixed_steps=st.dictionaries(st.tuples(st.sampled_from([0, 2, 4, 10, 20]), st.sampled_from([30, 100, 200, 300])),
                                   st.integers(1, 5), min_size=1, max_size=4),
       max_graphs=st.integers(2, 6), pool_mib=st.sampled_from([float("inf"), 170, 90]))
def test_the_choice_equals_brute_force_on_costs_that_grow_with_size(decode_steps, mixed_steps, max_graphs, pool_mib):
    """Costs shaped like measured ones (graph and eager time, and pool, growing with the step),
    where which sizes to skip is what the budget decides."""
    costs = linear_costs()
    brute = brute_force(costs, Counter(decode_steps), Counter(mixed_steps), max_graphs, pool_mib)
    got = choose(costs, Counter(decode_steps), Counter(mixed_steps), max_graphs, pool_mib)
    assert got.total_ms == pytest.approx(brute.total_ms, rel=1e-9)


def test_the_largest_step_is_covered_when_graphs_are_cheaper():
    costs = linear_costs()
    decode_steps = Counter({1: 50, 3: 40, 7: 30, 30: 5})
    mixed_steps = Counter({(3, 200): 10, (0, 60): 4})
    got = choose(costs, decode_steps, mixed_steps, max_graphs=6)
    assert got.eager_steps == 0 and got.buckets.decode[-1] >= 30
    assert got.buckets.choose(3, 200, 1) is not None


def test_a_pool_budget_below_the_largest_step_leaves_it_eager_and_says_so():
    costs = linear_costs()
    got = choose(costs, Counter({1: 50, 30: 5}), Counter({(3, 200): 10}), max_graphs=6, pool_mib=200)
    assert max(got.buckets.decode) <= 16 and got.eager_steps == 5  # the 30-row steps: 320 MiB a graph
    assert got.pool_mib <= 200


def test_unmeasured_sizes_are_refused():
    with pytest.raises(ValueError, match=r"sizes \[3\] were not measured"):
        expected_ms(linear_costs(), BucketSet((1, 3), (0,), (64,)), Counter({1: 1}), Counter())
