"""The prefix cache: a request restored from a snapshot gives exactly the tokens and logits it
gives on an engine without one, in the shapes that broke peers' caches; the cache's own
bookkeeping (the longest prefix, LRU eviction, a chain with a hole)."""

import numpy as np
import pytest
import torch

from mambastep import Engine, SamplingParams
from mambastep.graphs import BucketSet
from mambastep.runtime.model import Model
from mambastep.runtime.prefix_cache import PrefixCache

# tiny-hybrid: chunk_size 32 (the block), conv_kernel 4; prefill chunks of up to 64 tokens
BUCKETS = BucketSet(decode=(1, 2, 4), mixed_decode=(0, 2, 4), prefill=(16, 64), max_prefill_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return Model.from_preset("tiny-hybrid", dtype=torch.float32)


def engine(model, cache_slots=0, **kw):
    return Engine(model, num_slots=4, max_context=512, buckets=BUCKETS, prefix_cache_slots=cache_slots,
                  progress=False, **kw)


def tokens(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_longest_prefix_is_found_and_verified():
    cache = PrefixCache(slots=[7, 8], block=4)
    prompt = np.arange(1, 20)
    assert cache.lookup(prompt) is None
    assert cache.claim(prompt, 8) == 7 and cache.claim(prompt, 16) == 8  # the slots in order
    assert cache.claim(prompt, 8) is None  # cached already
    assert cache.lookup(prompt) == (8, 16)
    assert cache.lookup(prompt[:16]) == (7, 8)  # one token is left to prefill
    other = prompt.copy()
    other[5] = 99  # diverges inside the second block: only the first is shared, and it is not cached
    assert cache.lookup(other) is None
    with pytest.raises(ValueError, match="not a block boundary"):
        cache.claim(prompt, 6)


def test_the_least_recently_used_snapshot_goes_and_a_longer_one_outlives_a_shorter():
    cache = PrefixCache(slots=[0, 1], block=4)
    a, b = np.arange(1, 13), np.arange(100, 112)
    cache.claim(a, 4)
    cache.claim(a, 8)
    cache.lookup(a[:5])  # a's first block, used most recently
    assert cache.claim(b, 4) is not None  # evicts a's 8-token snapshot
    assert cache.stats["evictions"] == 1 and cache.lookup(a) == (cache.lookup(a)[0], 4)
    cache.claim(a, 8)  # evicts b's; then a's first block goes, its longer prefix stays
    cache.claim(b, 4)
    assert cache.lookup(a) is not None and cache.lookup(a)[1] == 8


@torch.no_grad()
def test_a_resent_conversation_restores_and_gives_the_same_tokens(model):
    """Turn 2 resends turn 1 and its answer: it restores the longest whole-block prefix and
    prefills only the rest, and its tokens equal a fresh engine's without a cache."""
    turn1 = tokens(100, 0)
    cached, fresh = engine(model, 4), engine(model)
    out1 = cached.generate([turn1], GREEDY)[0]
    assert out1 == fresh.generate([turn1], GREEDY)[0]
    turn2 = turn1 + out1 + tokens(30, 1)
    assert cached.generate([turn2], GREEDY)[0] == engine(model).generate([turn2], GREEDY)[0]
    stats = cached.prefix_cache.stats
    assert stats["hits"] == 1 and stats["tokens_restored"] == 96  # turn 1's three whole blocks


@pytest.mark.parametrize("case", ["suffix shorter than the conv", "diverges inside a block", "one block exactly",
                                  "seeded sampling", "two prompts in one step"])
@torch.no_grad()
def test_restored_requests_equal_fresh_ones(model, case):
    base = tokens(70, 2)
    cached = engine(model, 4)
    # snapshots at chunk ends on block boundaries: 32 (the 40-token prompt's last), 64 (the 70's)
    cached.generate([base[:40], base], GREEDY)
    assert len(cached.prefix_cache) == 2 and cached.prefix_cache.stats["tokens_restored"] == 0
    params = GREEDY
    prompts = {
        "suffix shorter than the conv": [base[:66]],  # restores 64, prefills 2 tokens (conv window 3)
        "diverges inside a block": [base[:40] + tokens(20, 3)],  # restores 32
        "one block exactly": [base[:32]],  # restores nothing: a token must be left to prefill
        "seeded sampling": [base[:64] + [7]],
        "two prompts in one step": [base[:65], base[:33] + tokens(9, 4)],
    }[case]
    if case == "seeded sampling":
        params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
    got = cached.generate(prompts, params)
    assert got == engine(model).generate(prompts, params)
    restored = cached.prefix_cache.stats["tokens_restored"]
    expect = {"suffix shorter than the conv": 64, "diverges inside a block": 32, "one block exactly": 0,
              "seeded sampling": 64, "two prompts in one step": 64 + 32}[case]
    assert restored == expect


@torch.no_grad()
def test_logits_of_a_restored_prompt_are_bit_equal(model):
    """The exactness argument, checked directly: a prefill resumed from a block-boundary
    snapshot computes what the whole prefill does, to the bit."""
    prompt = tokens(90, 5)
    plain = engine(model)
    cached = engine(model, 2)
    cached.generate([prompt[:70]], GREEDY)
    outs = []
    for e in (plain, cached):
        rid = e.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=5, ignore_eos=True))
        outs.append([o for _ in range(8) for o in e.step() if o.id == rid][0])
    assert cached.prefix_cache.stats["tokens_restored"] == 64
    assert outs[0].logprobs == outs[1].logprobs


@torch.no_grad()
def test_eviction_while_a_restored_request_runs(model):
    """One snapshot slot: a request restores from it, then a new prompt's snapshot takes the
    slot while the first is still decoding; both equal fresh engines."""
    a, b = tokens(80, 6), tokens(80, 7)
    cached = engine(model, 1)
    cached.generate([a[:70]], GREEDY)
    ra = cached.add_request(a, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    rb = cached.add_request(b, GREEDY)
    out = {ra: [], rb: []}
    while cached.has_unfinished():
        for o in cached.step():
            out[o.id] += o.new_tokens
    assert cached.prefix_cache.stats["evictions"] >= 1
    assert out[ra] == engine(model).generate([a], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out[rb] == engine(model).generate([b], GREEDY)[0]


@pytest.mark.parametrize("pipelined", [False, True])
@torch.no_grad()
def test_restored_requests_with_processors_see_their_whole_prompt(model, pipelined):
    """A repetition penalty reads the prompt's tokens from the slot's tables, and a bias its
    entries: a restored request starts its tables there (its bias, the restored tokens marked),
    so its tokens equal a fresh engine's, whatever the slot held before."""
    prompt = tokens(70, 8)
    cached = engine(model, 2, pipelined=pipelined)
    cached.generate([prompt, tokens(40, 9)], SamplingParams(temperature=0, max_tokens=6, frequency_penalty=2.0,
                                                            logit_bias={3: 5.0}, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.8, presence_penalty=1.5,
                            logit_bias={7: 2.0}, min_tokens=3, ignore_eos=False)
    resent = prompt + [5]
    assert cached.generate([resent], params) == engine(model).generate([resent], params)
    assert cached.prefix_cache.stats["tokens_restored"] == 64


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("pipelined", [False, True])
@torch.no_grad()
def test_conversations_through_the_engine_equal_fresh_engines(device, pipelined):
    """Three turns of two conversations, each turn resending the whole of it, stepped together
    (pipelined too; on a GPU in fp32 through the Triton kernels and the captured graphs): every
    turn's tokens equal a fresh engine's, and the later turns restore."""
    m = Model.from_preset("tiny-hybrid", dtype=torch.float32, device=device)
    cached = Engine(m, num_slots=4, max_context=512, buckets=BUCKETS, prefix_cache_slots=4, pipelined=pipelined,
                    progress=False)
    convs = [tokens(45, 10), tokens(90, 11)]
    for turn in range(3):
        got = cached.generate(convs, GREEDY)
        fresh = Engine(m, num_slots=4, max_context=512, buckets=BUCKETS, use_graphs=False, progress=False)
        assert got == fresh.generate(convs, GREEDY), f"turn {turn}"
        convs = [c + out + tokens(7, 20 + turn) for c, out in zip(convs, got)]
    assert cached.prefix_cache.stats["hits"] >= 4
