"""RMSNorm with a fused residual add, and Mamba2's gated, grouped RMSNorm.

Both are row-wise: one program normalises one row (or one group of a row), so rows never mix
and padded rows can hold anything without reaching a live row. Either may also write its
output quantized per row (``rows``, ``kernels.fp8.Fp8Rows``) for an FP8 product that reads it
(``kernels.linear.takes_rows``), bit for bit what ``quantize_rows`` would make of it a launch
later.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import with_reference
from .fp8 import Fp8Rows, row_scale, store_chunk_quantized, store_quantized, walks_rows, write_rows_ref

__all__ = ["rms_norm", "rms_norm_ref", "gated_rms_norm", "gated_rms_norm_ref"]


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, q_ptr, s_ptr,
    D, eps,
    stride_x, stride_res, stride_out, stride_q,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
    QUANT: tl.constexpr,
    WALK: tl.constexpr,
    QBLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    if USE_PDL:  # x (and the residual) come from the kernels before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # residual <- residual + x, kept in the residual's dtype (fp32 when residual_in_fp32)
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32) + x
        tl.store(res_ptr + row * stride_res + cols, r.to(res_ptr.dtype.element_ty), mask=mask)
        x = r.to(res_ptr.dtype.element_ty).to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    y = x * tl.rsqrt(var + eps)
    if ROUND_FIRST:
        # HF's Mamba2 rounds the normalised row to the input dtype before scaling by the weight
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (y * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)
    if QUANT:  # the rounded output row, quantized as quantize_rows does (past D: zeros)
        v = out.to(tl.float32)
        scale = row_scale(v)
        tl.store(s_ptr + row, scale)
        if WALK:  # read back from out QBLOCK columns at a time: fewer registers live at once
            tl.debug_barrier()
            qcols = tl.arange(0, QBLOCK)
            for c in range(0, D, QBLOCK):
                ok = c + qcols < D
                u = tl.load(out_ptr + row * stride_out + c + qcols, mask=ok, other=0.0).to(tl.float32)
                store_quantized(q_ptr + row * stride_q + c + qcols, u, scale, ok)
        else:
            store_quantized(q_ptr + row * stride_q + cols, v, scale, mask)


@triton.jit
def _gated_tile(x_ptr, z_ptr, w, out_ptr, row, cols, mask, group_size, eps, stride_x, stride_z, stride_out):
    """A [groups, BLOCK] tile of a row's groups: norm(x * silu(z)) * w, stored rounded to out;
    returned in fp32."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    # norm(x * silu(z)), the gate applied before the norm (Mamba2's norm_before_gate=False)
    x = x * z * tl.sigmoid(z)
    var = tl.sum(x * x, axis=1) / group_size
    y = (x * tl.rsqrt(var + eps)[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    out = (y * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)
    return out.to(tl.float32)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, q_ptr, s_ptr,
    n_groups, group_size, eps,
    stride_x, stride_z, stride_out, stride_q,
    BLOCK: tl.constexpr,
    GROUPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    QUANT: tl.constexpr,
    AMAX: tl.constexpr,
):
    # grid: (rows, cdiv(n_groups, GROUPS)): GROUPS groups of a row a program (QUANT: all of
    # them, the row quantized too); AMAX (a group a program): each group's absolute maximum to
    # s_ptr [rows, n_groups], for _quantize_groups_kernel
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * group_size + k[None, :]
    mask = (g < n_groups)[:, None] & (k < group_size)[None, :]
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        # x and z come from earlier kernels in the stream; only the weight is read before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    v = _gated_tile(x_ptr, z_ptr, w, out_ptr, row, cols, mask, group_size, eps, stride_x, stride_z, stride_out)
    if QUANT:  # the rounded output row, quantized as quantize_rows does
        scale = row_scale(tl.max(tl.abs(v), axis=1))
        tl.store(s_ptr + row, scale)
        store_quantized(q_ptr + row * stride_q + cols, v, scale, mask)
    if AMAX:
        tl.store(s_ptr + row * n_groups + g, tl.max(tl.abs(v), axis=1), mask=g < n_groups)


@triton.jit
def _quantize_groups_kernel(out_ptr, amax_ptr, q_ptr, s_ptr, group_size, stride_out, stride_q,
                            BLOCK: tl.constexpr, GROUPS: tl.constexpr):
    # grid: (rows, groups): a group of out quantized at its row's scale, from the groups' maxima
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    cols = tl.program_id(1) * group_size + k
    mask = k < group_size
    v = tl.load(out_ptr + row * stride_out + cols, mask=mask, other=0.0).to(tl.float32)
    store_chunk_quantized(q_ptr + row * stride_q + cols, v, mask, amax_ptr, s_ptr, row, GROUPS)


def _check_rows(name: str, t: torch.Tensor, rows: int, cols: int) -> None:
    if t.dim() != 2 or t.shape[0] != rows or t.shape[1] != cols:
        raise ValueError(f"{name}: expected shape [{rows}, {cols}], got {list(t.shape)}")
    if t.stride(1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm_ref(x, weight, eps, *, residual=None, out=None, round_first=True, pdl=False, rows=None):
    if residual is not None:
        residual.copy_((residual.float() + x.float()).to(residual.dtype))
        x = residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    dtype = out.dtype if out is not None else x.dtype
    y = weight.float() * (y.to(dtype).float() if round_first else y)
    out = y.to(dtype) if out is None else out.copy_(y)
    write_rows_ref(rows, out)
    return out


@with_reference(rms_norm_ref)
def rms_norm(x, weight, eps, *, residual=None, out=None, round_first=True, pdl=False, rows: Fp8Rows | None = None):
    """RMSNorm of each row, optionally after adding ``x`` into ``residual`` in place.

    x: [T, D] any float dtype; weight: [D]; residual: [T, D] or None (fp32 or x's dtype), updated
    to ``residual + x``, and then it is ``residual`` that is normalised; out: [T, D].
    Returns out = weight * rmsnorm(row), computed in fp32; round_first rounds the normalised row
    to out's dtype before the weight (HF's Mamba2) rather than only the product (NemotronH).
    pdl: launch as a programmatic dependent of the previous kernel (CUDA, sm_90+), as in
    ``kernels.decode_linear``; it signals its own dependents right after its wait.
    rows: FP8 values [T, D] and fp32 scales [T, 1] (``Fp8Rows``) where out is also written
    quantized per row, as ``quantize_rows(out)`` would make it: from the row in registers, or past
    ``fp8.WHOLE_ROW_MAX_ROWS`` rows read back from out in tiles (fewer registers, more programs
    an SM).
    """
    T, D = x.shape
    out = torch.empty_like(x) if out is None else out
    _check_rows("x", x, T, D)
    _check_rows("out", out, T, D)
    if residual is not None:
        _check_rows("residual", residual, T, D)
    if rows is not None:
        rows.check("rms_norm: rows", T, D)
    block = triton.next_power_of_2(D)
    res = residual if residual is not None else x
    q, scale = rows if rows is not None else (out, out)
    _rms_norm_kernel[(T,)](
        x, res, weight, out, q, scale, D, eps,
        x.stride(0), res.stride(0), out.stride(0), q.stride(0),
        HAS_RESIDUAL=residual is not None, ROUND_FIRST=round_first, BLOCK_D=block, USE_PDL=pdl,
        QUANT=rows is not None, WALK=rows is not None and walks_rows(T), QBLOCK=min(block, 1024),
        num_warps=_num_warps(block), **({"launch_pdl": True} if pdl else {}),
    )
    return out


def gated_rms_norm_ref(x, z, weight, group_size, eps, *, out=None, pdl=False, rows=None):
    T, D = x.shape
    h = (x.float() * F.silu(z.float())).view(T, D // group_size, group_size)
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).view(T, D)
    y = weight.float() * h.to(x.dtype).float()
    out = y.to(x.dtype) if out is None else out.copy_(y)
    write_rows_ref(rows, out)
    return out


@with_reference(gated_rms_norm_ref)
def gated_rms_norm(x, z, weight, group_size, eps, *, out=None, pdl=False, rows: Fp8Rows | None = None):
    """Mamba2's gated norm: RMSNorm over groups of ``group_size`` of ``x * silu(z)``.

    x, z: [T, D] (row-strided views allowed); weight: [D]; out: [T, D] in x's dtype.
    pdl: launch as a programmatic dependent of the previous kernel (CUDA, sm_90+), as in
    ``kernels.decode_linear``; it signals its own dependents right after its wait.
    rows: as ``rms_norm``'s, out also written quantized per row: a program a row, not a group,
    holding the whole row; past ``fp8.WHOLE_ROW_MAX_ROWS`` rows the kernel without rows, a program
    a group, keeping each group's absolute maximum, then a launch quantizing the groups at their
    rows' scales (against a program a row walking its groups twice, H100: Nemotron-Nano-9B-v2's
    FP8 mixed step of 64 + 223 rows 1.0% faster, its 2048-token prefill 0.7% slower; in
    docs/experiments.md). Split, out is the kernel's without rows to the bit; held whole, each
    group's sum may be taken over other warps, so out may differ from it by a rounding (the rows
    are always ``quantize_rows`` of the out written).
    """
    T, D = x.shape
    out = torch.empty_like(x) if out is None else out
    for name, t in (("x", x), ("z", z), ("out", out)):
        _check_rows(name, t, T, D)
    if D % group_size:
        raise ValueError(f"group_size {group_size} does not divide {D}")
    if rows is not None:
        rows.check("gated_rms_norm: rows", T, D)
    block, n_groups = triton.next_power_of_2(group_size), D // group_size
    split = rows is not None and walks_rows(T)  # a group a program, as without rows, then the rows
    groups = triton.next_power_of_2(n_groups) if rows is not None and not split else 1
    q, scale = rows if rows is not None else (out, out)
    # split: the kernel stores the groups' maxima where the rows' scales would go
    amax = torch.empty(T, n_groups, dtype=torch.float32, device=x.device) if split else None
    _gated_rms_norm_kernel[(T, triton.cdiv(n_groups, groups))](
        x, z, weight, out, q, scale if amax is None else amax, n_groups, group_size, eps,
        x.stride(0), z.stride(0), out.stride(0), q.stride(0),
        BLOCK=block, GROUPS=groups, USE_PDL=pdl, QUANT=rows is not None and not split, AMAX=split,
        num_warps=_num_warps(block * groups), **({"launch_pdl": True} if pdl else {}),
    )
    if split:
        _quantize_groups_kernel[(T, n_groups)](out, amax, rows.values, rows.scale, group_size, out.stride(0),
                                               rows.values.stride(0), BLOCK=block,
                                               GROUPS=triton.next_power_of_2(n_groups), num_warps=_num_warps(block))
    return out
