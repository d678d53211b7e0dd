import pytest
import torch
import triton
from support import assert_close, poisoned
from transformers.models.mamba2.modeling_mamba2 import mamba2_selective_state_update as hf_update

from mambastep.kernels.state_update import _block_config, selective_state_update, selective_state_update_ref
from mambastep.kernels.varlen import PAD_SLOT_ID


def make_inputs(batch, H, P, N, G, dtype=torch.float32, device="cpu", seed=0):
    """Per-row inputs carved from one wide row buffer, like the in_proj / conv outputs they are
    in the runtime: x, z, B, C and dt are views with a row stride wider than their own size."""
    g = torch.Generator().manual_seed(seed)
    widths = [H * P, H * P, G * N, G * N, H]
    # a few spare columns after each field, so no view is packed
    gap = 3
    row = torch.randn(batch, sum(widths) + gap * len(widths), generator=g)
    row = row.to(device=device, dtype=dtype)
    views, col = [], 0
    for w in widths:
        views.append(row[:, col : col + w])
        col += w + gap
    x, z, B, C, dt = views
    params = dict(
        A=-torch.rand(H, generator=g).add(0.1),
        D=torch.randn(H, generator=g),
        dt_bias=torch.randn(H, generator=g) - 1.0,
    )
    return dict(
        x=x.view(batch, H, P), z=z.view(batch, H, P), B=B.view(batch, G, N), C=C.view(batch, G, N),
        dt=dt, **{k: v.to(device) for k, v in params.items()},
    )


def make_pool(S, H, P, N, dtype, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, H, P, N, generator=g).to(device=device, dtype=dtype)


def make_slots(batch, S, pad_rows=(), device="cpu", seed=2):
    """Distinct slots in scrambled order, PAD_SLOT_ID at ``pad_rows``."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(S, generator=g)[:batch].to(torch.int32)
    slots[list(pad_rows)] = PAD_SLOT_ID
    return slots.to(device)


def call(fn, state, inp, slots, *, use_z=True, use_D=True, use_bias=True, softplus=True, out=None):
    D = inp["D"] if use_D else None
    return fn(
        state, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D, slots,
        z=inp["z"] if use_z else None, dt_bias=inp["dt_bias"] if use_bias else None,
        dt_softplus=softplus, out=out,
    )


# (use_z, use_D, use_bias, softplus)
ALL_ON = (True, True, True, True)
ALL_OFF = (False, False, False, False)
NO_Z = (False, True, True, True)
FLAGS = "use_z,use_D,use_bias,softplus"


def check_against_reference(pool, inp, slots, out_dtype, **flags):
    """Run the kernel and the reference on copies of ``pool``; compare out and the whole pool."""
    batch, H, P = inp["x"].shape
    state_k, state_r = pool.clone(), pool.clone()
    out = poisoned((batch, H, P), out_dtype, pool.device)
    got = call(selective_state_update.triton, state_k, inp, slots, out=out, **flags)
    want = call(selective_state_update_ref, state_r, inp, slots, **flags)
    assert got is out

    live = slots != PAD_SLOT_ID
    assert (out[~live] == 0).all()
    assert_close(out[live], want[live], out_dtype)

    touched = torch.zeros(pool.shape[0], dtype=torch.bool, device=pool.device)
    touched[slots[live].long()] = True
    assert torch.equal(state_k[~touched], pool[~touched])
    assert_close(state_k[touched], state_r[touched], pool.dtype)


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize(FLAGS, [ALL_ON, ALL_OFF, NO_Z])
def test_reference_matches_hf(G, use_z, use_D, use_bias, softplus):
    batch, H, P, N, S = 3, 4, 6, 8, 5
    inp = make_inputs(batch, H, P, N, G)
    pool = make_pool(S, H, P, N, torch.float32)
    slots = make_slots(batch, S)

    state = pool.clone()
    out = call(selective_state_update_ref, state, inp, slots, use_z=use_z, use_D=use_D,
               use_bias=use_bias, softplus=softplus)

    # HF takes one state per row, and dt, A, D, dt_bias expanded over head_dim (and A over
    # d_state), as Mamba2Mixer passes them in its recurrent branch.
    hf_state = pool[slots.long()].clone()
    hf_out = hf_update(
        hf_state, inp["x"], inp["dt"][:, :, None].expand(-1, -1, P),
        inp["A"][:, None, None].expand(-1, P, N), inp["B"], inp["C"],
        D=inp["D"][:, None].expand(-1, P) if use_D else None,
        dt_bias=inp["dt_bias"][:, None].expand(-1, P) if use_bias else None,
        dt_softplus=softplus, z=inp["z"] if use_z else None,
    )
    torch.testing.assert_close(out, hf_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[slots.long()], hf_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H,P,N,G", [(4, 16, 16, 1), (4, 10, 8, 2), (6, 80, 16, 3)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(FLAGS, [ALL_ON, ALL_OFF])
def test_triton_matches_reference(
    device, H, P, N, G, state_dtype, dtype, use_z, use_D, use_bias, softplus
):
    batch, S = 5, 9
    inp = make_inputs(batch, H, P, N, G, dtype, device)
    pool = make_pool(S, H, P, N, state_dtype, device)
    slots = make_slots(batch, S, pad_rows=[1, 3], device=device)
    flags = dict(use_z=use_z, use_D=use_D, use_bias=use_bias, softplus=softplus)
    check_against_reference(pool, inp, slots, dtype, **flags)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_pad_rows_are_inert(device, state_dtype):
    H, P, N, G, S = 4, 10, 16, 2, 8
    live_rows, pad_rows = [0, 2, 3, 6], [1, 4, 5]
    batch = len(live_rows) + len(pad_rows)
    pool = make_pool(S, H, P, N, state_dtype, device)
    slots = make_slots(batch, S, pad_rows=pad_rows, device=device)
    inp = make_inputs(batch, H, P, N, G, device=device)
    # stale NaN inputs in the pad rows must not leak anywhere
    for k in ("x", "z", "B", "C", "dt"):
        inp[k][pad_rows] = float("nan")

    padded = pool.clone()
    out_padded = call(selective_state_update.triton, padded, inp, slots)
    assert (out_padded[pad_rows] == 0).all()

    plain = pool.clone()
    per_row = ("x", "z", "B", "C", "dt")
    sub = {k: v[live_rows] if k in per_row else v for k, v in inp.items()}
    out_plain = call(selective_state_update.triton, plain, sub, slots[live_rows])

    assert torch.equal(padded, plain)
    assert torch.equal(out_padded[live_rows], out_plain)


def test_all_pad_rows_touch_nothing(device):
    H, P, N, G, S, batch = 2, 8, 8, 1, 3, 4
    pool = make_pool(S, H, P, N, torch.float32, device)
    state = pool.clone()
    slots = torch.full((batch,), PAD_SLOT_ID, dtype=torch.int32, device=device)
    out = poisoned((batch, H, P), device=device)
    inp = make_inputs(batch, H, P, N, G, device=device)
    call(selective_state_update.triton, state, inp, slots, out=out)
    assert torch.equal(state, pool)
    assert (out == 0).all()


def test_public_op_runs_reference_on_cpu():
    batch, H, P, N, G, S = 3, 4, 8, 8, 2, 4
    inp = make_inputs(batch, H, P, N, G)
    slots = make_slots(batch, S, pad_rows=[1])
    pool = make_pool(S, H, P, N, torch.bfloat16)
    state, state_ref = pool.clone(), pool.clone()
    out = poisoned((batch, H, P))
    assert call(selective_state_update, state, inp, slots, out=out) is out
    want = call(selective_state_update_ref, state_ref, inp, slots)
    assert torch.equal(out, want)
    assert torch.equal(state, state_ref)


@pytest.mark.parametrize("fn", [selective_state_update.triton, selective_state_update_ref])
def test_rejects_bad_arguments(fn):
    batch, H, P, N, G, S = 2, 4, 8, 8, 2, 4
    inp = make_inputs(batch, H, P, N, G)
    pool = make_pool(S, H, P, N, torch.float32)
    slots = make_slots(batch, S)
    with pytest.raises(ValueError, match="int32"):
        call(fn, pool, inp, slots.long())
    with pytest.raises(ValueError, match="out must have"):
        call(fn, pool, inp, slots, out=torch.empty(batch, H, P, dtype=torch.bfloat16))
    three_groups = {k: inp[k][:, :1].expand(-1, 3, -1) for k in ("B", "C")}
    with pytest.raises(ValueError, match="multiple of groups"):
        call(fn, pool, {**inp, **three_groups}, slots)
    with pytest.raises(ValueError, match="shape"):
        call(fn, pool, {**inp, "dt": inp["dt"][:, :2]}, slots)


def test_triton_rejects_strided_last_dim():
    batch, H, P, N, G, S = 2, 4, 8, 8, 2, 4
    inp = make_inputs(batch, H, P, N, G)
    x = torch.randn(batch, H, P, 2)[..., 0]
    pool, slots = make_pool(S, H, P, N, torch.float32), make_slots(batch, S)
    with pytest.raises(ValueError, match="last dim"):
        call(selective_state_update.triton, pool, {**inp, "x": x}, slots)


@pytest.mark.parametrize("P,N", [(64, 128), (80, 128), (64, 64), (10, 16)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_row", [True, False])
def test_block_config_is_a_legal_tile(P, N, state_dtype, one_row):
    block_p, block_n, num_warps = _block_config(P, N, state_dtype, one_row)
    for v in (block_p, block_n, num_warps):
        assert v & (v - 1) == 0
    assert block_n >= N and block_p <= triton.next_power_of_2(P)
    if P == 80:
        # no half-empty tiles for the non-power-of-two head dim
        assert P % block_p == 0


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64, 256])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("P", [64, 80])
def test_full_shape_matches_reference(batch, state_dtype, P):
    H, N, G = 128, 128, 8
    S = batch + 7
    inp = make_inputs(batch, H, P, N, G, torch.bfloat16, "cuda")
    pool = make_pool(S, H, P, N, state_dtype, "cuda")
    pad_rows = list(range(3, batch, 16))
    slots = make_slots(batch, S, pad_rows=pad_rows, device="cuda")
    check_against_reference(pool, inp, slots, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_graph_replay_matches_eager_without_sync(state_dtype):
    batch, H, P, N, G, S = 64, 128, 64, 128, 8, 80
    inp = make_inputs(batch, H, P, N, G, torch.bfloat16, "cuda")
    pool = make_pool(S, H, P, N, state_dtype, "cuda")
    slots = make_slots(batch, S, pad_rows=[5, 40], device="cuda")

    eager_state = pool.clone()
    eager_out = call(selective_state_update.triton, eager_state, inp, slots)

    state = pool.clone()
    out = poisoned((batch, H, P), torch.bfloat16, "cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # only the launch is checked: entering the capture context syncs by itself
        torch.cuda.set_sync_debug_mode("error")
        try:
            call(selective_state_update.triton, state, inp, slots, out=out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # capture does not run the kernel: the state is still the pool's
    assert torch.equal(state, pool)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(state, eager_state)
    assert torch.equal(out, eager_out)
