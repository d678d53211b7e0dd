"""The prefix cache: a request restored from a snapshot gives exactly the tokens and logits it
gives on an engine without one, in the shapes that broke peers' caches; the cache's own
bookkeeping (the longest prefix, LRU eviction, a chain with a hole)."""

import numpy as np
import pytest
import torch

from mambastep import Engine, SamplingParams
from mambastep.graphs import BucketSet
from mambastep.runtime.model import Model
from mambastep.runtime.prefix_cache import Admission, Boundary, PrefixCache

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
    at = cache.boundaries(prompt)
    assert [b.end for b in at] == [4, 8, 12, 16]
    assert cache.admit(prompt) == Admission(None, (at[3],))  # nothing cached; its last boundary
    assert cache.claim(prompt, at[1]) == 7 and cache.claim(prompt, at[3]) == 8  # the slots in order
    assert cache.claim(prompt, at[1]) is None  # cached already
    assert cache.admit(prompt).restore == (8, 16)
    assert cache.admit(prompt[:16]).restore == (7, 8)  # one token is left to prefill
    other = prompt.copy()
    other[5] = 99  # diverges inside the second block: only the first is shared, and it is not cached
    assert cache.admit(other).restore is None
    with pytest.raises(ValueError, match="not a block boundary"):
        cache.claim(prompt, Boundary(6, at[1].key))


def test_a_prompt_snapshots_at_its_branch_point_and_its_last_boundary():
    """The first prompt of a shared prefix is snapshotted at its end only; the second at the
    deepest boundary the first shared with it too, and a third restores from there."""
    cache = PrefixCache(slots=[0, 1, 2, 3], block=4)
    shared = np.arange(1, 11)  # ten tokens: boundaries 4 and 8 inside
    a, b, c = (np.concatenate([shared, np.full(7, t)]) for t in (50, 60, 70))
    first = cache.admit(a)
    assert first.restore is None and [x.end for x in first.snapshot_at] == [16]
    second = cache.admit(b)
    assert second.restore is None and [x.end for x in second.snapshot_at] == [8, 16]
    for x in second.snapshot_at:
        cache.claim(b, x)
    third = cache.admit(c)
    assert third.restore == (cache.admit(shared).restore[0], 8) and [x.end for x in third.snapshot_at] == [16]
    resent = np.concatenate([b, [9, 9]])  # the next turn: restores b's whole 16, wants its own end
    turn = cache.admit(resent)
    assert turn.restore[1] == 16 and turn.snapshot_at == ()


def test_without_weights_the_least_recently_used_snapshot_goes():
    cache = PrefixCache(slots=[0, 1], block=4, flop_weight=0, share_weight=0, supersede=False, thrash_guard=False)
    a, b = np.arange(1, 13), np.arange(100, 112)
    (a4, a8, _), (b4, *_) = cache.boundaries(a), cache.boundaries(b)

    def claim(prompt, at):  # in a step of its own
        slot = cache.claim(prompt, at)
        cache.settle()
        return slot

    claim(a, a4)
    claim(a, a8)
    cache.admit(a[:5])  # a's first block, used most recently
    assert claim(b, b4) is not None  # evicts a's 8-token snapshot
    assert cache.stats["evictions"] == 1 and cache.admit(a).restore[1] == 4
    claim(a, a8)  # evicts b's; then a's first block goes, its longer prefix stays
    claim(b, b4)
    assert cache.admit(a).restore[1] == 8


def test_conversations_taken_in_turn_past_the_slots_keep_some_snapshots():
    """Five conversations in turn over four slots, each turn resending its conversation: LRU
    evicts each end just before its next turn and restores nothing; with the thrash guard, once
    an evicted end is wanted back, the most recent goes first and some conversations restore."""

    def restored(guard):
        cache = PrefixCache(slots=[0, 1, 2, 3], block=4, thrash_guard=guard)
        convs = [np.arange(100 * c + 1, 100 * c + 9) for c in range(5)]
        for turn in range(5):
            for c in range(5):
                if turn:
                    convs[c] = np.concatenate([convs[c], np.arange(1000 * turn + 10 * c, 1000 * turn + 10 * c + 4)])
                for at in cache.admit(convs[c]).snapshot_at:
                    cache.claim(convs[c], at)
                cache.settle()
        return cache.stats["hits"]

    assert restored(False) == 0 and restored(True) >= 5


def test_a_snapshot_claimed_for_a_step_is_not_evicted_before_the_step_is_launched():
    """Two sequences of one step must not write one slot: with one slot, the second claim of a
    step gets none; after the step (settle), a claim may evict the first."""
    cache = PrefixCache(slots=[0], block=4)
    a, b = np.arange(1, 9), np.arange(100, 108)
    assert cache.claim(a, cache.boundaries(a)[-1]) == 0
    assert cache.claim(b, cache.boundaries(b)[-1]) is None and cache.stats["evictions"] == 0
    cache.settle()
    assert cache.claim(b, cache.boundaries(b)[-1]) == 0 and cache.stats["evictions"] == 1


def test_eviction_keeps_long_and_shared_snapshots_over_more_recent_ones():
    """Scores: recency (rank, 0 to 1) + tokens over the longest + 1 where shared. A 16-token
    snapshot outlives newer 4-token ones; a branch point's outlives newer unshared ones as long;
    a conversation's end restored by its next turn, which snapshots past it, is superseded and
    goes first; restored by a second prompt too, it is shared."""
    def held(cache, prompt):  # the tokens restored for prompt and one more token
        hit = cache.admit(np.append(prompt, 0)).restore
        return 0 if hit is None else hit[1]

    def claim(cache, prompt):  # in a step of its own
        cache.claim(prompt, cache.boundaries(prompt)[-1])
        cache.settle()

    cache = PrefixCache(slots=[0, 1, 2, 3], block=4)
    long, shorts = np.arange(1, 17), [np.arange(t, t + 4) for t in (100, 200, 300, 400)]
    for p in [long, *shorts]:  # the fifth evicts: long 0 + 1, the first short 1/3 + 1/4
        claim(cache, p)
    assert held(cache, long) == 16 and held(cache, shorts[0]) == 0

    cache = PrefixCache(slots=[0, 1, 2], block=4)
    shared = np.arange(1, 9)
    cache.admit(np.append(shared, [50, 51]))
    (branch,) = cache.admit(np.append(shared, [60, 61])).snapshot_at  # 8: the branch and last boundary
    assert branch.branch and branch.end == 8
    cache.claim(np.append(shared, [60, 61]), branch)
    others = [np.arange(t, t + 8) for t in (300, 400, 500)]
    for p in others:  # the third evicts: the branch 0 + 1 + 1, the first other 1/2 + 1
        claim(cache, p)
    assert held(cache, shared) == 8 and held(cache, others[0]) == 0

    cache = PrefixCache(slots=[0, 1, 2], block=4)
    old, turn = np.arange(100, 109), np.arange(1, 9)
    claim(cache, old)
    claim(cache, turn)
    snapshot = cache._entries[cache.boundaries(turn)[-1].key]
    nxt = np.append(turn, [5, 6, 7, 8, 9])  # its next turn restores it and snapshots its own end, 12
    cache.admit(nxt)
    assert not snapshot.shared and snapshot.superseded
    claim(cache, nxt)
    claim(cache, np.arange(200, 209))  # the superseded end goes, though older ones are held
    assert held(cache, turn) == 0 and held(cache, old) == 8 and held(cache, nxt) == 12

    cache = PrefixCache(slots=[0, 1, 2], block=4)
    claim(cache, turn)
    snapshot = cache._entries[cache.boundaries(turn)[-1].key]
    cache.admit(nxt)
    cache.admit(np.append(turn, [3, 3, 3, 3, 3]))  # a second prompt continues from it: shared
    assert snapshot.shared and not snapshot.superseded


@pytest.mark.parametrize("seen", [3, 4])
def test_seen_keys_are_bounded(seen):
    cache = PrefixCache(slots=[0], block=2, seen=seen)
    cache.admit(np.arange(1, 9))  # four blocks: with room for three keys, the first is forgotten
    wanted = cache.admit(np.array([1, 2, 0, 0, 0])).snapshot_at  # shares the first block only
    assert [x.end for x in wanted] == ([4] if seen == 3 else [2, 4])


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
    # snapshots at 32 (the 40-token prompt's last, the 70's branch) and 64 (the 70's last)
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
