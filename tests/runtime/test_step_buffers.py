"""Hypothesis fuzz of the step-buffer refill: any plan, any bucket that holds it, over buffers
full of garbage, yields exactly the plan's inputs and inert padding; and a padded step computes
what the unpadded one does."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mambastep.graphs import Bucket, BucketSet
from mambastep.kernels.varlen import PAD_SLOT_ID
from mambastep.runtime.model import Model
from mambastep.runtime.plan import StepPlan
from mambastep.runtime.state_pool import StatePool
from mambastep.runtime.step_buffers import StepBuffers
from mambastep.runtime.step_runner import StepRunner

MAX_DECODE, MAX_TOKENS, MAX_SEQS, CHUNK, SLOTS = 12, 64, 4, 8, 16


@st.composite
def plans(draw, max_tokens=MAX_TOKENS, max_decode=MAX_DECODE, vocab=500):
    slots = draw(st.permutations(range(SLOTS)))
    lens = draw(st.lists(st.integers(1, 24), max_size=MAX_SEQS).filter(lambda v: sum(v) <= max_tokens))
    n_dec = draw(st.integers(0 if lens else 1, min(max_decode, SLOTS - len(lens))))
    prefill = [(draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)), slots[i], draw(st.integers(0, 30)))
               for i, n in enumerate(lens)]
    decode = [(draw(st.integers(-1, vocab - 1)), slots[len(lens) + i], draw(st.integers(0, 40)))
              for i in range(n_dec)]
    plan = StepPlan.make(prefill, decode)
    rows = plan.num_rows
    if draw(st.booleans()):  # sampled rows
        plan.temperature = np.asarray(draw(st.lists(st.floats(0, 2), min_size=rows, max_size=rows)), np.float32)
        plan.top_k = np.asarray(draw(st.lists(st.integers(0, 50), min_size=rows, max_size=rows)), np.int32)
        plan.top_p = np.full(rows, 0.9, np.float32)
        plan.seed = np.arange(rows, dtype=np.int64) + 7
        plan.position = np.arange(rows, dtype=np.int64)
        plan.sample_slots = np.asarray([s for _, s, _ in prefill] + [s for _, s, _ in decode], np.int32)
    return plan


@st.composite
def plan_and_bucket(draw):
    plan = draw(plans())
    decode = draw(st.integers(plan.num_decode, MAX_DECODE))
    prefill = draw(st.integers(plan.num_prefill_tokens, MAX_TOKENS)) if plan.num_prefill else 0
    return plan, Bucket(decode, prefill)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=plan_and_bucket(), garbage=st.integers(0, 255))
def test_refill_writes_exactly_the_plan(case, garbage):
    plan, bucket = case
    buffers = StepBuffers(MAX_DECODE, MAX_TOKENS, MAX_SEQS, CHUNK)
    buffers.arena.host.fill_(garbage)
    buffers.fill(plan, bucket)
    inputs = buffers.inputs(bucket)
    B, Tp, tp, n_dec, n_pre = bucket.decode, bucket.prefill, plan.num_prefill_tokens, plan.num_decode, plan.num_prefill

    ids = inputs.input_ids.numpy()
    assert ids.shape == (Tp + B,)
    assert (ids[:tp] == plan.prefill_tokens).all() and (ids[tp:Tp] == 0).all()
    assert (ids[Tp : Tp + n_dec] == plan.decode_tokens).all() and (ids[Tp + n_dec :] == 0).all()
    assert (inputs.decode_slots.numpy() == np.r_[plan.decode_slots, [PAD_SLOT_ID] * (B - n_dec)]).all()
    assert (inputs.decode_kv_lens.numpy() == np.r_[plan.decode_context + 1, [0] * (B - n_dec)]).all()

    rows = inputs.logit_rows.numpy()
    assert len(rows) == buffers.rows(bucket)
    assert (rows[:n_pre] == np.cumsum(plan.prefill_lens) - 1).all()
    assert (rows[n_pre : n_pre + n_dec] == Tp + np.arange(n_dec)).all()
    assert (rows[n_pre + n_dec :] == 0).all()

    if Tp:
        m = inputs.prefill
        assert m.max_tokens == Tp
        assert (m.cu_seqlens.numpy()[: n_pre + 1] == np.r_[0, np.cumsum(plan.prefill_lens)]).all()
        assert (m.cu_seqlens.numpy()[n_pre:] == tp).all()
        assert (m.seq_idx.numpy()[tp:] == -1).all()
        assert (m.slot_idx.numpy() == np.r_[plan.prefill_slots, [PAD_SLOT_ID] * (MAX_SEQS - n_pre)]).all()
        assert (m.context_lens.numpy()[:n_pre] == plan.prefill_context).all()
        assert (m.has_initial_state.numpy()[:n_pre] == (plan.prefill_context > 0)).all()
        used = m.seq_chunk_start.numpy()[n_pre]
        assert (m.chunk_seq.numpy()[used:] == -1).all()
    else:
        assert inputs.prefill is None

    temperature, top_k, top_p, seed, position, sample_slots = (t.numpy() for t in buffers.sampling(bucket))
    n = plan.num_rows if plan.sampled else 0
    assert (temperature[n:] == 0).all() and (sample_slots[n:] == PAD_SLOT_ID).all() and (top_p[n:] == 1).all()
    if n:
        assert (temperature[:n] == plan.temperature).all() and (top_k[:n] == plan.top_k).all()
        assert (sample_slots[:n] == plan.sample_slots).all() and (seed[:n] == plan.seed).all()


@pytest.fixture(scope="module")
def tiny():
    return Model.from_preset("tiny-hybrid", dtype=torch.float32)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans(max_tokens=40, max_decode=6, vocab=512).filter(lambda p: bool((p.decode_tokens >= 0).all())))
def test_padded_step_equals_unpadded(tiny, plan):
    """The same plan, run in an exact-size step and in a padded bucket, gives the same logits and
    leaves the same states (padding rows, tokens and sequences are inert)."""
    exact = Bucket(plan.num_decode, plan.num_prefill_tokens)
    padded = Bucket(8, 48 if plan.num_prefill else 0)
    results = []
    for bucket in (exact, padded):
        pool = StatePool(tiny.cfg, SLOTS, max_context=128, dtype=torch.float32)
        for i, t in enumerate(pool.tensors()):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
        buckets = BucketSet(decode=(8,), mixed_decode=(8,), prefill=(48,), max_prefill_seqs=MAX_SEQS)
        runner = StepRunner(tiny, pool, buckets, max_decode=MAX_DECODE, max_prefill_tokens=MAX_TOKENS)
        results.append((runner.logits(plan, bucket).clone(), [t.clone() for t in pool.tensors()]))
    (a, pool_a), (b, pool_b) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for x, y in zip(pool_a, pool_b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def _inputs_arrays(buffers: StepBuffers, bucket: Bucket) -> dict[str, np.ndarray]:
    """Every array a step of ``bucket`` reads from the host arena, by name."""
    inputs = buffers.inputs(bucket)
    out = {k: getattr(inputs, k).numpy().copy() for k in ("input_ids", "decode_slots", "decode_kv_lens", "logit_rows",
                                                           "row_slots", "route_as")}
    for prefix, meta in (("prefill.", inputs.prefill), ("replay.", inputs.replay and inputs.replay.meta)):
        if meta is not None:
            out.update({prefix + k: v.numpy().copy() for k, v in meta.arrays().items()})
    if inputs.replay is not None:
        out.update({f"replay.{k}": getattr(inputs.replay, k).numpy().copy() for k in ("src", "own", "record")})
    return out


@st.composite
def verify_steps(draw):
    """A speculating batch's verify plans: up to 3 sequences of a token and up to 4 drafts, each
    replaying up to 4 kept rows, after a context that grows; shapes drawn from a few, so they
    repeat; now and then a prompt chunk instead."""
    shapes = draw(st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=3),
                                     st.booleans()), min_size=1, max_size=3))
    steps = []
    for i in range(draw(st.integers(2, 10))):
        seqs, with_context = shapes[draw(st.integers(0, len(shapes) - 1))]
        if draw(st.integers(0, 5)) == 0:
            steps.append((StepPlan.make([(list(range(1, 1 + draw(st.integers(1, 30)))), 5, 10 * i)]), Bucket(0, 32)))
            continue
        lens = np.asarray([1 + d for d, _ in seqs], np.int32)
        context = np.asarray([10 * i + 7 * j if with_context else 0 for j in range(len(seqs))], np.int32)
        plan = StepPlan(prefill_tokens=np.arange(1, 1 + lens.sum()), prefill_lens=lens,
                        prefill_slots=np.arange(len(seqs), dtype=np.int32), prefill_context=context,
                        snapshot_slots=np.arange(len(seqs), dtype=np.int32), snapshot_tokens=np.ones(len(seqs), np.int32),
                        final_slots=np.full(len(seqs), -1, np.int32), prefill_logits=lens,
                        replay_lens=np.asarray([r for _, r in seqs], np.int32))
        steps.append((plan, Bucket(0, 16, 4)))
    return steps


@settings(max_examples=60, deadline=None)
@given(steps=verify_steps())
def test_a_refilled_shape_writes_what_a_first_fill_writes(steps):
    """Refills whose shape came before copy its metadata back (``METADATA_SHAPES``), the context
    written anew: every array a step reads equals a fresh buffer's fill of the same plan, step
    after step, shapes repeating, prompt chunks between."""
    kept = StepBuffers(MAX_DECODE, MAX_TOKENS, MAX_SEQS, CHUNK, max_drafts=4, record_stride=4)
    for plan, bucket in steps:
        fresh = StepBuffers(MAX_DECODE, MAX_TOKENS, MAX_SEQS, CHUNK, max_drafts=4, record_stride=4)
        kept.fill(plan, bucket)
        fresh.fill(plan, bucket)
        got, want = _inputs_arrays(kept, bucket), _inputs_arrays(fresh, bucket)
        for name in want:
            assert np.array_equal(got[name], want[name]), name
    assert len(kept._metadata) <= len({(b, p.prefill_lens.tobytes(), p.replay_lens.tobytes(),
                                         (p.prefill_context > 0).tobytes()) for p, b in steps})
