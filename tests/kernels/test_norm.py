import pytest
import torch
from transformers.models.mamba2 import modeling_mamba2
from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNorm
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm

from hf_models import HF_5_23

from mambastep.kernels.fp8 import Fp8Rows, quantize_rows, quantize_rows_ref
from mambastep.kernels.norm import gated_rms_norm_ref, gated_rms_norm, rms_norm_ref, rms_norm
from support import assert_close, poisoned

# HF's gated norm: Mamba2RMSNormGated from transformers 5.25, MambaRMSNormGated before
HFGatedNorm = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 24, 100])
@pytest.mark.parametrize("res_dtype", [None, torch.float32, "same"])
def test_rms_norm_matches_reference(device, dtype, D, res_dtype):
    torch.manual_seed(0)
    T = 5
    wide = torch.randn(T, D + 7, device=device).to(dtype)
    x = wide[:, 3 : 3 + D]  # a row-strided view
    w = torch.randn(D, device=device).to(dtype)
    res = None
    if res_dtype is not None:
        res = torch.randn(T, D, device=device).to(dtype if res_dtype == "same" else res_dtype)
    res_ref = None if res is None else res.cpu().clone()
    out = poisoned((T, D), dtype, device)
    rms_norm.triton(x, w, 1e-5, residual=res, out=out)
    ref = rms_norm_ref(x.cpu(), w.cpu(), 1e-5, residual=res_ref)
    assert_close(out.cpu(), ref, dtype)
    if res is not None:
        # the residual now holds residual + x, rounded to its dtype
        assert_close(res.cpu(), res_ref, res.dtype)


@pytest.mark.parametrize("walk", [False, True], ids=["whole-row", "walked"])
@pytest.mark.parametrize("D", [24, 2688])
def test_rms_norm_writes_its_output_quantized_per_row_as_the_quantizer_would(device, D, walk, monkeypatch):
    """``rows``: out as without rows and, beside it, its rows as FP8 values and scales, bit for bit
    what ``quantize_rows`` makes of out (a zero row included); the buffers poisoned first. The
    reference the same. The row quantized from registers, or (past ``WHOLE_ROW_MAX_ROWS`` rows,
    here all) read back from out in tiles (2688 columns: two and part of a third)."""
    from mambastep.kernels import fp8

    monkeypatch.setattr(fp8, "WHOLE_ROW_MAX_ROWS", 0 if walk else 256)
    torch.manual_seed(5)
    T = 6
    x = (torch.randn(T, D) * torch.tensor([[1.0], [30.0], [0.01], [0.0], [2.0], [1.0]])).to(torch.bfloat16)
    res = torch.randn(T, D).to(torch.float32)
    res[3] = -x[3].float()  # this row's sum is zero: a zero row, scale at its floor
    w = torch.randn(D).to(torch.bfloat16)
    for norm in (rms_norm.triton, rms_norm_ref):
        r = res.clone().to(device)
        out = poisoned((T, D), torch.bfloat16, device)
        rows = Fp8Rows(torch.full((T, D), 3.0, device=device).to(torch.float8_e4m3fn),
                       torch.full((T, 1), -1.0, device=device))
        norm(x.to(device), w.to(device), 1e-5, residual=r, out=out, rows=rows)
        assert torch.equal(out, norm(x.to(device), w.to(device), 1e-5, residual=res.clone().to(device),
                                     out=torch.empty_like(out)))
        q, s = (quantize_rows.triton if norm is rms_norm.triton else quantize_rows_ref)(out)
        assert torch.equal(rows.scale.cpu(), s.cpu()) and torch.equal(rows.values.cpu().float(), q.cpu().float())
        assert (rows.values[3].cpu().float() == 0).all()


def test_rms_norm_refuses_rows_of_the_wrong_shape_or_dtype():
    x, w = torch.randn(4, 16), torch.randn(16)
    for rows, what in ((Fp8Rows.empty(4, 8, "cpu"), "rms_norm: rows must be"),
                       (Fp8Rows(torch.empty(4, 16, dtype=torch.float8_e4m3fn), torch.empty(4, 2)), "float32 scales")):
        with pytest.raises(ValueError, match=what):
            rms_norm.triton(x, w, 1e-5, rows=rows)


def test_round_first_chooses_the_hf_variant(device):
    """bf16: Mamba2 rounds the normalised row before the weight, NemotronH only the product."""
    torch.manual_seed(4)
    D = 64
    x = torch.randn(5, D).to(torch.bfloat16)
    hf_m = Mamba2RMSNorm(D, eps=1e-5).to(torch.bfloat16)
    hf_n = NemotronHRMSNorm(D, eps=1e-5).to(torch.bfloat16)
    w = torch.randn(D).to(torch.bfloat16)
    hf_m.weight.data, hf_n.weight.data = w.clone(), w.clone()
    if HF_5_23:  # the rounding order of HF's norms as of the version CI tests against
        assert torch.equal(rms_norm_ref(x, w, 1e-5), hf_m(x))
        assert torch.equal(rms_norm_ref(x, w, 1e-5, round_first=False), hf_n(x))
    for round_first in (True, False):
        out = poisoned((5, D), torch.bfloat16, device)
        rms_norm.triton(x.to(device), w.to(device), 1e-5, out=out, round_first=round_first)
        assert_close(out.cpu(), rms_norm_ref(x, w, 1e-5, round_first=round_first), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,groups", [(16, 1), (48, 4), (40, 2)])
def test_gated_rms_norm_matches_reference(device, dtype, D, groups):
    torch.manual_seed(1)
    T = 6
    zx = torch.randn(T, 2 * D + 3, device=device).to(dtype)
    z, x = zx[:, :D], zx[:, D + 3 :]
    w = torch.randn(D, device=device).to(dtype)
    out = poisoned((T, D), dtype, device)
    gated_rms_norm.triton(x, z, w, D // groups, 1e-6, out=out)
    ref = gated_rms_norm_ref(x.cpu(), z.cpu(), w.cpu(), D // groups, 1e-6)
    assert_close(out.cpu(), ref, dtype)


@pytest.mark.parametrize("split", [False, True], ids=["whole-row", "split"])
@pytest.mark.parametrize("D, groups", [(48, 3), (4096, 8), (8192, 8), (10240, 8)])
def test_gated_rms_norm_writes_its_output_quantized_per_row_as_the_quantizer_would(device, D, groups, split,
                                                                                    monkeypatch):
    """``rows``: out as without rows and, beside it, the row quantized bit for bit as
    ``quantize_rows`` makes it of out (a zero row included; the buffers poisoned); the reference
    the same. Groups not a power of two included, and Nemotron-H-8B's and Nemotron-Nano-9B-v2's
    (8 x 1024, 8 x 1280). Split into the no-rows kernel and a launch quantizing its groups (past
    ``WHOLE_ROW_MAX_ROWS`` rows, here all), out is the no-rows kernel's to the bit; a program
    holding the whole row reduces each group over other warps, so out equals it to a rounding."""
    from mambastep.kernels import fp8

    monkeypatch.setattr(fp8, "WHOLE_ROW_MAX_ROWS", 0 if split else 256)
    torch.manual_seed(6)
    T = 5
    x = (torch.randn(T, D) * torch.tensor([[1.0], [30.0], [0.01], [0.0], [2.0]])).to(torch.bfloat16)
    z, w = torch.randn(T, D).to(torch.bfloat16), torch.randn(D).to(torch.bfloat16)
    for norm in (gated_rms_norm.triton, gated_rms_norm_ref):
        plain = norm(x.to(device), z.to(device), w.to(device), D // groups, 1e-5)
        out = poisoned((T, D), torch.bfloat16, device)
        rows = Fp8Rows(torch.full((T, D), 3.0, device=device).to(torch.float8_e4m3fn),
                       torch.full((T, 1), -1.0, device=device))
        norm(x.to(device), z.to(device), w.to(device), D // groups, 1e-5, out=out, rows=rows)
        if split or norm is gated_rms_norm_ref:
            assert torch.equal(out, plain)
        else:
            assert_close(out.cpu(), plain.cpu(), torch.bfloat16)
        q, s = (quantize_rows.triton if norm is gated_rms_norm.triton else quantize_rows_ref)(out)
        assert torch.equal(rows.scale.cpu(), s.cpu()) and torch.equal(rows.values.cpu().float(), q.cpu().float())
        assert (rows.values[3].cpu().float() == 0).all()
    with pytest.raises(ValueError, match="gated_rms_norm: rows must be"):
        gated_rms_norm.triton(x, z, w, D // groups, 1e-5, rows=Fp8Rows.empty(T, 8, "cpu"))


@pytest.mark.parametrize("groups", [1, 4])
def test_references_match_hf(groups):
    torch.manual_seed(2)
    D = 32
    if not HF_5_23:
        pytest.skip("HF's gated norm takes a group size from transformers 5.23")
    hf = HFGatedNorm(D, group_size=D // groups, eps=1e-6)
    hf.weight.data = torch.randn(D)
    x, z = torch.randn(3, D), torch.randn(3, D)
    assert_close(gated_rms_norm_ref(x, z, hf.weight, D // groups, 1e-6), hf(x, z))

    hf_norm = Mamba2RMSNorm(D, eps=1e-5)
    hf_norm.weight.data = torch.randn(D)
    assert_close(rms_norm_ref(x, hf_norm.weight, 1e-5), hf_norm(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_full_shape_gpu(dtype):
    torch.manual_seed(3)
    T, D, inner = 256, 4096, 8192
    x = torch.randn(T, D, device="cuda", dtype=dtype)
    res = torch.randn(T, D, device="cuda", dtype=torch.float32)
    res_ref = res.clone()
    w = torch.randn(D, device="cuda", dtype=dtype)
    out = rms_norm.triton(x, w, 1e-5, residual=res)
    assert_close(out, rms_norm_ref(x, w, 1e-5, residual=res_ref), dtype)
    assert torch.equal(res, res_ref)
    xz = torch.randn(T, 2 * inner, device="cuda", dtype=dtype)
    wg = torch.randn(inner, device="cuda", dtype=dtype)
    out = gated_rms_norm.triton(xz[:, inner:], xz[:, :inner], wg, inner // 8, 1e-5)
    assert_close(out, gated_rms_norm_ref(xz[:, inner:], xz[:, :inner], wg, inner // 8, 1e-5), dtype)
