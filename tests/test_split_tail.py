"""Mamba2's decode tail split over K (state update, gated norm, out_proj as one kernel whose
output stays pending) and the next block's norm_linear that takes it: against the references,
and the pair against the unfused ops of a block."""

import pytest
import torch

from mambastep.kernels.decode_linear import gated_norm_linear_ref, norm_linear_ref, norm_linear_triton
from mambastep.kernels.split_tail import SCALE, Pending, pending_ref, split_count, split_tail_ref, split_tail_triton
from mambastep.kernels.state_update import selective_state_update_ref
from mambastep.kernels.varlen import PAD_SLOT_ID
from support import assert_close, poisoned

BF16 = torch.bfloat16


def _block(device, M, H=4, P=24, N=16, G=2, n_out=20, bias=False, seed=0):
    """Operands of one Mamba2 decode tail: the last row is padding (its inputs NaN) when M > 1."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    slots = torch.tensor([3, PAD_SLOT_ID][:M] if M <= 2 else [3, 0, PAD_SLOT_ID], dtype=torch.int32)
    t = dict(
        state=r(5, H, P, N) * 0.5,
        x=r(M, H, P).to(BF16), dt=r(M, H).to(BF16), A=-torch.rand(H, generator=g) - 0.5,
        B=r(M, G, N).to(BF16), C=r(M, G, N).to(BF16), D=r(H), slot_idx=slots,
        z=r(M, H, P).to(BF16), dt_bias=r(H) * 0.1,
        norm_w=(1 + 0.1 * r(H * P)).to(BF16), weight=(r(n_out, H * P) / (H * P) ** 0.5).to(BF16),
        bias=r(n_out).to(BF16) if bias else None, residual=r(M, n_out),
    )
    pad = slots < 0
    for k in ("x", "z", "dt", "B", "C"):
        t[k][pad] = float("nan")
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in t.items()}


def _cpu(t):
    return {k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in t.items()}


def _split(fn, t, norm_groups, eps=1e-5):
    M, n_out = t["residual"].shape
    acc = torch.zeros(M, norm_groups, n_out, dtype=torch.int64, device=t["x"].device)
    return fn(t["state"], t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["slot_idx"], t["z"],
              dt_bias=t["dt_bias"], norm_w=t["norm_w"], norm_groups=norm_groups, eps=eps, weight=t["weight"],
              bias=t["bias"], residual=t["residual"], acc=acc)


@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("norm_groups", [1, 2])
def test_split_tail_matches_reference(device, M, norm_groups):
    t = _block(device, M, seed=M + norm_groups)
    ref_t = _cpu(t)
    got = _split(split_tail_triton, t, norm_groups)
    ref = _split(split_tail_ref, ref_t, norm_groups)
    H, P, N = t["x"].shape[1], t["x"].shape[2], t["B"].shape[2]
    assert got.ssq.shape == (M, split_count(H, P))
    assert_close(t["state"].cpu(), ref_t["state"])
    assert_close(got.ssq.cpu(), ref.ssq)
    assert_close(got.acc.cpu().double() / SCALE, ref.acc.double() / SCALE)
    pad = (t["slot_idx"] < 0).cpu()
    assert (got.acc.cpu()[pad] == 0).all() and (got.ssq.cpu()[pad] == 0).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("norm_groups", [1, 2])
def test_pending_input_matches_reference(device, bias, norm_groups):
    """norm_linear over a pending output: the new residual stream it writes and its product."""
    M, K, n_in = 2, 20, 37
    t = _block(device, M, n_out=K, bias=bias, seed=5)
    t["slot_idx"][:] = torch.tensor([3, 1], dtype=torch.int32)
    t["x"], t["z"], t["dt"] = (v.nan_to_num() for v in (t["x"], t["z"], t["dt"]))
    t["B"], t["C"] = t["B"].nan_to_num(), t["C"].nan_to_num()
    pending = _split(split_tail_ref, _cpu(t), norm_groups)
    pending = Pending(*(v.to(device) if isinstance(v, torch.Tensor) else v for v in pending))
    norm_w = torch.randn(K).to(BF16)
    w = (torch.randn(n_in, K) / K**0.5).to(BF16)
    new_res, out = poisoned((M, K), torch.float32, device), poisoned((M, n_in), BF16, device)
    norm_linear_triton(new_res, norm_w.to(device), 1e-5, w.to(device), pending=pending, out=out)
    ref_res = torch.empty(M, K)
    ref = norm_linear_ref(ref_res, norm_w, 1e-5, w, pending=Pending(*(v.cpu() if isinstance(v, torch.Tensor) else v
                                                                      for v in pending)))
    assert_close(new_res.cpu(), ref_res)
    assert_close(out.cpu(), ref, BF16, factor=0.25)


@pytest.mark.parametrize("norm_groups", [1, 2])
def test_split_block_equals_unfused_ops(device, norm_groups):
    """The oracle: state update, gated norm, out_proj and the residual add as separate ops."""
    M = 2
    t = _block(device, M, bias=True, seed=11)
    ref_t = _cpu(t)
    pending = _split(split_tail_triton, t, norm_groups)
    got = pending_ref(Pending(*(v.cpu() if isinstance(v, torch.Tensor) else v for v in pending)))
    y = selective_state_update_ref(ref_t["state"], ref_t["x"], ref_t["dt"], ref_t["A"], ref_t["B"], ref_t["C"],
                                   ref_t["D"], ref_t["slot_idx"], dt_bias=ref_t["dt_bias"])
    residual = ref_t["residual"].clone()
    K = y.shape[1] * y.shape[2]
    gated_norm_linear_ref(y.view(M, K), ref_t["z"].view(M, K), ref_t["norm_w"], K // norm_groups, 1e-5,
                          ref_t["weight"], bias=ref_t["bias"], residual=residual)
    assert_close(t["state"].cpu(), ref_t["state"])
    assert_close(got[:1], residual[:1], BF16, factor=0.25)  # the live row; the pad row has no oracle


def test_pending_is_refused_where_it_cannot_run(device):
    t = _block(device, 1, n_out=20)
    pending = _split(split_tail_ref if device.type == "cpu" else split_tail_triton, t, 1)
    w = torch.randn(8, 20, device=device).to(BF16)
    with pytest.raises(ValueError, match="must not be pending.residual"):
        norm_linear_triton(t["residual"], torch.ones(20, device=device), 1e-5, w, pending=pending)
    with pytest.raises(ValueError, match="rounds to"):
        norm_linear_triton(torch.empty(1, 20, device=device), torch.ones(20, device=device), 1e-5, w.float(),
                           pending=pending)
    with pytest.raises(ValueError, match="block norm"):
        norm_linear_triton(torch.empty(1, 20, device=device), None, 1e-5, w, pending=pending)


@pytest.mark.gpu
def test_split_tail_is_deterministic():
    """The fixed-point sums are the same bits whatever order the programs add them in."""
    runs = []
    for _ in range(5):
        t = _block(torch.device("cuda"), 2, H=24, P=64, N=128, G=1, n_out=768, seed=3)
        runs.append(_split(split_tail_triton, t, 1).acc.clone())
    assert all(torch.equal(runs[0], r) for r in runs[1:])
