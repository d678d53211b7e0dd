"""Logits processors and log-probabilities through the Engine, against a reference loop that
recomputes HF's logits for the whole sequence each token and applies HF's processors and
OpenAI's formulas: requests with and without processors share steps, prompts chunk, slots are
reused."""

import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from hf_models import save_tiny
from mambastep.kernels.sample import sample_ref
from mambastep.runtime.engine import SamplingParams
from test_engine import engine_for, prompts, run_staggered


@pytest.fixture(scope="module", params=["mamba2", "nemotron_h"])
def checkpoint(request, tmp_path_factory):  # fp32; HF's generation stops at no EOS
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, path)
    hf.generation_config.eos_token_id = None
    return hf, path


@torch.no_grad()
def reference(hf, prompt, p: SamplingParams, seed: int):
    """(tokens, [(logprob, top ids)]) by recomputing the logits each token."""
    ids, out, lps = list(prompt), [], []
    for i in range(p.max_tokens):
        logits = hf(torch.tensor([ids])).logits[0, -1].float()
        if p.repetition_penalty != 1:
            logits = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([ids]), logits[None])[0]
        for j in set(out):
            logits[j] -= out.count(j) * p.frequency_penalty + p.presence_penalty
        for t, b in p.logit_bias:
            logits[t] += b
        if i < p.min_tokens:
            logits[list(p.stop_token_ids)] = -math.inf
        one = lambda x: torch.tensor([x])  # noqa: E731
        token = int(sample_ref(logits[None], one(float(p.temperature)), one(p.top_k), one(float(p.top_p)),
                               one(seed), one(i))[0])
        lp = torch.log_softmax(logits.double() / (p.temperature if not p.greedy else 1.0), dim=-1)
        lps.append((float(lp[token]), lp.argsort(descending=True)[:5].tolist(), lp.sort(descending=True)[0][:5]))
        out.append(token)
        ids.append(token)
        if token in p.stop_token_ids:
            break
    return out, lps


CASES = [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6, presence_penalty=1.5),
    dict(frequency_penalty=2.0),
    dict(presence_penalty=-2.0, frequency_penalty=0.5, logit_bias={3: 4.0, 11: -100.0}),
    dict(temperature=0.8, top_p=0.9, seed=7, frequency_penalty=1.0, repetition_penalty=1.2),
    dict(),  # no processors, sharing steps with the others
]


@pytest.mark.parametrize("device,pipelined", [("cpu", False), ("cpu", True),
                                             pytest.param("cuda", True, marks=pytest.mark.gpu)])
def test_processors_equal_the_reference_loop(checkpoint, device, pipelined):
    """On the GPU in CUDA graphs (fp32): every draw variant captured."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    hf, path = checkpoint
    ps = prompts([5, 40, 1, 23, 9, 17], seed=3)
    params = [SamplingParams(**{"temperature": 0.0, "max_tokens": 10, "ignore_eos": True, "logprobs": 5, **c})
              for c in CASES]
    engine = engine_for(path, pipelined=pipelined, device=device)
    tolerance = 1e-4 if device == "cpu" else 1e-3
    arrivals = {0: [0, 1], 1: [2], 4: [3, 4], 9: [5]}
    got, ids, logprobs, k = {}, [], {}, 0
    while k <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(k, []):
            ids.append(engine.add_request(ps[i], params[i]))
        for o in engine.step():
            got.setdefault(o.id, []).extend(o.new_tokens)
            logprobs.setdefault(o.id, []).extend(o.logprobs)
        k += 1
    for rid, prompt, p in zip(ids, ps, params):
        assert p.seed is not None or p.greedy  # an unseeded draw's seed is the engine's
        tokens, ref_lps = reference(hf, prompt, p, p.seed or 0)
        assert got[rid] == tokens, p
        for lp, (ref_lp, ref_top, ref_top_values) in zip(logprobs[rid], ref_lps):
            assert abs(lp.logprob - ref_lp) < tolerance
            assert [t for t, _ in lp.top] == ref_top
            np.testing.assert_allclose([v for _, v in lp.top], ref_top_values.numpy(), atol=tolerance)


def test_the_processors_change_the_output(checkpoint):
    """The reference loop could agree with the engine by both ignoring a processor: each one
    here changes the greedy output."""
    _, path = checkpoint
    engine = engine_for(path)
    p = prompts([12], seed=4)[0]
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = engine.generate([p], base)[0]
    first = plain[0]
    banned = engine.generate([p], SamplingParams(**{**_fields(base), "logit_bias": {first: -100}}))[0]
    assert banned[0] != first and first not in banned
    for change in (dict(repetition_penalty=3.0), dict(frequency_penalty=2.0), dict(presence_penalty=2.0)):
        assert engine.generate([p], SamplingParams(**{**_fields(base), **change}))[0] != plain, change


def test_min_tokens_holds_the_stop_tokens_back_then_lets_them_stop(checkpoint):
    _, path = checkpoint
    engine = engine_for(path)
    p = prompts([8], seed=5)[0]
    base = dict(temperature=0, max_tokens=12, ignore_eos=True)
    plain = engine.generate([p], SamplingParams(**base))[0]
    stop = plain[0]
    assert engine.generate([p], SamplingParams(**base, stop_token_ids=[stop]))[0] == [stop]
    held = engine.generate([p], SamplingParams(**base, stop_token_ids=[stop], min_tokens=3))[0]
    assert stop not in held[:3] and len(held) >= 3
    assert held[-1] == stop or len(held) == 12


def test_a_slot_reused_by_a_penalized_request_starts_clean(checkpoint):
    """A request with penalties in a slot that others used first equals it on a fresh engine."""
    _, path = checkpoint
    penalized = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, frequency_penalty=2.0,
                               repetition_penalty=1.5)
    p = prompts([6], seed=6)[0]
    alone = engine_for(path).generate([p], penalized)[0]
    engine = engine_for(path, num_slots=1)
    others = prompts([9, 30], seed=7)
    engine.generate(others, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=2.0))
    assert engine.generate([p], penalized)[0] == alone


def test_bad_processor_parameters_are_refused_by_name(checkpoint):
    _, path = checkpoint
    engine = engine_for(path)
    for kw, name in [(dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty="x"), "frequency_penalty"),
                     (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={1: 101}), "logit_bias"),
                     (dict(logit_bias={-1: 1}), "logit_bias"), (dict(logit_bias=[1, 2]), "logit_bias"),
                     (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(logprobs=21), "logprobs")]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="^logit_bias: token ids .* outside the vocabulary"):
        engine.add_request([1, 2], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="^logit_bias: 129 biased tokens"):
        engine.add_request([1, 2], SamplingParams(logit_bias={t: 1.0 for t in range(129)}))
    assert not engine.has_unfinished()


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def test_staggered_plain_requests_are_unchanged_by_the_logprobs_variant(checkpoint):
    """Logprobs are read beside the draw: the tokens are those of the same requests without."""
    _, path = checkpoint
    ps = prompts([5, 23, 1], seed=8)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with_lp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    a = run_staggered(engine_for(path), {0: ps[:2], 2: ps[2:]}, plain)
    b = run_staggered(engine_for(path), {0: ps[:2], 2: ps[2:]}, with_lp)
    assert a == b


def test_a_request_without_processors_never_reads_anothers_bias(checkpoint):
    """A plain request decodes through the steps that chunk a biased request's long prompt (the
    later chunks carry no admission): its tokens are its tokens alone, not the biased token."""
    _, path = checkpoint
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    short, long = prompts([3, 60], seed=9)
    alone = engine_for(path).generate([short], plain)[0]
    favoured = next(t for t in range(5, 90) if t not in alone)
    engine = engine_for(path)
    biased = engine.add_request(long, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                     logit_bias={favoured: 100.0}))
    rid = engine.add_request(short, plain)
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.id, []).extend(o.new_tokens)
    assert got[biased] == [favoured, favoured]
    assert got[rid] == alone


@pytest.mark.parametrize("pipelined", [False, True])
def test_n_choices_prefill_once_and_each_equals_its_seed_alone(checkpoint, pipelined):
    """A prompt of 4 choices (its prefix chunked over steps), beside another request holding a
    slot: each choice's tokens equal the request alone with seed + i; the prompt but its last
    token is prefilled once; with penalties the forked slots carry what the prompt has seen."""
    _, path = checkpoint
    prompt, other = prompts([40, 7], seed=10)
    for extra in ({}, {"repetition_penalty": 1.5, "presence_penalty": 1.0, "logit_bias": {4: 3.0}}):
        params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=8, ignore_eos=True, **extra)
        engine = engine_for(path, num_slots=5, pipelined=pipelined, trace=True)
        engine.add_request(other, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        ids = engine.add_choices(prompt, params, n=4)
        got = {i: [] for i in ids}
        while engine.has_unfinished():
            for o in engine.step():
                if o.id in got:
                    got[o.id] += o.new_tokens
        prefilled = sum(s.prefill_tokens for s in engine.trace)
        assert prefilled == len(other) + len(prompt) - 1 + 4  # the prefix once, the last token per choice
        for i, rid in enumerate(ids):
            alone = engine_for(path).generate([prompt], SamplingParams(**{**_fields(params), "seed": 123 + i}))[0]
            assert got[rid] == alone, (extra, i)
        assert len({tuple(t) for t in got.values()}) > 1  # the seeds differ


def test_n_choices_wait_for_slots_and_abort_before_the_fork(checkpoint):
    """Choices fork only when slots are free for all of them; one aborted before the fork never
    runs and the others do; more choices than slots is refused."""
    _, path = checkpoint
    prompt, other = prompts([20, 5], seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = engine_for(path, num_slots=3)
    busy = [engine.add_request(other, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for _ in range(2)]
    ids = engine.add_choices(prompt, greedy, n=3)
    engine.abort(ids[1])
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.id, []).extend(o.new_tokens)
    alone = engine_for(path).generate([prompt], greedy)[0]
    assert got[ids[0]] == got[ids[2]] == alone and ids[1] not in got and all(len(got[b]) == 12 for b in busy)
    assert sorted(engine.scheduler.free_slots) == [0, 1, 2]
    with pytest.raises(ValueError, match="^n: 4 choices"):
        engine.add_choices(prompt, greedy, n=4)


def test_prompts_of_several_choices_never_wait_on_each_other(checkpoint):
    """Found by the state machine: prefixes each holding a slot while waiting for free ones for
    their choices waited for ever. Two prompts of 4 choices on 4 slots, the second admitted while
    the first still prefills (16 tokens a step): both finish."""
    _, path = checkpoint
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine = engine_for(path, num_slots=4)
    ps = prompts([20, 20], seed=12)
    ids = [engine.add_choices(p, greedy, n=4) for p in ps]
    got = {}
    for _ in range(100):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            got.setdefault(o.id, []).extend(o.new_tokens)
    assert not engine.has_unfinished()
    for p, choice_ids in zip(ps, ids):
        alone = engine_for(path).generate([p], greedy)[0]
        assert [got[i] for i in choice_ids] == [alone] * 4


def test_a_slots_tables_cost_what_the_engine_budgets():
    from mambastep.runtime.slot_tokens_seen import SlotTokensSeen

    seen = SlotTokensSeen(num_slots=3, vocab_size=97, device="cpu")
    tables = (seen.counts, seen.prompt, seen.bias_ids, seen.bias_values, seen.bias_until)
    assert sum(t[0].numel() * t.element_size() for t in tables) == SlotTokensSeen.bytes_per_slot(97)
