"""Speculative decoding end to end on CPU: with drafts accepted, partly accepted and rejected,
a request's tokens are the plain engine's, greedy and seeded sampling alike."""

import numpy as np
import pytest
import torch

from hf_models import VOCAB, save_tiny
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


@pytest.fixture(scope="module", params=["mamba2", "nemotron_h"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, path)
    hf.generation_config.eos_token_id = None
    return hf, path


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
    return [list(g.integers(1, VOCAB, 6)) * 4, g.integers(1, VOCAB, 37).tolist(), [7], g.integers(1, VOCAB, 11).tolist()]


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
                                                    max_batch=max_batch))
        assert run(spec, ps, params) == plain, (k, max_batch, wrong)
        stats = spec.speculative_stats
        print(k, max_batch, wrong, stats)
        assert stats["verified"] > 0
        if wrong == 0:  # all drafts of the plain run's tokens are accepted
            assert stats["accepted"] == stats["drafts"] > 0
        if wrong == 1:
            assert stats["accepted"] == 0
    ngram = engine(path, speculative=Speculative(drafter=NgramDrafter, num_drafts=3))
    assert run(ngram, ps, params) == plain
    print(ngram.speculative_stats)
