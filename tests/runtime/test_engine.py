"""The Engine's step() API end to end on CPU, against HF generate."""

import numpy as np
import pytest
import torch

from hf_models import VOCAB
from mambastep.graphs import BucketSet
from mambastep.runtime.engine import Engine, SamplingParams

# A small prefill budget (16 tokens a step) forces chunked prefill, and 3 slots force queueing.
BUCKETS = BucketSet(decode=(1, 2, 4), mixed_decode=(0, 2, 4), prefill=(8, 16), max_prefill_seqs=2)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(lens, seed=0):
    g = np.random.default_rng(seed)
    return [g.integers(1, VOCAB, n).tolist() for n in lens]


def engine_for(path, **kw):
    kw.setdefault("num_slots", 3)
    kw.setdefault("device", "cpu")
    return Engine.from_pretrained(path, dtype=torch.float32, buckets=BUCKETS, max_context=128, **kw)


def run_staggered(engine, arrivals, params=GREEDY):
    """arrivals: {step index: [prompts]}; returns {request id: tokens}, ids in arrival order."""
    out, ids, k = {}, [], 0
    while k <= max(arrivals) or engine.has_unfinished():
        for p in arrivals.get(k, []):
            ids.append(engine.add_request(p, params))
        for o in engine.step():
            out.setdefault(o.id, []).extend(o.new_tokens)
        k += 1
    return [out[i] for i in ids]


@pytest.mark.parametrize("pipelined", [False, True])
def test_staggered_requests_equal_hf_greedy(checkpoint, pipelined):
    hf, path = checkpoint
    ps = prompts([5, 23, 1, 40, 9, 17], seed=1)
    got = run_staggered(engine_for(path, pipelined=pipelined), {0: ps[:2], 1: ps[2:3], 4: ps[3:5], 9: ps[5:]})
    for p, tokens in zip(ps, got):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
        assert tokens == ref[0, len(p):].tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent(checkpoint):
    _, path = checkpoint
    p = prompts([7], seed=2)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = engine_for(path).generate([p], params)[0]
    engine = engine_for(path)
    crowd = [engine.add_request(q, SamplingParams(temperature=0.7, seed=i, max_tokens=6))
             for i, q in enumerate(prompts([3, 30], seed=3))]
    mine = engine.add_request(p, params)
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.id, []).extend(o.new_tokens)
    assert got[mine] == alone
    assert all(len(got[i]) > 0 for i in crowd)
    unseeded = engine_for(path).generate([p] * 2, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True))
    assert unseeded[0] != alone or unseeded[1] != alone


def test_top_k_one_equals_greedy(checkpoint):
    _, path = checkpoint
    ps = prompts([6, 11], seed=4)
    greedy = engine_for(path).generate(ps, GREEDY)
    top1 = engine_for(path).generate(ps, SamplingParams(temperature=0.9, top_k=1, max_tokens=12, ignore_eos=True))
    assert top1 == greedy


def test_abort_in_prefill_and_in_queue_spares_the_others(checkpoint):
    _, path = checkpoint
    keep = prompts([9, 14], seed=5)
    ref = engine_for(path).generate(keep, GREEDY)

    engine = engine_for(path, num_slots=2)
    a = engine.add_request(keep[0], GREEDY)
    long_prompt = engine.add_request(prompts([60], seed=6)[0], GREEDY)  # needs 4 prefill steps
    got = {}
    for o in engine.step():  # a prefills whole, long_prompt gets its first chunk
        got.setdefault(o.id, []).extend(o.new_tokens)
    engine.abort(long_prompt)  # mid-prefill
    b = engine.add_request(keep[1], GREEDY)  # takes the freed slot
    queued = engine.add_request(prompts([4], seed=7)[0], GREEDY)  # both slots are taken
    for _ in range(4):
        for o in engine.step():
            got.setdefault(o.id, []).extend(o.new_tokens)
    assert [r.id for r in engine.scheduler.waiting] == [queued]
    engine.abort(queued)
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.id, []).extend(o.new_tokens)
    assert got[a] == ref[0] and got[b] == ref[1]
    assert long_prompt not in got and queued not in got
    assert sorted(engine.scheduler.free_slots) == [0, 1]


def test_abort_mid_decode(checkpoint):
    _, path = checkpoint
    ps = prompts([8, 8], seed=8)
    ref = engine_for(path).generate(ps[:1], GREEDY)[0]
    engine = engine_for(path)
    keep, drop = engine.add_request(ps[0], GREEDY), engine.add_request(ps[1], GREEDY)
    got = {}
    for _ in range(3):
        for o in engine.step():
            got.setdefault(o.id, []).extend(o.new_tokens)
    assert len(got[drop]) >= 2  # it is decoding
    engine.abort(drop)
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.id, []).extend(o.new_tokens)
    assert got[keep] == ref
    assert len(engine.scheduler.free_slots) == 3


@pytest.mark.parametrize("bad, match", [
    ([], "non-empty"),
    ([1, VOCAB], "outside the vocabulary"),
    ([-1, 2], "outside the vocabulary"),
    ([1.5, 2.0], "integer"),
    ([5] * 128, "max_context"),
])
def test_bad_prompts_raise_and_the_engine_goes_on(checkpoint, bad, match):
    _, path = checkpoint
    engine = engine_for(path)
    ok = engine.add_request([3, 4, 5], GREEDY)
    with pytest.raises(ValueError, match=match):
        engine.add_request(bad, GREEDY)
    got = []
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.id == ok for t in o.new_tokens]
    assert len(got) == GREEDY.max_tokens


def test_bad_params_and_unknown_ids(checkpoint):
    _, path = checkpoint
    engine = engine_for(path)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1, 2], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="params"):
        engine.add_request([1, 2], {"temperature": 0})
    with pytest.raises(KeyError, match="unknown request id 99"):
        engine.abort(99)
    assert engine.generate([[1, 2]], GREEDY)[0]


def test_stop_tokens_and_max_tokens(checkpoint):
    _, path = checkpoint
    p = prompts([6], seed=9)[0]
    free = engine_for(path).generate([p], GREEDY)[0]
    stop_at = free[4]
    stopped = engine_for(path).generate([p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_at,)))[0]
    assert stopped == free[: free.index(stop_at) + 1]
    assert len(engine_for(path).generate([p], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]) == 3


@pytest.mark.gpu
def test_graphs_and_eager_engines_agree_on_gpu(checkpoint):
    _, path = checkpoint
    ps = prompts([5, 23, 1, 40, 9], seed=10)
    kw = dict(dtype=torch.bfloat16, device="cuda", buckets=BUCKETS, max_context=128, progress=False)
    eager = Engine.from_pretrained(path, use_graphs=False, **kw).generate(ps, GREEDY)
    graphed = Engine.from_pretrained(path, use_graphs=True, **kw)
    assert graphed.capture_report is not None
    assert graphed.generate(ps, GREEDY) == eager
    pipelined = Engine.from_pretrained(path, use_graphs=True, pipelined=True, **kw)
    assert pipelined.generate(ps, GREEDY) == eager
