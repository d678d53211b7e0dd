"""Row moves for a verify step's Mamba2 replay (``runtime.speculative``): a gather of rows from
two sources into one packed buffer, and a scatter of rows into a record.

A verify step's Mamba2 layer scans, before each sequence's own tokens, the accepted drafts of
the step before, from the rows its in_proj wrote for them then (``StatePool.record``): the
gather lays out ``[replayed rows, own rows]`` a sequence for the conv and the scan, and later
takes the own rows' outputs back out; the scatter keeps this step's draft rows for the next.
Plain copies, bit for bit, so the reference is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import with_reference

__all__ = ["gather_rows", "gather_rows_ref", "scatter_rows", "scatter_rows_ref"]

_BLOCK = 1024


@triton.jit
def _gather_rows_kernel(a_ptr, b_ptr, src_ptr, out_ptr, W, s_a, s_b, s_out, BLOCK: tl.constexpr):
    # grid: (rows of out, cdiv(W, BLOCK))
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < W
    src = tl.load(src_ptr + row).to(tl.int64)
    if src >= 0:
        v = tl.load(a_ptr + src * s_a + cols, mask=ok)
    else:
        v = tl.load(b_ptr + (-1 - src) * s_b + cols, mask=ok)
    tl.store(out_ptr + row * s_out + cols, v, mask=ok)


def gather_rows_ref(a: torch.Tensor, b: torch.Tensor | None, src: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        out = torch.empty(src.shape[0], a.shape[1], dtype=a.dtype, device=a.device)
    src = src.long()
    own = src >= 0
    out[own] = a[src[own]]
    if b is not None and not own.all():
        out[~own] = b[-1 - src[~own]]
    return out


@with_reference(gather_rows_ref)
def gather_rows(a: torch.Tensor, b: torch.Tensor | None, src: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """out[i] = a[src[i]] where src[i] >= 0, else b[-1 - src[i]].

    a: [Ra, W], b: [Rb, W] or None (src all >= 0), of one dtype, last dim contiguous (row
    strides free); src: [R] int32 or int64 on their device; out: [R, W] (last dim contiguous),
    allocated when None. Returns out."""
    W = a.shape[1]
    if out is None:
        out = torch.empty(src.shape[0], W, dtype=a.dtype, device=a.device)
    b = a if b is None else b
    for name, t in (("a", a), ("b", b), ("out", out)):
        if t.dim() != 2 or t.shape[1] != W or t.stride(1) != 1 or t.dtype != a.dtype:
            raise ValueError(f"gather_rows: {name} must be [rows, {W}] of {a.dtype}, last dim contiguous; "
                             f"got {tuple(t.shape)} of {t.dtype} with strides {t.stride()}")
    if out.shape[0] != src.shape[0]:
        raise ValueError(f"gather_rows: out has {out.shape[0]} rows for {src.shape[0]} sources")
    if src.shape[0]:
        _gather_rows_kernel[(src.shape[0], triton.cdiv(W, _BLOCK))](
            a, b, src, out, W, a.stride(0), b.stride(0), out.stride(0), BLOCK=_BLOCK, num_warps=4)
    return out


@triton.jit
def _scatter_rows_kernel(x_ptr, dst_ptr, out_ptr, W, s_x, s_out, BLOCK: tl.constexpr):
    # grid: (rows of x, cdiv(W, BLOCK))
    row = tl.program_id(0).to(tl.int64)
    dst = tl.load(dst_ptr + row).to(tl.int64)
    if dst < 0:
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < W
    tl.store(out_ptr + dst * s_out + cols, tl.load(x_ptr + row * s_x + cols, mask=ok), mask=ok)


def scatter_rows_ref(x: torch.Tensor, dst: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    dst = dst.long()
    keep = dst >= 0
    out[dst[keep]] = x[keep]
    return out


@with_reference(scatter_rows_ref)
def scatter_rows(x: torch.Tensor, dst: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[dst[i]] = x[i] where dst[i] >= 0 (the rest of out as it was).

    x: [R, W], out: [Ro, W] of one dtype, last dim contiguous (row strides free); dst: [R] int32
    or int64, its live entries distinct. Returns out."""
    W = x.shape[1]
    for name, t in (("x", x), ("out", out)):
        if t.dim() != 2 or t.shape[1] != W or t.stride(1) != 1 or t.dtype != x.dtype:
            raise ValueError(f"scatter_rows: {name} must be [rows, {W}] of {x.dtype}, last dim contiguous; "
                             f"got {tuple(t.shape)} of {t.dtype} with strides {t.stride()}")
    if dst.shape[0] != x.shape[0]:
        raise ValueError(f"scatter_rows: {dst.shape[0]} destinations for {x.shape[0]} rows")
    if x.shape[0]:
        _scatter_rows_kernel[(x.shape[0], triton.cdiv(W, _BLOCK))](
            x, dst, out, W, x.stride(0), out.stride(0), BLOCK=_BLOCK, num_warps=4)
    return out
