import contextlib

import numpy as np
import pytest
import torch
from support import poisoned

from mambastep.kernels.sample import (
    MODES,
    _greedy,
    _random_bits_ref,
    _ranked,
    _row_keys_ref,
    _scaled,
    filtered_draw_triton,
    sample,
    sample_ref,
    sample_torch,
    sample_triton,
    sampling_mode,
)

# ---------------------------------------------------------------------------------------------
# helpers


def params(R, temperature=1.0, top_k=0, top_p=1.0, seed=0, position=None, device="cpu"):
    """Per-row parameter tensors in ``sample``'s order; scalars are broadcast to all rows."""

    def col(v, dtype):
        return torch.as_tensor(v, dtype=dtype).expand(R).clone().to(device)

    position = torch.arange(R) if position is None else position
    return (col(temperature, torch.float32), col(top_k, torch.int32), col(top_p, torch.float32),
            col(seed, torch.int64), col(position, torch.int64))


def run(logits, p, mode):
    out = poisoned((logits.shape[0],), torch.int64, logits.device)
    return sample(logits, *p, mode=mode, out=out)


def random_logits(R, V, seed=0, scale=3.0):
    return torch.randn(R, V, generator=torch.Generator().manual_seed(seed)) * scale


def mixed_params(R, V, seed=0):
    """Rows mixing greedy, plain temperature, top-k (incl. off values 0, V, > V) and top-p."""
    g = np.random.default_rng(seed)
    t = g.choice([0.0, 0.3, 1.0, 1.7], R).astype(np.float32)
    k = g.choice([0, 0, 1, 3, 17, V, V + 5], R).astype(np.int32)
    p = g.choice([1.0, 1.0, 0.93, 0.61, 0.17, 0.02], R).astype(np.float32)
    s = g.integers(-(2**63), 2**63 - 1, R, dtype=np.int64)
    pos = g.integers(0, 2**40, R, dtype=np.int64)
    return tuple(torch.from_numpy(a) for a in (t, k, p, s, pos))


def frequencies(tokens, V):
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


def draws(probs_logits, N, mode, temperature=1.0, top_k=0, top_p=1.0, seed=1234, vary="position"):
    """N draws from one logit row: rows differ only in position (or only in seed)."""
    logits = probs_logits.expand(N, -1).contiguous()
    ids = torch.arange(N)
    p = params(N, temperature, top_k, top_p, seed=ids if vary == "seed" else seed,
               position=ids if vary == "position" else torch.full((N,), 7))
    return run(logits, p, mode)


def assert_matches(tokens, expected):
    """Empirical frequencies against expected probabilities: zero where expected is zero, and
    within 0.02 (several standard errors at 20k draws) and a chi-square bound elsewhere."""
    freq = frequencies(tokens, expected.numel())
    assert (freq[expected == 0] == 0).all(), f"tokens outside the allowed set: {freq}"
    assert (freq - expected).abs().max() < 0.02, f"{freq} vs {expected}"
    live = expected > 0
    n = tokens.numel()
    chi2 = ((freq[live] - expected[live]) ** 2 / expected[live]).sum() * n
    # df <= 7: the 0.9999 quantile is 29.9
    assert chi2 < 30, f"chi-square {chi2:.1f}"


LOGITS8 = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
N = 20000

def test_sampling_mode():
    assert sampling_mode([0, 1.0], [0, 1], [1, 0.5]) == "greedy"  # both rows greedy
    assert sampling_mode([0, 1.0], [5, 0], [0.5, 1]) == "sample"  # filters only on a greedy row
    assert sampling_mode([0.7], [5], [1]) == "filtered"
    assert sampling_mode([0.7], [0], [0.9]) == "filtered"
    assert sampling_mode([0.7], [50], [1], vocab_size=50) == "sample"
    assert sampling_mode([], [], []) == "greedy"


# ---------------------------------------------------------------------------------------------
# the random numbers


@pytest.mark.parametrize("seed, position", [(0, 0), (-1, 1), (2**63 - 1, 2**62 + 3), (-(2**63), 5),
                                            (123456789, 2**40), (-987654321012, 0)])
def test_random_bits_match_exact_integers(seed, position):
    """The int64 tensor hash equals the same hash in Python's exact integers: no overflow, no
    sign trouble from shifts of negative seeds."""
    tokens = torch.tensor([0, 1, 2, 255, 65535, 131071, 2**20 + 7])
    mult, offset = _row_keys_ref(torch.tensor([seed]), torch.tensor([position]))
    bits = _random_bits_ref(mult[:, None], offset[:, None], tokens)[0].tolist()
    m, o = _row_keys_ref(seed, position)
    assert m == mult.item() and o == offset.item()
    assert bits == [int(_random_bits_ref(m, o, t)) for t in tokens.tolist()]
    assert all(0 <= b < 2**23 for b in bits)


def test_random_bits_known_values():
    """Pinned outputs: a change to the hash would silently change every seeded request's tokens."""
    for (seed, position), expected in {(0, 0): [7236610, 8298931, 2778442],
                                       (42, 7): [1406078, 380876, 202517],
                                       (-1, 2**33): [6384521, 2251580, 5949657]}.items():
        mult, offset = _row_keys_ref(torch.tensor([seed]), torch.tensor([position]))
        bits = _random_bits_ref(mult[:, None], offset[:, None], torch.tensor([0, 1, 50000]))
        assert bits[0].tolist() == expected


def test_random_bits_are_uniform_and_distinct_across_keys():
    seeds, positions = torch.arange(64).repeat_interleave(64), torch.arange(64).repeat(64)
    mult, offset = _row_keys_ref(seeds, positions)
    assert len(set(zip(mult.tolist(), offset.tolist()))) == 64 * 64
    u = _random_bits_ref(mult[:, None], offset[:, None], torch.arange(512)).double() / 2**23
    assert abs(u.mean().item() - 0.5) < 2e-3 and abs(u.var().item() - 1 / 12) < 2e-3
    # draws of different keys are uncorrelated
    c = torch.corrcoef(u[:256])
    assert (c - torch.eye(256)).abs().max() < 0.25


# ---------------------------------------------------------------------------------------------
# greedy


@pytest.mark.parametrize("mode", MODES)
def test_greedy_rows_are_argmax(mode):
    R, V = 33, 257
    logits = random_logits(R, V)
    # tied maxima: argmax takes the lowest id
    logits[0, 10] = logits[0, 200] = logits[0].max() + 1
    assert torch.equal(run(logits, params(R, temperature=0.0, top_k=5, top_p=0.3), mode), logits.argmax(-1))
    assert run(logits, params(R, temperature=0.0), mode)[0] == 10


@pytest.mark.parametrize("mode", ["sample", "filtered"])
def test_top_k_one_and_temperature_zero_rows_are_greedy_in_a_sampled_batch(mode):
    R, V = 40, 100
    logits = random_logits(R, V, seed=1)
    t = torch.where(torch.arange(R) % 3 == 0, 0.0, 1.5)
    k = torch.where(torch.arange(R) % 3 == 1, 1, 0)
    out = run(logits, params(R, temperature=t, top_k=k), mode)
    greedy = (t == 0) | (k == 1)
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
    # the other rows really sample (at T = 1.5 over 100 tokens the argmax is not always drawn)
    assert not torch.equal(out[~greedy], logits.argmax(-1)[~greedy])


# ---------------------------------------------------------------------------------------------
# reproducibility


@pytest.mark.parametrize("mode", ["sample", "filtered"])
def test_row_result_independent_of_batch(mode):
    R, V = 24, 300
    logits = random_logits(R, V, seed=2)
    p = mixed_params(R, V, seed=3) if mode == "filtered" else params(R, 1.3, seed=torch.arange(R) * 11 - 50)
    base = run(logits, p, mode)
    assert torch.equal(base, run(logits, p, mode)), "same inputs, different tokens"
    perm = torch.randperm(R, generator=torch.Generator().manual_seed(4))
    assert torch.equal(run(logits[perm], tuple(x[perm] for x in p), mode), base[perm])
    # the same rows inside a larger batch, after unrelated rows
    extra_logits = random_logits(10, V, seed=5)
    extra = params(10, 0.9, top_k=7, top_p=0.8, seed=99)
    big = run(torch.cat([extra_logits, logits]), tuple(torch.cat([a, b]) for a, b in zip(extra, p)), mode)
    assert torch.equal(big[10:], base)
    # alone, one row at a time
    for r in (0, R // 2, R - 1):
        assert run(logits[r : r + 1], tuple(x[r : r + 1] for x in p), mode).item() == base[r]


def test_seed_and_position_change_the_draw():
    V = 1000
    logits = torch.zeros(100, V)
    a = run(logits, params(100, seed=1), "sample")
    b = run(logits, params(100, seed=2), "sample")
    c = run(logits, params(100, seed=1, position=torch.arange(100) + 1), "sample")
    assert (a != b).sum() > 90 and (a[1:] == c[:-1]).all() and (a[:-1] != c[:-1]).sum() > 90


def test_unfiltered_rows_same_in_sample_and_filtered_modes():
    """The mode is a cost choice: a row without filters draws the same token either way."""
    R, V = 64, 500
    logits = random_logits(R, V, seed=6)
    p = params(R, torch.linspace(0.2, 2.0, R), seed=torch.arange(R) * 3)
    assert torch.equal(run(logits, p, "sample"), run(logits, p, "filtered"))
    # top_k >= V and top_k = 0 are both off
    p_off = params(R, torch.linspace(0.2, 2.0, R), top_k=V, seed=torch.arange(R) * 3)
    assert torch.equal(run(logits, p_off, "filtered"), run(logits, p, "sample"))


# ---------------------------------------------------------------------------------------------
# distributions


def softmax8(temperature):
    return torch.softmax(LOGITS8[0].double() / temperature, 0)


@pytest.mark.parametrize("mode", ["sample", "filtered"])
@pytest.mark.parametrize("vary", ["position", "seed"])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.5])
def test_temperature_distribution(mode, vary, temperature):
    assert_matches(draws(LOGITS8, N, mode, temperature, vary=vary), softmax8(temperature))


def test_consecutive_draws_are_independent():
    """Pairs (draw at position i, draw at i + 1) of one request are uniform over 4 x 4 cells."""
    t = draws(torch.zeros(1, 4), 2 * N, "sample")
    pairs = t[0::2] * 4 + t[1::2]
    assert_matches(pairs, torch.full((16,), 1 / 16, dtype=torch.float64))


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_top_k_distribution(k):
    T = 1.3
    expected = softmax8(T)
    top = expected.argsort(descending=True)[:k]
    masked = torch.zeros_like(expected)
    masked[top] = expected[top] / expected[top].sum()
    assert_matches(draws(LOGITS8, N, "filtered", T, top_k=k), masked)


def nucleus(probs, top_p):
    """Expected distribution after top-p, spelled out with a numpy cumulative sum."""
    order = np.argsort(-probs.numpy(), kind="stable")
    cum = np.cumsum(probs.numpy()[order])
    n = int(np.searchsorted(cum, top_p) + 1)  # smallest prefix whose mass reaches top_p
    out = torch.zeros_like(probs)
    keep = torch.from_numpy(order[:n])
    out[keep] = probs[keep] / probs[keep].sum()
    return out


@pytest.mark.parametrize("top_p", [0.05, 0.45, 0.8, 0.97])
def test_top_p_distribution(top_p):
    T = 1.1
    expected = nucleus(softmax8(T), top_p)
    assert_matches(draws(LOGITS8, N, "filtered", T, top_p=top_p), expected)


def test_top_k_then_top_p_distribution():
    T, k, top_p = 1.6, 5, 0.7
    probs = softmax8(T)
    top = probs.argsort(descending=True)[:k]
    after_k = torch.zeros_like(probs)
    after_k[top] = probs[top] / probs[top].sum()
    assert_matches(draws(LOGITS8, N, "filtered", T, top_k=k, top_p=top_p), nucleus(after_k, top_p))


# ---------------------------------------------------------------------------------------------
# against the reference


@pytest.mark.parametrize("R, V", [(1, 5), (37, 50), (64, 301), (16, 4099)])
def test_sample_matches_reference(R, V):
    logits = random_logits(R, V, seed=R + V)
    p = mixed_params(R, V, seed=V)
    assert torch.equal(run(logits, p, "filtered"), sample_ref(logits, *p))


def test_sample_matches_reference_with_tied_logits():
    """Integer logits tie everywhere: the kept set and the greedy pick break ties by token id."""
    R, V = 48, 40
    logits = torch.randint(-3, 3, (R, V), generator=torch.Generator().manual_seed(7)).float()
    p = mixed_params(R, V, seed=8)
    assert torch.equal(run(logits, p, "filtered"), sample_ref(logits, *p))


def test_plain_temperature_rows_match_reference_in_sample_mode():
    R, V = 30, 123
    logits = random_logits(R, V, seed=9)
    p = params(R, torch.linspace(0.0, 3.0, R), seed=torch.arange(R) - 15, position=torch.arange(R) * 1000)
    assert torch.equal(run(logits, p, "sample"), sample_ref(logits, *p))


def test_bad_arguments():
    logits, p = random_logits(4, 10), params(4)
    with pytest.raises(ValueError, match="mode"):
        run(logits, p, "nucleus")
    with pytest.raises(ValueError, match="top_k"):
        run(logits, (p[0], p[1][:3]) + p[2:], "filtered")
    with pytest.raises(ValueError, match="out"):
        sample(logits, *p, mode="sample", out=torch.empty(4, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# the Triton kernels of the greedy and sample modes (compiled on CUDA, else Triton's interpreter,
# which breaks argmax ties to the left whatever it is asked: ties are checked on the GPU)


def unfiltered(R, V, seed, mode):
    """mixed_params without top-p, top-k only 0 or 1: rows the greedy / sample modes serve."""
    t, k, _, s, pos = mixed_params(R, V, seed=seed)
    if mode == "greedy":
        t = torch.zeros(R)
    return t, torch.where(k == 1, 1, 0).int(), torch.ones(R), s, pos


def kernel_vs_torch(logits, p, mode, block):
    R = logits.shape[0]
    got = sample_triton(logits, p[0], p[1], p[3], p[4], draw=mode == "sample", block=block,
                        out=poisoned((R,), torch.int64, logits.device))
    want = sample_torch(logits, *p, mode=mode, out=torch.empty(R, dtype=torch.int64, device=logits.device))
    assert torch.equal(got, want)
    return got


@pytest.mark.parametrize("block", [16, 64, 512])  # 19 blocks (the last partial), 5, one wider than V
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_kernel_matches_torch_path(mode, block, device):
    R, V = 20, 300
    # a row stride wider than the vocabulary, as a padded LM head's output would have
    logits = torch.full((R, V + 7), float("nan"), device=device)[:, :V]
    logits.copy_(random_logits(R, V, seed=11))
    logits[0, 10] = logits[0, 200] = logits[0].max() + 1  # tied maxima in different blocks
    p = tuple(x.to(device) for x in unfiltered(R, V, 12, mode))
    got = kernel_vs_torch(logits, p, mode, block)
    if mode == "greedy":
        assert got[0] == 10


def test_kernel_ties_break_by_token_id(device):
    """Integer logits tie everywhere: the argmax takes the lowest id across blocks."""
    R, V = 12, 100
    logits = torch.randint(-2, 2, (R, V), generator=torch.Generator().manual_seed(13)).float().to(device)
    for mode in ("greedy", "sample"):
        kernel_vs_torch(logits, tuple(x.to(device) for x in unfiltered(R, V, 14, mode)), mode, block=16)


def filtered_vs_torch(logits, p, block):
    R = logits.shape[0]
    vals, order = _ranked(_scaled(logits, p[0], _greedy(p[0], p[1])))
    got = filtered_draw_triton(vals, order, *p, block=block, out=poisoned((R,), torch.int64, logits.device))
    want = sample_torch(logits, *p, mode="filtered", out=torch.empty(R, dtype=torch.int64, device=logits.device))
    assert torch.equal(got, want)
    return got


@pytest.mark.parametrize("block", [16, 64, 512])
def test_filtered_kernel_matches_torch_path(block, device):
    """Rows mixing greedy, plain temperature, top-k (incl. off values 0, V, > V) and top-p, with
    a nucleus that ends inside a block, at a block edge or runs to the end of the vocabulary."""
    R, V = 40, 300
    logits = random_logits(R, V, seed=18, scale=1.0).to(device)  # flat: nuclei of many blocks
    p = tuple(x.to(device) for x in mixed_params(R, V, seed=19))
    got = filtered_vs_torch(logits, p, block)
    assert torch.equal(got.cpu(), sample_ref(logits.cpu(), *(x.cpu() for x in p)))


def test_filtered_kernel_with_tied_logits(device):
    R, V = 48, 40
    logits = torch.randint(-3, 3, (R, V), generator=torch.Generator().manual_seed(20)).float().to(device)
    filtered_vs_torch(logits, tuple(x.to(device) for x in mixed_params(R, V, seed=21)), block=16)


# ---------------------------------------------------------------------------------------------
# CUDA graph


@contextlib.contextmanager
def sync_errors():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("V", [1000, 50288])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_replay_matches_eager(mode, V):
    dev, R = torch.device("cuda"), 16
    # static parameter buffers, refilled in place as the runtime's arena is
    params = [torch.zeros(R, dtype=d, device=dev) for d in (torch.float32, torch.int32, torch.float32,
                                                            torch.int64, torch.int64)]
    logits = torch.empty(R, V, device=dev)
    out = torch.empty(R, dtype=torch.int64, device=dev)

    def refill(trial):
        p = mixed_params(R, V, seed=trial)
        if mode == "greedy":
            p = (torch.zeros(R),) + p[1:]
        elif mode == "sample":
            p = (p[0], torch.zeros(R, dtype=torch.int32), torch.ones(R)) + p[3:]
        # the host's choice never needs a more general graph than the one captured
        assert MODES.index(sampling_mode(p[0].numpy(), p[1].numpy(), p[2].numpy(), V)) <= MODES.index(mode)
        for buf, x in zip(params, p):
            buf.copy_(x)
        logits.copy_(random_logits(R, V, seed=100 + trial).to(dev))
        return p

    refill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), sync_errors():
        sample(logits, *params, mode=mode, out=out)  # warm up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with sync_errors():
            sample(logits, *params, mode=mode, out=out)
    for trial in range(1, 4):
        p = refill(trial)
        eager = torch.full_like(out, -1)
        with sync_errors():
            out.fill_(-1)
            graph.replay()
            sample(logits, *params, mode=mode, out=eager)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        # and the same tokens as the CPU path (identical hash bits; float32 log may differ by an
        # ulp across devices, which only matters at exact score ties)
        cpu = sample(logits.cpu(), *p, mode=mode, out=torch.empty(R, dtype=torch.int64))
        assert torch.equal(out.cpu(), cpu)
        if mode == "filtered":
            assert torch.equal(out.cpu(), sample_ref(logits.cpu(), *p))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("logit_kind", ["random", "tied"])
def test_gpu_kernel_matches_torch_path(mode, logit_kind):
    """The compiled kernels against the torch ops on the same device: ties across and within
    vocabulary blocks (integer logits) take the lowest token id there too."""
    R, V = 96, 50288
    if logit_kind == "tied":
        logits = torch.randint(-2, 2, (R, V), generator=torch.Generator().manual_seed(15)).float()
    else:
        logits = random_logits(R, V, seed=16)
    if mode == "filtered":
        filtered_vs_torch(logits.cuda(), tuple(x.cuda() for x in mixed_params(R, V, seed=17)), block=2048)
        return
    p = tuple(x.cuda() for x in unfiltered(R, V, 17, mode))
    got = kernel_vs_torch(logits.cuda(), p, mode, block=2048)
    if mode == "greedy":
        assert torch.equal(got.cpu(), logits.argmax(-1))
