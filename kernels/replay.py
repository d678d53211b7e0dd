"""Row moves for a verify step's Mamba2 replay (``runtime.replay``), a launch each.

A verify step's Mamba2 layer scans, before each sequence's own tokens, the accepted drafts of
the step before, from the rows its in_proj wrote for them then (``StatePool.record``):
``gather_rows`` lays out ``[replayed rows, own rows]`` a sequence for the conv and the scan, from
the record and the packed rows; after the scan, ``take_rows`` takes the own rows' outputs back
out of the layout and keeps this step's drafts' rows in the record for the next (the record's
rows were read by then). Plain copies, bit for bit, so the references are exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import with_reference

__all__ = ["gather_rows", "gather_rows_ref", "take_rows", "take_rows_ref"]

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


def gather_rows_ref(a: torch.Tensor, b: torch.Tensor, src: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        out = torch.empty(src.shape[0], a.shape[1], dtype=a.dtype, device=a.device)
    src = src.long()
    own = src >= 0
    out[own] = a[src[own]]
    out[~own] = b[-1 - src[~own]]
    return out


@with_reference(gather_rows_ref)
def gather_rows(a: torch.Tensor, b: torch.Tensor, src: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """out[i] = a[src[i]] where src[i] >= 0, else b[-1 - src[i]].

    a: [Ra, W], b: [Rb, W] of one dtype, last dim contiguous (row strides free); src: [R] int32
    or int64 on their device; out: [R, W] (last dim contiguous), allocated when None. Returns out."""
    W = a.shape[1]
    if out is None:
        out = torch.empty(src.shape[0], W, dtype=a.dtype, device=a.device)
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
def _take_rows_kernel(y_ptr, own_ptr, out_ptr, x_ptr, keep_ptr, rec_ptr, Wy, Wx, s_y, s_out, s_x, s_rec,
                      BLOCK: tl.constexpr):
    # grid: (rows of out, cdiv(max(Wy, Wx), BLOCK))
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(own_ptr + row).to(tl.int64)
    tl.store(out_ptr + row * s_out + cols, tl.load(y_ptr + src * s_y + cols, mask=cols < Wy), mask=cols < Wy)
    dst = tl.load(keep_ptr + row).to(tl.int64)
    if dst >= 0:
        ok = cols < Wx
        tl.store(rec_ptr + dst * s_rec + cols, tl.load(x_ptr + row * s_x + cols, mask=ok), mask=ok)


def take_rows_ref(y: torch.Tensor, own: torch.Tensor, out: torch.Tensor, x: torch.Tensor, keep: torch.Tensor,
                  record: torch.Tensor) -> torch.Tensor:
    out.copy_(y[own.long()])
    keep = keep.long()
    live = keep >= 0
    record[keep[live]] = x[live]
    return out


@with_reference(take_rows_ref)
def take_rows(y: torch.Tensor, own: torch.Tensor, out: torch.Tensor, x: torch.Tensor, keep: torch.Tensor,
              record: torch.Tensor) -> torch.Tensor:
    """out[i] = y[own[i]], and record[keep[i]] = x[i] where keep[i] >= 0 (the rest of record as it
    was): a verify step's own rows' outputs taken back out of the layout and its drafts' rows kept,
    in one launch.

    y: [Ry, Wy], out: [R, Wy] of one dtype; x: [R, Wx], record: [Rr, Wx] of one dtype; last dims
    contiguous (row strides free); own, keep: [R] int32 or int64, keep's live entries distinct.
    Returns out."""
    Wy, Wx, R = y.shape[1], x.shape[1], out.shape[0]
    for name, t, W, like in (("y", y, Wy, y), ("out", out, Wy, y), ("x", x, Wx, x), ("record", record, Wx, x)):
        if t.dim() != 2 or t.shape[1] != W or t.stride(1) != 1 or t.dtype != like.dtype:
            raise ValueError(f"take_rows: {name} must be [rows, {W}] of {like.dtype}, last dim contiguous; "
                             f"got {tuple(t.shape)} of {t.dtype} with strides {t.stride()}")
    if not (own.shape[0] == keep.shape[0] == x.shape[0] == R):
        raise ValueError(f"take_rows: {own.shape[0]} sources, {keep.shape[0]} destinations and {x.shape[0]} rows "
                         f"for {R} rows of out")
    if R:
        _take_rows_kernel[(R, triton.cdiv(max(Wy, Wx), _BLOCK))](
            y, own, out, x, keep, record, Wy, Wx, y.stride(0), out.stride(0), x.stride(0), record.stride(0),
            BLOCK=_BLOCK, num_warps=4)
    return out
