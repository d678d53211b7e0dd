import pytest
import torch
import torch.nn.functional as F

from mambastep.kernels.norm import gated_rms_norm_ref, gated_rms_norm_triton, rms_norm_ref, rms_norm_triton
from mambastep.kernels.norm_linear import (
    MAX_ROWS,
    add_norm_linear,
    add_norm_linear_ref,
    add_norm_linear_triton,
    gated_norm_linear,
    gated_norm_linear_ref,
    gated_norm_linear_triton,
)
from support import assert_close, poisoned

DTYPES = [torch.float32, torch.bfloat16]


def _add_inputs(M, D, N, dtype, res_dtype, has_x, device, seed=0):
    torch.manual_seed(seed)
    wide = torch.randn(M, D + 5, device=device).to(dtype)
    x = wide[:, 2 : 2 + D] if has_x else None  # a row-strided view
    res = torch.randn(M, D, device=device).to(res_dtype)
    wn = torch.randn(D, device=device).to(dtype)
    w = torch.randn(N, D, device=device).to(dtype)
    return x, res, wn, w


def _gated_inputs(M, K, N, dtype, device, seed=1):
    torch.manual_seed(seed)
    zy = torch.randn(M, 2 * K + 3, device=device).to(dtype)
    z, y = zy[:, :K], zy[:, K + 3 :]  # row-strided views, as out of in_proj
    wn = torch.randn(K, device=device).to(dtype)
    w = torch.randn(N, K, device=device).to(dtype)
    return y, z, wn, w


def _assert_residual(res_out, ref, device):
    if device.type == "cuda" or res_out.dtype == torch.float32:
        assert torch.equal(res_out, ref)
    else:
        # the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: one ulp apart
        ulp = ref.float().abs() * 2.0**-7
        assert ((res_out.float() - ref.float()).abs() <= ulp).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 16])
# N = 16 is a single program: the one that writes residual_out
@pytest.mark.parametrize("D,N", [(48, 16), (48, 40), (200, 130)])
@pytest.mark.parametrize("res_fp32", [True, False])
@pytest.mark.parametrize("has_x", [True, False])
def test_add_norm_linear_matches_reference(device, dtype, M, D, N, res_fp32, has_x):
    x, res, wn, w = _add_inputs(M, D, N, dtype, torch.float32 if res_fp32 else dtype, has_x, device)
    res_before = res.clone()
    res_out = poisoned((M, D), res.dtype, device)
    out = poisoned((M, N), dtype, device)
    add_norm_linear_triton(x, res, wn, 1e-5, w, residual_out=res_out, out=out)

    res_out_ref = torch.empty(M, D, dtype=res.dtype)
    ref = add_norm_linear_ref(None if x is None else x.cpu(), res.cpu(), wn.cpu(), 1e-5, w.cpu(),
                              residual_out=res_out_ref)
    assert_close(out.cpu(), ref, dtype)
    _assert_residual(res_out.cpu(), res_out_ref, device)
    assert torch.equal(res, res_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("K,group_size,N", [(48, 48, 40), (200, 50, 130), (200, 200, 40)])
def test_gated_norm_linear_matches_reference(device, dtype, M, K, group_size, N):
    y, z, wn, w = _gated_inputs(M, K, N, dtype, device)
    out = poisoned((M, N), dtype, device)
    gated_norm_linear_triton(y, z, wn, group_size, 1e-6, w, out=out)
    ref = gated_norm_linear_ref(y.cpu(), z.cpu(), wn.cpu(), group_size, 1e-6, w.cpu())
    assert_close(out.cpu(), ref, dtype)


def _assert_same_rounding(out, h):
    # the fused norm rounds exactly where the unfused kernel does: a row sum taken in another
    # order may flip a rare rounding, a missing or extra rounding would flip about half of them
    assert (out != h).float().mean() < 0.05
    assert_close(out, h, out.dtype, factor=0.1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_identity_weight_gives_the_unfused_norm(device, dtype):
    M, D = 3, 200
    eye = torch.eye(D, device=device).to(dtype)
    x, res, wn, _ = _add_inputs(M, D, 1, dtype, torch.float32, True, device)
    out = add_norm_linear_triton(x, res, wn, 1e-5, eye, residual_out=torch.empty_like(res))
    h = rms_norm_triton(x, wn, 1e-5, residual=res.clone(), out=torch.empty_like(x))
    _assert_same_rounding(out, h)

    y, z, wn, _ = _gated_inputs(M, D, 1, dtype, device)
    out = gated_norm_linear_triton(y, z, wn, 50, 1e-6, eye)
    _assert_same_rounding(out, gated_rms_norm_triton(y, z, wn, 50, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_x", [True, False])
def test_add_reference_is_norm_then_linear(dtype, has_x):
    M, D, N = 5, 24, 12
    x, res, wn, w = _add_inputs(M, D, N, dtype, torch.float32, has_x, "cpu")
    res_out = poisoned((M, D))
    out = add_norm_linear_ref(x, res, wn, 1e-5, w, residual_out=res_out)

    res_unfused = res.clone()
    h = torch.empty(M, D, dtype=dtype)
    if x is None:
        rms_norm_ref(res_unfused, wn, 1e-5, out=h)
    else:
        rms_norm_ref(x, wn, 1e-5, residual=res_unfused, out=h)
    unfused = F.linear(h, w)
    assert torch.equal(res_out, res_unfused)
    if dtype == torch.float32:
        assert torch.equal(out, unfused)
    else:
        assert_close(out, unfused, dtype, factor=0.1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [1, 4])
def test_gated_reference_is_norm_then_linear(dtype, groups):
    M, K, N = 5, 32, 12
    y, z, wn, w = _gated_inputs(M, K, N, dtype, "cpu")
    out = gated_norm_linear_ref(y, z, wn, K // groups, 1e-6, w)
    unfused = F.linear(gated_rms_norm_ref(y, z, wn, K // groups, 1e-6), w)
    if dtype == torch.float32:
        assert torch.equal(out, unfused)
    else:
        assert_close(out, unfused, dtype, factor=0.1)


def test_public_functions_dispatch(device):
    M, D, N = 3, 48, 40
    x, res, wn, w = _add_inputs(M, D, N, torch.float32, torch.float32, True, device)
    res_out = poisoned((M, D), device=device)
    out = add_norm_linear(x, res, wn, 1e-5, w, residual_out=res_out)
    ref = add_norm_linear_ref(x, res, wn, 1e-5, w, residual_out=torch.empty_like(res))
    assert_close(out, ref)
    y, z, wn, w = _gated_inputs(M, D, N, torch.float32, device)
    out = gated_norm_linear(y, z, wn, D // 2, 1e-6, w)
    assert_close(out, gated_norm_linear_ref(y, z, wn, D // 2, 1e-6, w))


def test_launchers_reject_bad_arguments(device):
    M, D, N = MAX_ROWS + 1, 32, 16
    x, res, wn, w = _add_inputs(M, D, N, torch.float32, torch.float32, True, device)
    with pytest.raises(ValueError, match="at most"):
        add_norm_linear_triton(x, res, wn, 1e-5, w, residual_out=torch.empty_like(res))
    x, res = x[:4], res[:4]
    with pytest.raises(ValueError, match="overlap"):
        add_norm_linear_triton(x, res, wn, 1e-5, w, residual_out=res)
    with pytest.raises(ValueError, match="residual_out"):
        add_norm_linear_triton(x, res, wn, 1e-5, w, residual_out=res.bfloat16())
    with pytest.raises(ValueError, match="weight"):
        add_norm_linear_triton(x, res, wn, 1e-5, w.t().contiguous().t(), residual_out=torch.empty_like(res))
    with pytest.raises(ValueError, match="divide"):
        gated_norm_linear_triton(x, res, wn, 24, 1e-6, w)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("D,N", [(768, 3352), (4096, 18560)], ids=["130m", "8b"])
def test_add_norm_linear_model_shapes_gpu(M, D, N):
    x, res, wn, w = _add_inputs(M, D, N, torch.bfloat16, torch.float32, True, "cuda", seed=2)
    w = w * D**-0.5
    res_out = poisoned((M, D), device="cuda")
    out = add_norm_linear_triton(x, res, wn, 1e-5, w, residual_out=res_out)
    res_out_ref = torch.empty_like(res)
    ref = add_norm_linear_ref(x, res, wn, 1e-5, w, residual_out=res_out_ref)
    assert_close(out, ref, torch.bfloat16)
    assert torch.equal(res_out, res_out_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("K,groups,N", [(1536, 1, 768), (8192, 8, 4096)], ids=["130m", "8b"])
def test_gated_norm_linear_model_shapes_gpu(M, K, groups, N):
    y, z, wn, w = _gated_inputs(M, K, N, torch.bfloat16, "cuda", seed=3)
    w = w * K**-0.5
    out = poisoned((M, N), torch.bfloat16, "cuda")
    gated_norm_linear_triton(y, z, wn, K // groups, 1e-5, w, out=out)
    assert_close(out, gated_norm_linear_ref(y, z, wn, K // groups, 1e-5, w), torch.bfloat16)
