import pytest
import torch
import torch.nn.functional as F
from transformers.models.mamba2.modeling_mamba2 import causal_conv1d_fn, causal_conv1d_update

from mambastep.kernels import PAD_SLOT_ID, PrefillMetadata
from mambastep.kernels.conv1d import conv1d_update, conv1d_update_ref, conv1d_varlen, conv1d_varlen_ref

from support import assert_close, poisoned

P = PAD_SLOT_ID


def make_params(D, K, dtype, device, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(D, K, generator=g) / K**0.5).to(dtype).to(device)
    b = torch.randn(D, generator=g).to(dtype).to(device) if bias else None
    return w, b


def make_pool(S, D, K, dtype, device, transposed=False, seed=1):
    """A random state pool [S, D, K-1]; transposed: stored as [S, K-1, D] and viewed."""
    g = torch.Generator().manual_seed(seed)
    if transposed:
        return torch.randn(S, K - 1, D, generator=g).to(dtype).to(device).transpose(1, 2)
    return torch.randn(S, D, K - 1, generator=g).to(dtype).to(device)


def strided_rows(T, D, dtype, device, seed=2, pad=13):
    """Random x [T, D] as a column slice of a wider buffer (row stride D + pad)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(T, D + pad, generator=g).to(dtype).to(device)
    return wide[:, 5 : 5 + D]


def poisoned_out(T, D, dtype, device, pad=9):
    """A NaN-poisoned output [T, D] as a column slice of a wider buffer, and the buffer."""
    wide = poisoned((T, D + pad), dtype, device)
    return wide[:, 4 : 4 + D], wide


def assert_margins_untouched(wide, D):
    assert torch.isnan(wide[:, :4]).all() and torch.isnan(wide[:, 4 + D :]).all()


def assert_slots_untouched(pool, before, live_slots):
    others = [s for s in range(pool.shape[0]) if s not in set(live_slots)]
    assert torch.equal(pool[others], before[others])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("K,D,bias,activation", [(4, 150, True, "silu"), (2, 40, False, None)])
def test_update_triton_matches_ref(device, dtype, transposed, K, D, bias, activation):
    S = 7
    slots = torch.tensor([3, P, 0, 6, P, 2], dtype=torch.int32, device=device)
    B = slots.shape[0]
    w, b = make_params(D, K, dtype, device, bias)
    x = strided_rows(B, D, dtype, device)
    pool = make_pool(S, D, K, dtype, device, transposed)
    before = pool.clone()

    pool_ref = pool.clone()
    ref = conv1d_update_ref(x, pool_ref, w, b, slots, activation=activation)
    out, wide = poisoned_out(B, D, dtype, device)
    got = conv1d_update.triton(x, pool, w, b, slots, out=out, activation=activation)

    assert got is out
    assert_close(out, ref, dtype)
    assert (out[slots < 0] == 0).all()
    assert_margins_untouched(wide, D)
    assert pool.stride() == before.stride()
    # the new state is a shifted copy of old state and input: exact
    assert torch.equal(pool, pool_ref)
    assert_slots_untouched(pool, before, [3, 0, 6, 2])


# sequences of length 1, 2 (< K-1), K-1, K and long; one live sequence without a slot, long
# enough that the prefill kernel's runs of tokens lie wholly inside it (as they do inside the
# 37-token one)
VARLEN_CASE = dict(
    lens=[1, 2, 3, 4, 37, 5, 26],
    slots=[4, 0, 6, 9, 2, 1, P],
    init=[1, 1, 0, 1, 0, 1, 1],
    extra_tokens=7,
    extra_seqs=2,
)


def run_varlen_case(device, dtype, transposed, K, D, bias, activation, S=11):
    c = VARLEN_CASE
    total = sum(c["lens"])
    T = total + c["extra_tokens"]
    meta = PrefillMetadata.build(
        c["lens"], c["slots"], c["init"], chunk_size=16,
        max_tokens=T, max_seqs=len(c["lens"]) + c["extra_seqs"], device=device,
    )
    w, b = make_params(D, K, dtype, device, bias)
    x = strided_rows(T, D, dtype, device)
    # padding tokens hold garbage that must not leak anywhere
    x[total:] = float("nan")
    pool = make_pool(S, D, K, dtype, device, transposed)
    live = [s for s in c["slots"] if s >= 0]
    # slots of sequences without initial state must not be read
    for s, n in zip(c["slots"], c["init"]):
        if s >= 0 and not n:
            pool[s] = float("nan")
    before = pool.clone()

    pool_ref = pool.clone()
    ref = conv1d_varlen_ref(x, w, b, pool_ref, meta, activation=activation)
    out, wide = poisoned_out(T, D, dtype, device)
    got = conv1d_varlen.triton(x, w, b, pool, meta, out=out, activation=activation)

    assert got is out
    assert_close(out, ref, dtype)
    skipped = c["lens"][-1]
    assert (out[total - skipped :] == 0).all()
    assert_margins_untouched(wide, D)
    assert torch.equal(pool, pool_ref)
    assert torch.isfinite(pool).all()
    assert_slots_untouched(pool, before, live)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_varlen_triton_matches_ref(device, dtype, transposed):
    run_varlen_case(device, dtype, transposed, K=4, D=150, bias=True, activation="silu")


def test_varlen_triton_matches_ref_k3(device):
    run_varlen_case(device, torch.float32, False, K=3, D=40, bias=False, activation=None)


@pytest.mark.parametrize("activation", ["silu", None])
def test_update_ref_matches_hf(activation):
    D, K, S = 24, 4, 6
    slots = torch.tensor([4, 1, 5], dtype=torch.int32)
    w, b = make_params(D, K, torch.float32, "cpu")
    x = strided_rows(3, D, torch.float32, "cpu")
    pool = make_pool(S, D, K, torch.float32, "cpu")
    hf_state = pool[slots.long()].clone()

    out = conv1d_update_ref(x, pool, w, b, slots, activation=activation)
    hf_out = causal_conv1d_update(x[:, :, None], hf_state, w, b, activation=activation)

    torch.testing.assert_close(out, hf_out[:, :, 0])
    torch.testing.assert_close(pool[slots.long()], hf_state)


def test_varlen_ref_matches_hf_per_sequence():
    D, K = 24, 4
    lens = [1, 2, 3, 9]
    meta = PrefillMetadata.build(lens, [2, 0, 3, 1], chunk_size=8)
    w, b = make_params(D, K, torch.float32, "cpu")
    x = strided_rows(sum(lens), D, torch.float32, "cpu")
    pool = make_pool(4, D, K, torch.float32, "cpu")

    out = conv1d_varlen_ref(x, w, b, pool, meta)

    cu = meta.cu_seqlens.tolist()
    for i, slot in enumerate(meta.slot_idx.tolist()):
        seq = x[cu[i] : cu[i + 1]].T[None]  # [1, D, L]
        hf = causal_conv1d_fn(seq, w, b, activation="silu")
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], hf[0].T)
        # without an initial state the window is zero-padded on the left
        torch.testing.assert_close(pool[slot], F.pad(seq[0], (K - 1, 0))[:, -(K - 1) :])


def test_varlen_equals_token_by_token_update(device):
    D, K, S = 40, 4, 5
    lens, slots, init = [1, 2, 6, 3], [3, 0, 4, 1], [1, 1, 1, 0]
    meta = PrefillMetadata.build(lens, slots, init, chunk_size=4, device=device)
    w, b = make_params(D, K, torch.float32, device)
    x = strided_rows(sum(lens), D, torch.float32, device)
    pool = make_pool(S, D, K, torch.float32, device)

    pool_steps = pool.clone()
    out = conv1d_varlen.triton(x, w, b, pool, meta)

    start = 0
    for n, slot, has_init in zip(lens, slots, init):
        if not has_init:
            pool_steps[slot] = 0
        slot_t = torch.tensor([slot], dtype=torch.int32, device=device)
        for t in range(start, start + n):
            step = conv1d_update.triton(x[t : t + 1], pool_steps, w, b, slot_t)
            assert_close(out[t : t + 1], step, factor=0.1)
        start += n
    assert torch.equal(pool, pool_steps)


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_a_snapshot_holds_the_window_before_its_row(impl, device):
    """A sequence with a snapshot slot leaves there the K-1 inputs before its snapshot row: what
    a conv of its tokens up to there alone leaves in its own slot (a window that reaches back
    into the initial state, one inside the tokens, one at a sequence's end); the sequences' own
    slots and every other slot are as without the snapshots."""
    fn = conv1d_varlen.triton if impl == "triton" else conv1d_varlen_ref
    device = device if impl == "triton" else "cpu"
    D, K, dtype = 40, 4, torch.float32
    lens, slots, init = [20, 2, 9], [1, 4, 6], [1, 1, 0]
    w, b = make_params(D, K, dtype, device)
    x = strided_rows(sum(lens), D, dtype, device)
    pool = make_pool(11, D, K, dtype, device)

    def conv(x, lens, slots, init, snapshots=None):
        p = pool.clone()
        meta = PrefillMetadata.build(lens, slots, init, snapshots=snapshots, chunk_size=2, device=device)
        return fn(x, w, b, p, meta), p

    # sequence 0 two tokens in (its window reaches back into its initial state), 1 at its end,
    # 2 eight tokens in
    out, got = conv(x, lens, slots, init, ([8, 9, 10], [2, 2, 8]))
    plain_out, plain = conv(x, lens, slots, init)
    assert torch.equal(out, plain_out)
    assert torch.equal(got[8], conv(x[:2], [2], [1], [1])[1][1])
    assert torch.equal(got[9], plain[4])
    assert torch.equal(got[10], conv(x[22:30], [8], [6], [0])[1][6])
    assert torch.equal(got[:8], plain[:8])


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_a_snapshot_into_its_own_slot(impl, device):
    """The speculative use: the window before the row goes to the sequence's own slot and the
    final one nowhere, or elsewhere; both are read before either is written, even where the
    snapshot's window reaches back into the initial one (sequence 0, one token in)."""
    fn = conv1d_varlen.triton if impl == "triton" else conv1d_varlen_ref
    device = device if impl == "triton" else "cpu"
    D, K, dtype = 40, 4, torch.float32
    lens, slots, init = [2, 9], [1, 4], [1, 1]
    w, b = make_params(D, K, dtype, device)
    x = strided_rows(sum(lens), D, dtype, device)
    pool = make_pool(8, D, K, dtype, device)

    def conv(x, lens, slots, init, snapshots=None, final_slots=None):
        p = pool.clone()
        meta = PrefillMetadata.build(lens, slots, init, snapshots=snapshots, final_slots=final_slots, chunk_size=2,
                                     device=device)
        return fn(x, w, b, p, meta), p

    out, got = conv(x, lens, slots, init, ([1, 4], [1, 5]), [7, PAD_SLOT_ID])
    plain_out, plain = conv(x, lens, slots, init)
    assert torch.equal(out, plain_out)
    assert torch.equal(got[1], conv(x[:1], [1], [1], [1])[1][1])
    assert torch.equal(got[7], plain[1])
    assert torch.equal(got[4], conv(x[2:7], [5], [4], [1])[1][4])
    assert torch.equal(got[[0, 2, 3, 5, 6]], plain[[0, 2, 3, 5, 6]])


def test_varlen_padding_is_inert(device):
    D, K, S, dtype = 72, 4, 8, torch.bfloat16
    lens, slots, init = [5, 2, 11], [6, 1, 3], [1, 1, 0]
    total = sum(lens)
    w, b = make_params(D, K, dtype, device)
    x = strided_rows(total, D, dtype, device)
    pool = make_pool(S, D, K, dtype, device)

    meta = PrefillMetadata.build(lens, slots, init, chunk_size=8, device=device)
    pool_a = pool.clone()
    out_a = conv1d_varlen.triton(x, w, b, pool_a, meta)

    # the same step padded: a sequence without a slot, unused sequences, padding tokens
    T = total + 4 + 9
    x_pad = poisoned((T, D), dtype, device)
    x_pad[:total] = x
    x_pad[total : total + 4] = 1.0
    meta_pad = PrefillMetadata.build(
        lens + [4], slots + [P], init + [1], chunk_size=8, max_tokens=T, max_seqs=6, device=device
    )
    pool_b = pool.clone()
    out_b = conv1d_varlen.triton(x_pad, w, b, pool_b, meta_pad, out=poisoned((T, D), dtype, device))

    assert torch.equal(pool_a, pool_b)
    assert torch.equal(out_b[:total], out_a)
    assert (out_b[total:] == 0).all()


def test_update_padding_is_inert(device):
    D, K, S, dtype = 72, 4, 8, torch.bfloat16
    w, b = make_params(D, K, dtype, device)
    pool = make_pool(S, D, K, dtype, device)
    x = strided_rows(3, D, dtype, device)
    slots = torch.tensor([5, 0, 2], dtype=torch.int32, device=device)

    pool_a = pool.clone()
    out_a = conv1d_update.triton(x, pool_a, w, b, slots)

    x_pad = poisoned((6, D), dtype, device)
    x_pad[[0, 2, 3]] = x
    slots_pad = torch.tensor([5, P, 0, 2, P, P], dtype=torch.int32, device=device)
    pool_b = pool.clone()
    out_b = poisoned((6, D), dtype, device)
    conv1d_update.triton(x_pad, pool_b, w, b, slots_pad, out=out_b)

    assert torch.equal(pool_a, pool_b)
    assert torch.equal(out_b[[0, 2, 3]], out_a)
    assert (out_b[[1, 4, 5]] == 0).all()


def test_public_ops_dispatch_and_fill_out(device):
    D, K = 40, 4
    w, b = make_params(D, K, torch.float32, device)
    pool = make_pool(3, D, K, torch.float32, device)
    x = strided_rows(2, D, torch.float32, device)
    out = poisoned((2, D), device=device)
    slots = torch.tensor([2, P], dtype=torch.int32, device=device)
    pool_ref = pool.clone()
    assert conv1d_update(x, pool, w, b, slots, out=out) is out
    assert_close(out, conv1d_update_ref(x, pool_ref, w, b, slots))

    meta = PrefillMetadata.build([2], [1], [1], chunk_size=4, device=device)
    out = poisoned((2, D), device=device)
    assert conv1d_varlen(x, w, b, pool, meta, out=out) is out
    assert_close(out, conv1d_varlen_ref(x, w, b, pool_ref, meta))
    assert torch.equal(pool, pool_ref)


def test_rejects_bad_shapes(device):
    D, K = 40, 4
    w, b = make_params(D, K, torch.float32, device)
    x = torch.zeros(2, D, device=device)
    slots = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="conv_state"):
        conv1d_update.triton(x, torch.zeros(3, D, K, device=device), w, b, slots)
    pool = torch.zeros(3, D, K - 1, device=device)
    with pytest.raises(ValueError, match="activation"):
        conv1d_update.triton(x, pool, w, b, slots, activation="gelu")
    with pytest.raises(ValueError, match="slot_idx"):
        conv1d_update.triton(x, pool, w, b, slots[:1])


@pytest.mark.gpu
def test_varlen_full_shape_gpu():
    device, dtype = torch.device("cuda"), torch.bfloat16
    # Nemotron-H-8B conv_dim = d_inner + 2 * n_groups * d_state
    D, K, S = 8192 + 2 * 8 * 128, 4, 64
    lens = [300] * 7 + [1]
    slots = [3, 17, 40, 8, 63, 0, 22, 9]
    init = [1, 0, 1, 0, 1, 1, 0, 1]
    T = 2560
    meta = PrefillMetadata.build(
        lens, slots, init, chunk_size=256, max_tokens=T, max_seqs=12, device=device
    )
    w, b = make_params(D, K, dtype, device)
    x = strided_rows(T, D, dtype, device, pad=D + 256)
    pool = make_pool(S, D, K, dtype, device, transposed=True)
    before = pool.clone()
    pool_ref = pool.clone()

    ref = conv1d_varlen_ref(x, w, b, pool_ref, meta)
    out = conv1d_varlen(x, w, b, pool, meta, out=poisoned((T, D), dtype, device))

    assert_close(out, ref, dtype)
    assert torch.equal(pool, pool_ref)
    assert_slots_untouched(pool, before, slots)


@pytest.mark.gpu
def test_update_full_shape_gpu():
    device, dtype = torch.device("cuda"), torch.bfloat16
    D, K, S, B = 8192 + 2 * 8 * 128, 4, 512, 256
    slots = torch.randperm(S, generator=torch.Generator().manual_seed(3))[:B].to(torch.int32)
    slots[::7] = P
    slots = slots.to(device)
    w, b = make_params(D, K, dtype, device)
    x = strided_rows(B, D, dtype, device, pad=D + 256)
    pool = make_pool(S, D, K, dtype, device)
    pool_ref = pool.clone()

    ref = conv1d_update_ref(x, pool_ref, w, b, slots)
    out = conv1d_update(x, pool, w, b, slots, out=poisoned((B, D), dtype, device))

    assert_close(out, ref, dtype)
    assert torch.equal(pool, pool_ref)
