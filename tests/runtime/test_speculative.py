"""Speculative decoding end to end on CPU: with drafts accepted, partly accepted and rejected,
a request's tokens are the plain engine's, greedy and seeded sampling alike."""

import dataclasses

import numpy as np
import pytest
import torch

from hf_models import VOCAB
from mambastep.graphs import BucketSet
from mambastep.runtime.engine import Engine, SamplingParams
from mambastep.runtime.ngram_drafter import NgramDrafter
from mambastep.runtime.speculative import Speculative, accepted

# 16 prefill tokens a step: prompts chunk, and verify sequences share steps with prompt chunks
BUCKETS = BucketSet(decode=(1, 2, 4), mixed_decode=(0, 2, 4), prefill=(8, 16), max_prefill_seqs=3)
MAX_TOKENS = 14


class Scripted:
    """Drafts the continuation a plain run produced (``script``: prompt tuple -> its tokens), each
    draft replaced by a wrong token with probability ``wrong``: every acceptance length occurs."""

    def __init__(self, script, wrong, seed=0):
        self.script, self.wrong, self.rng = script, wrong, np.random.default_rng(seed)

    def draft(self, context, k):
        for prompt, out in self.script.items():
            if len(context) >= len(prompt) and tuple(context[: len(prompt)]) == prompt:
                done = len(context) - len(prompt)
                drafts = list(out[done : done + k])
                return [(t + 1) % VOCAB if self.rng.random() < self.wrong else t for t in drafts]
        return []


def test_accepted_counts_drafts_while_each_equals_the_draw_before_it():
    assert accepted([], [5]) == 0
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted([5, 6, 7], [4, 6, 7, 8]) == 0


def engine(path, **kw):
    return Engine.from_pretrained(path, dtype=torch.float32, device="cpu", buckets=BUCKETS, num_slots=4,
                                  max_context=96, **kw)


def run(engine, prompts, params, arrivals=(0, 0, 1, 3)):
    """Requests arriving at the given steps; returns each one's tokens, in order."""
    out, ids, step = {}, [], 0
    while len(ids) < len(prompts) or engine.has_unfinished():
        while len(ids) < len(prompts) and arrivals[len(ids)] <= step:
            ids.append(engine.add_request(prompts[len(ids)], params))
        for o in engine.step():
            out.setdefault(o.id, []).extend(o.new_tokens)
        step += 1
    return [out[i] for i in ids]


def prompts():
    g = np.random.default_rng(3)
    # a repeating prompt (n-gram drafts hit), a long one (chunks), a short one, a middling one
    return [list(g.integers(1, VOCAB, 6)) * 4, g.integers(1, VOCAB, 37).tolist(), [7],
            g.integers(1, VOCAB, 11).tolist()]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_speculative_tokens_equal_plain(checkpoint, params):
    _, path = checkpoint
    ps = [[int(t) for t in p] for p in prompts()]
    plain = run(engine(path), ps, params)
    script = {tuple(p): out for p, out in zip(ps, plain)}
    for k, max_batch, wrong in [(1, 4, 0.0), (3, 4, 0.3), (4, 2, 0.5), (2, 4, 1.0)]:
        spec = engine(path, speculative=Speculative(drafter=lambda: Scripted(script, wrong), num_drafts=k,
                                                    max_batch=max_batch, adaptive=False))
        assert run(spec, ps, params) == plain, (k, max_batch, wrong)
        stats = spec.speculative_stats
        print(k, max_batch, wrong, stats)
        assert stats["verified"] > 0
        if wrong == 0:  # all drafts of the plain run's tokens are accepted
            assert stats["accepted"] == stats["drafts"] > 0
        if wrong == 1:
            assert stats["accepted"] == 0
    ngram = engine(path, speculative=Speculative(drafter=NgramDrafter, num_drafts=3, adaptive=False))
    assert run(ngram, ps, params) == plain
    print(ngram.speculative_stats)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_requests_that_do_not_speculate_verify_beside_those_that_do(checkpoint, params):
    """A request that opted out (or an engine whose default is off, and a request that opted in)
    runs beside speculating ones in their verify steps, as a sequence without drafts; every
    request's tokens are the plain engine's, and it goes on decoding in decode rows after
    (its slot's next input written by that draftless row)."""
    _, path = checkpoint
    ps = [[int(t) for t in p] for p in prompts()]
    plain = run(engine(path), ps, params)
    script = {tuple(p): out for p, out in zip(ps, plain)}
    for default in (True, False):
        e = engine(path, speculative=Speculative(drafter=lambda: Scripted(script, 0.3), num_drafts=3,
                                                 max_batch=4, adaptive=False, default=default))
        # what each step verified: (speculates, drafts) of each sequence
        verified: dict[int, list] = {}
        schedule_one = e.scheduler._verify_sequence

        def spy(r, budget):
            verified.setdefault(step, []).append((r.drafter is not None, len(r.verify)))
            return schedule_one(r, budget)

        e.scheduler._verify_sequence = spy
        out, ids, step = {}, [], 0
        while len(ids) < len(ps) or e.has_unfinished():
            while len(ids) < len(ps) and (0, 0, 1, 3)[len(ids)] <= step:
                # requests 0 and 2 speculate; 1 and 3 opt out (default on) or leave it to the default (off)
                opt = (None if len(ids) % 2 == 0 else False) if default else (True if len(ids) % 2 == 0 else None)
                ids.append(e.add_request(ps[len(ids)], dataclasses.replace(params, speculative=opt)))
            for o in e.step():
                out.setdefault(o.id, []).extend(o.new_tokens)
            step += 1
        assert [out[i] for i in ids] == plain, default
        assert e.speculative_stats["verified"] > 0
        # steps that verified drafts with a request that does not speculate beside them
        assert any(any(d for _, d in seqs) and not all(spec for spec, _ in seqs) for seqs in verified.values())
        assert all(d == 0 for seqs in verified.values() for spec, d in seqs if not spec)


class Never:
    def draft(self, context, k):
        return []


def test_a_step_whose_requests_draft_nothing_decodes_as_usual(checkpoint):
    """Prompt lookup that finds no match costs nothing: with no drafts the requests decode a
    token each in decode rows, not in prefill form."""
    _, path = checkpoint
    e = engine(path, speculative=Speculative(drafter=Never, num_drafts=3, adaptive=False), trace=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ps = [[int(t) for t in p] for p in prompts()]
    assert run(e, ps, params) == run(engine(path), ps, params)
    assert all(s.drafts == 0 for s in e.trace) and e.speculative_stats["verified"] == 0
    # the prompts' tokens are the only ones prefilled: every drawn token went in as a decode row
    assert sum(s.prefill_tokens for s in e.trace) == sum(len(p) for p in ps)
    assert sum(s.decode for s in e.trace) == len(ps) * (MAX_TOKENS - 1)


def test_the_gate_measures_each_arm_then_takes_what_pays_and_explores():
    from mambastep.runtime.speculative import Gate

    g = Gate(explore=4)  # one verify arm, 4 drafts; two steps of each arm measured
    assert g.choose(2) == 4  # nothing measured: verify first
    g.verified(2, seconds=3.0, outcomes=[(4, 0), (4, 0)])
    assert g.choose(2) == 4
    g.verified(2, seconds=9.0, outcomes=[(4, 0), (4, 1)])  # (a slow step: the least of an arm's counts)
    assert [g.choose(2), g.choose(2)] == [0, 0]
    g.decoded(2, seconds=1.0)
    g.decoded(2, seconds=1.0)
    assert g.rate(2, 4) == pytest.approx(g.tokens(4) / 3.0) and g.rate(2, 0) == 1.0
    # 1 draft kept of 5 tried: a sequence yields about 1.5 tokens in 3 s, against 1 token in 1 s;
    # decoding pays. The 4th decision explores, then the 8th after it
    assert [g.choose(2) for _ in range(12)] == [0] * 3 + [4] + [0] * 7 + [4]
    for _ in range(3):  # the drafts start to hold
        g.verified(2, seconds=3.0, outcomes=[(4, 4), (4, 4)])
    assert g.acceptance > 0.8 and g.choose(2) == 4
    assert g.choose(1) == 4 and (1, 0) not in g.seconds  # each batch size's seconds on its own
    with pytest.raises(ValueError, match="2 drafts kept of 1"):
        g.verified(2, 3.0, [(1, 2)])


def test_the_gate_takes_the_number_of_drafts_that_pays_best():
    """Arms of 1, 2 and 4 drafts and decoding, each measured twice, most drafts first; then the
    best by tokens a second, with the tokens modelled from every arm's drafts pooled; the others
    explored in turn; a verify step counts for the arm taken."""
    from mambastep.runtime.speculative import Gate, draft_ladder

    assert draft_ladder(4) == (1, 2, 4) and draft_ladder(3) == (1, 2, 3) and draft_ladder(1) == (1,)
    g = Gate(drafts=draft_ladder(4), explore=2)
    # a MoE's verify steps: each draft's experts cost more; the drafts hold 60% of their tries
    seconds = {1: 3.9, 2: 4.0, 4: 5.4}
    outcomes = {4: ([(4, 2)], [(4, 1)]), 2: ([(2, 2)], [(2, 0)]), 1: ([(1, 1)], [(1, 0)])}
    for k in (4, 2, 1):
        for kept in outcomes[k]:
            assert g.choose(1) == k
            g.verified(1, seconds[k], kept)
    assert g.acceptance == pytest.approx(7 / 11, abs=0.02)  # 6 kept of 10 tried, beside the prior's 1 of 1
    assert [g.choose(1), g.choose(1)] == [0, 0]
    g.decoded(1, 5.0)
    g.decoded(1, 5.0)  # a slow decode step: 0.2 tokens/s, where 2 drafts give 2.04 / 4.0 = 0.51
    assert g.tokens(2) == pytest.approx(1 + g.acceptance + g.acceptance ** 2)
    # the 2nd decision explores, then the 4th after it, the 8th after that: the others in turn
    assert [g.choose(1) for _ in range(14)] == [2, 0] + [2, 2, 2, 1] + [2] * 7 + [4]
    for _ in range(4):  # decode steps grow fast: decoding pays best
        g.decoded(1, 1.0)
    assert g.choose(1) == 0
    with pytest.raises(ValueError, match="drafts: expected ints >= 1"):
        Gate(drafts=(0, 2))
    with pytest.raises(ValueError, match="window: expected an int >= 1, got 0"):
        Gate(window=0)
    with pytest.raises(ValueError, match=r"decay: expected a fraction in \(0, 1\], got 1.5"):
        Gate(decay=1.5)


def test_what_the_gate_knew_of_failing_drafts_fades_until_they_are_worth_another_look():
    """Drafts that all failed make decoding pay; decision by decision the counts fade towards
    the prior (one kept of one), until a verify step is worth trying again: a drafter that
    starts to hold is found, at a cost that falls with how long it failed."""
    from mambastep.runtime.speculative import Gate

    g = Gate(max_explore=1 << 20, explore=1 << 20)  # no scheduled exploration
    for _ in range(2):
        assert g.choose(1) == 4
        g.verified(1, 3.0, [(4, 0)] * 4)
    for _ in range(2):
        assert g.choose(1) == 0
        g.decoded(1, 1.0)
    waited = next(i for i in range(1000) if g.choose(1) != 0)  # (1000: never)
    assert 100 < waited < 400 and g.tokens(4) > 3.0


@pytest.mark.parametrize("pays", [False, True])
def test_an_adaptive_engine_speculates_where_the_gate_finds_it_pays(checkpoint, pays):
    """The gate, told a verify step costs a million times a decode step (or nothing), keeps the
    engine decoding (or verifying, with the drafts it chose: 1 of the engine's 4); the tokens are
    the same either way."""
    from mambastep.runtime.speculative import Gate

    _, path = checkpoint
    ps = [[int(t) for t in p] for p in prompts()][:1]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = run(engine(path), ps, params, arrivals=(0,))
    script = {tuple(ps[0]): plain[0]}
    e = engine(path, speculative=Speculative(drafter=lambda: Scripted(script, 0.0), num_drafts=4), trace=True)
    e.scheduler.gate = Gate(drafts=(1,), samples=1)
    e.scheduler.gate.decoded(1, 1.0 if pays else 1e-6)
    e.scheduler.gate.verified(1, 1e-6 if pays else 1e6, [(1, 1)])
    assert run(e, ps, params, arrivals=(0,)) == plain
    assert (e.speculative_stats["verified"] > 0) == pays
    if pays:  # the engine told the gate each sequence's drafts: offered, and (the script's) every one kept
        assert e.scheduler.gate.tried > 0 and e.scheduler.gate.kept == e.scheduler.gate.tried
    assert {s.drafts for s in e.trace} == ({0, 1} if pays else {0})


def test_speculation_with_choices_logprobs_and_a_prefix_cache(checkpoint):
    """A prompt of two seeded choices and a greedy request resending it, with logprobs, on an
    engine that speculates and keeps a prefix cache: the tokens are the plain engine's and the
    logprobs agree (fp32: the verify rows' logits to rounding)."""
    _, path = checkpoint
    ps = [[int(t) for t in p] for p in prompts()]
    sampled = SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)

    def outputs(e):
        ids = e.add_choices(ps[0], sampled, n=2) + [e.add_request(ps[0] + ps[1][:9], greedy)]
        got = {i: ([], []) for i in ids}
        while e.has_unfinished():
            for o in e.step():
                got[o.id][0].extend(o.new_tokens)
                got[o.id][1].extend(lp.logprob for lp in o.logprobs)
        return [got[i] for i in ids]

    plain = outputs(engine(path))
    spec = engine(path, prefix_cache_slots=2,
                  speculative=Speculative(drafter=lambda: Scripted({tuple(ps[0]): plain[0][0]}, 0.2), num_drafts=3,
                                          adaptive=False))
    for (tokens, logprobs), (want, want_logprobs) in zip(outputs(spec), plain):
        assert tokens == want
        assert np.allclose(logprobs, want_logprobs, atol=1e-4)
    assert spec.speculative_stats["accepted"] > 0


def test_a_draft_model_drafts_and_the_tokens_stay_the_target_s(checkpoint):
    """A draft model named by its checkpoint directory (here the target's own, so in fp32 its
    greedy drafts hold), on an engine the target's engine builds: the tokens the plain engine's,
    greedy and seeded, and greedy most drafts kept."""
    _, path = checkpoint
    ps = [[int(t) for t in p] for p in prompts()]
    for params in (SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                   SamplingParams(temperature=0.9, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)):
        e = engine(path, speculative=Speculative(draft_model=str(path), num_drafts=3, adaptive=False))
        assert run(e, ps, params) == run(engine(path), ps, params)
        stats = e.speculative_stats
        assert stats["verified"] > 0
        if params.greedy:  # (sampled from a tiny random model's flat distributions, few are)
            assert stats["accepted"] > 0.8 * stats["drafts"]
        assert e.draft_engine.prefix_cache.stats["hits"] > 0  # later drafts restore their context's blocks
    with pytest.raises(ValueError, match="is a checkpoint, its weights its own: no seed"):
        engine(path, speculative=Speculative(draft_model=str(path), draft_seed=1))


def test_a_preset_draft_model_of_the_target_s_weights_has_every_draft_kept():
    """A preset draft model from the target preset's seed is the target: every greedy draft is
    kept; from another seed it is another model, and the tokens stay the plain engine's."""
    ps = [[int(t) for t in p] for p in prompts()]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def preset_engine(**kw):
        return Engine.from_preset("tiny-hybrid", dtype=torch.float32, device="cpu", buckets=BUCKETS, num_slots=4,
                                  max_context=96, **kw)

    plain = run(preset_engine(), ps, params)
    for seed in (0, 1):
        e = preset_engine(speculative=Speculative(draft_model="tiny-hybrid", draft_seed=seed, num_drafts=3, adaptive=False))
        assert run(e, ps, params) == plain
        stats = e.speculative_stats
        assert stats["drafts"] > 0 and (stats["accepted"] == stats["drafts"]) == (seed == 0)
    with pytest.raises(ValueError, match="draft model: 'tiny-nope' is neither a checkpoint directory nor a preset"):
        preset_engine(speculative=Speculative(draft_model="tiny-nope"))
    with pytest.raises(ValueError, match="drafter and draft_model: give one of them"):
        Speculative(drafter=lambda: Scripted({}, 0.0), draft_model="tiny-hybrid")


def test_a_draft_model_must_cover_the_target_s_vocabulary(checkpoint):
    from mambastep.runtime.draft_model import draft_engine
    from mambastep.runtime.model import Model

    _, path = checkpoint
    with pytest.raises(ValueError, match=f"does not cover the target's {VOCAB + 1}"):
        draft_engine(Model.from_pretrained(path, dtype=torch.float32, device="cpu"), VOCAB + 1, max_context=100)


@pytest.mark.gpu
def test_a_draft_model_with_graphs_on_the_gpu():
    """On CUDA with graphs (fp32): the target preset drafting for itself through a draft engine of
    its own graphs keeps (nearly) every greedy draft, and the tokens are the plain engine's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ps = [[int(t) for t in p] for p in prompts()]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def preset_engine(**kw):
        return Engine.from_preset("tiny-nemotron-h", dtype=torch.float32, device="cuda", buckets=BUCKETS,
                                  num_slots=4, max_context=96, progress=False, **kw)

    e = preset_engine(speculative=Speculative(draft_model="tiny-nemotron-h", num_drafts=3, adaptive=False))
    assert e.draft_engine.capture_report is not None  # the draft engine replays graphs too
    assert run(e, ps, params) == run(preset_engine(), ps, params)
    stats = e.speculative_stats
    # (decode and verify kernels may sum in other orders: a near tie could flip a draft)
    assert stats["drafts"] > 0 and stats["accepted"] >= 0.9 * stats["drafts"]
