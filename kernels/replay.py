"""Row moves for a verify step's Mamba2 replay (``runtime.replay``), a launch each.

A verify step's Mamba2 layer scans, before each sequence's own tokens, the accepted drafts of
the step before, from the rows its in_proj wrote for them then (``StatePool.record``):
``gather_rows`` lays out ``[replayed rows, own rows]`` a sequence for the conv and the scan, from
the record and the packed rows; after the scan, ``take_rows`` takes the own rows' outputs back
out of the layout and keeps this step's drafts' rows in the record for the next (the record's
rows were read by then). Plain copies, bit for bit, so the references are exact.

Where a step's sequences are short (the token-by-token scan's steps), ``replay_conv`` does in
one launch what the gather, the conv's two launches and the record's keep do: a program a
sequence and block of columns reads the sequence's rows where they are (the record or the
packed rows), convolves them, writes the conv states and keeps the drafts' rows; the scan then
writes its outputs straight to the packed rows (``ssd_short_scan(..., out_rows=)``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .conv1d import conv1d_varlen_ref
from .dispatch import with_reference
from .varlen import PrefillMetadata

__all__ = ["gather_rows", "gather_rows_ref", "replay_conv", "replay_conv_ref", "take_rows", "take_rows_ref"]

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


@triton.jit
def _replay_conv_kernel(
    a_ptr, rec_ptr, src_ptr, keep_ptr, own_ptr, w_ptr, b_ptr, state_ptr, out_ptr, y_ptr,
    cu_ptr, seq_idx_ptr, slot_ptr, init_ptr, final_ptr, snap_ptr, snap_row_ptr,
    n_seqs, Tp, D, W, Wy,
    s_a, s_rec, s_out, s_y, ss_s, ss_d, ss_k, sw_d, sw_k, sb_d,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    # grid: (max_seqs + 1, column blocks of W); the last row of programs zeroes y's dead rows
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if i == n_seqs:
        # packed rows whose layout row no live sequence holds: the scan writes nothing there
        for p0 in range(0, Tp, BLOCK_R):
            p = p0 + tl.arange(0, BLOCK_R)
            lr = tl.load(own_ptr + p, mask=p < Tp, other=0)
            sq = tl.load(seq_idx_ptr + lr, mask=p < Tp, other=-1)
            sl = tl.load(slot_ptr + tl.maximum(sq, 0), mask=p < Tp, other=-1)
            dead = (p < Tp) & ((sq < 0) | (sl < 0))
            zeros = tl.zeros((BLOCK_R, BLOCK_D), y_ptr.dtype.element_ty)
            tl.store(y_ptr + p.to(tl.int64)[:, None] * s_y + c[None, :], zeros, mask=dead[:, None] & (c < Wy)[None, :])
        return
    slot = tl.load(slot_ptr + i).to(tl.int64)
    start = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    if (slot < 0) | (end <= start):
        return
    conv_col = c < D
    in_w = c < W
    has_init = tl.load(init_ptr + i) != 0
    s_col = state_ptr + slot * ss_s + c * ss_d  # [BLOCK_D] the slot's window, column 0
    if HAS_BIAS:
        bias = tl.load(b_ptr + c * sb_d, mask=conv_col, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_D,), tl.float32)

    # each row's K taps: layout rows from the sequence's start (each from the record or the packed
    # rows, as src says), the initial window's columns before it, else zeros
    for r0 in range(start, end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < end
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        for j in tl.static_range(K):
            p = r - (K - 1) + j
            from_rows = r_ok & (p >= start)
            sp = tl.load(src_ptr + tl.maximum(p, 0), mask=from_rows, other=0).to(tl.int64)
            # (tap K - 1, the row itself, carries dt on)
            v = _source_rows(a_ptr, rec_ptr, sp, c, from_rows[:, None] & in_w[None, :], s_a, s_rec)
            old_ok = tl.where(has_init, r_ok & (p < start), False)
            old = tl.load(s_col[None, :] + tl.maximum(p - start + K - 1, 0)[:, None] * ss_k,
                          mask=old_ok[:, None] & conv_col[None, :], other=0.0)
            tap = tl.where(old_ok[:, None], old.to(tl.float32), v.to(tl.float32))
            w = tl.load(w_ptr + c * sw_d + j * sw_k, mask=conv_col, other=0.0).to(tl.float32)
            acc += tap * w[None, :]
        acc += bias[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        out = tl.where(conv_col[None, :], acc, v.to(tl.float32))
        tl.store(out_ptr + r.to(tl.int64)[:, None] * s_out + c[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & in_w[None, :])

    # the windows before the sequence's end and before its snapshot's row, read before any write
    # (either may go to the slot the initial window came from)
    final = tl.load(final_ptr + i).to(tl.int64)
    snap = tl.load(snap_ptr + i).to(tl.int64)
    jk = tl.arange(0, BLOCK_K)
    last = _replay_window(a_ptr, rec_ptr, src_ptr, s_col, c, conv_col, start, end, has_init, s_a, s_rec, ss_k,
                          K, BLOCK_K)
    at = _replay_window(a_ptr, rec_ptr, src_ptr, s_col, c, conv_col, start, tl.load(snap_row_ptr + i), has_init,
                        s_a, s_rec, ss_k, K, BLOCK_K)
    tl.debug_barrier()
    j_ok = (jk < K - 1)[:, None]
    tl.store(state_ptr + tl.maximum(final, 0) * ss_s + jk[:, None] * ss_k + c[None, :] * ss_d, last,
             mask=j_ok & (c < tl.where(final >= 0, D, 0))[None, :])
    tl.store(state_ptr + tl.maximum(snap, 0) * ss_s + jk[:, None] * ss_k + c[None, :] * ss_d, at,
             mask=j_ok & (c < tl.where(snap >= 0, D, 0))[None, :])
    # this step's drafts' rows kept in the record, once every record row was read
    for r0 in range(start, end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        sp = tl.load(src_ptr + r, mask=r < end, other=-1).to(tl.int64)
        kp = tl.load(keep_ptr + tl.maximum(sp, 0), mask=sp >= 0, other=-1).to(tl.int64)
        m = (kp >= 0)[:, None] & in_w[None, :]
        v = tl.load(a_ptr + tl.maximum(sp, 0)[:, None] * s_a + c[None, :], mask=m)
        tl.store(rec_ptr + kp[:, None] * s_rec + c[None, :], v, mask=m)


@triton.jit
def _source_rows(a_ptr, rec_ptr, sp, c, m, s_a, s_rec):
    """Columns ``c`` of the rows ``sp`` names (``gather_rows``' src: a's row, or the record's as
    -1 - row), zero where ``m`` [rows, columns] is off."""
    v = tl.load(a_ptr + sp[:, None] * s_a + c[None, :], mask=m & (sp >= 0)[:, None], other=0.0)
    kept = tl.load(rec_ptr + (-1 - sp)[:, None] * s_rec + c[None, :], mask=m & (sp < 0)[:, None], other=0.0)
    return tl.where((sp < 0)[:, None], kept, v)


@triton.jit
def _replay_window(a_ptr, rec_ptr, src_ptr, s_col, c, conv_col, start, end, has_init, s_a, s_rec, ss_k,
                   K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_K, BLOCK_D]: the K - 1 inputs before layout row ``end``, oldest first (row j holds
    position end - (K - 1) + j: a layout row from the sequence's ``start``, else the initial
    window's column, else zero), in the state's dtype."""
    jk = tl.arange(0, BLOCK_K)
    p = end - (K - 1) + jk
    from_rows = (jk < K - 1) & (p >= start)
    from_state = tl.where(has_init, (jk < K - 1) & (p < start), False)
    sp = tl.load(src_ptr + tl.maximum(p, 0), mask=from_rows, other=0).to(tl.int64)
    v = _source_rows(a_ptr, rec_ptr, sp, c, from_rows[:, None] & conv_col[None, :], s_a, s_rec)
    old = tl.load(s_col[None, :] + tl.maximum(p - start + K - 1, 0)[:, None] * ss_k,
                  mask=from_state[:, None] & conv_col[None, :], other=0.0)
    return tl.where(from_state[:, None], old, v.to(old.dtype))


def replay_conv_ref(a: torch.Tensor, record: torch.Tensor, src: torch.Tensor, keep: torch.Tensor, own: torch.Tensor,
                    weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor, meta: PrefillMetadata,
                    y: torch.Tensor, *, out: torch.Tensor | None = None,
                    activation: str | None = "silu") -> torch.Tensor:
    """The gather, the conv (``conv1d_varlen_ref``) and the keep, one after the other."""
    D = weight.shape[0]
    rows = gather_rows_ref(a, record, src)
    conv = conv1d_varlen_ref(rows[:, :D], weight, bias, conv_state, meta, activation=activation)
    if out is None:
        out = torch.empty(rows.shape, dtype=a.dtype, device=a.device)
    seq = meta.seq_idx[: rows.shape[0]].long()
    live = (seq >= 0) & (meta.slot_idx.long()[seq.clamp(min=0)] >= 0)
    out[live, :D], out[live, D:] = conv[live], rows[live, D:]
    kept = keep.long() >= 0
    record[keep.long()[kept]] = a[kept]
    y[~live[own.long()]] = 0
    return out


@with_reference(replay_conv_ref)
def replay_conv(a: torch.Tensor, record: torch.Tensor, src: torch.Tensor, keep: torch.Tensor, own: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor, meta: PrefillMetadata,
                y: torch.Tensor, *, out: torch.Tensor | None = None, activation: str | None = "silu") -> torch.Tensor:
    """A verify step's Mamba2 rows laid out and convolved, in one launch: ``gather_rows``, then
    ``conv1d_varlen`` over the xBC columns, then ``take_rows``' keep.

    a:       [Tp, W] the packed rows' in_proj columns past z, [xBC (D) | dt]
    record:  [Rr, W] the slots' kept rows (``StatePool.record``), a's dtype
    src:     [E] each layout row's source (``gather_rows``); keep: [Tp] the record row each
             packed row is kept in, or -1; own: [Tp] each packed row's layout row
    weight, bias, conv_state: the conv's (``conv1d_varlen``); meta: its metadata over the layout
    y:       [Tp, Wy <= W] the scan's outputs: the rows whose layout row no live sequence holds are
             zeroed here (the scan writes the others, ``ssd_short_scan(..., out_rows=src)``)
    out:     [E, W] a's dtype, allocated when None: a live layout row's conv output (D columns)
             and its dt as read; other rows unwritten

    Every read of the record and of the conv states comes before this launch's writes to them,
    as in the three launches it replaces. Each program walks a sequence's rows, so this is for
    steps of short sequences. Returns out."""
    Tp, W = a.shape
    D, K = weight.shape
    E = src.shape[0]
    if out is None:
        out = torch.empty(E, W, dtype=a.dtype, device=a.device)
    for name, t, shape in (("record", record, (record.shape[0], W)), ("out", out, (E, W)),
                           ("conv_state", conv_state, (conv_state.shape[0], D, K - 1))):
        if tuple(t.shape) != shape or (name != "conv_state" and t.stride(1) != 1) or t.device != a.device:
            raise ValueError(f"replay_conv: {name} must be {list(shape)} on {a.device}, last dim contiguous; "
                             f"got {tuple(t.shape)} with strides {t.stride()} on {t.device}")
    if a.stride(1) != 1 or y.stride(1) != 1 or D > W or y.shape[0] != Tp or y.shape[1] > W:
        raise ValueError(f"replay_conv: a [{Tp}, {W}] and y [{Tp}, at most {W}] with contiguous rows and {D} conv "
                         f"channels at most W; got a {tuple(a.shape)}, y {tuple(y.shape)}")
    if not (keep.shape[0] == own.shape[0] == Tp) or meta.seq_idx.shape[0] < E:
        raise ValueError(f"replay_conv: keep and own need {Tp} entries and meta {E} rows; got {keep.shape[0]}, "
                         f"{own.shape[0]} and {meta.seq_idx.shape[0]}")
    if activation not in ("silu", None):
        raise ValueError(f"replay_conv: activation must be 'silu' or None, got {activation!r}")
    block_d = 256
    n_seqs = meta.slot_idx.shape[0]
    _replay_conv_kernel[(n_seqs + 1, triton.cdiv(W, block_d))](
        a, record, src, keep, own, weight, weight if bias is None else bias, conv_state, out, y,
        meta.cu_seqlens, meta.seq_idx, meta.slot_idx, meta.has_initial_state, meta.final_slot, meta.snapshot_slot,
        meta.snapshot_row, n_seqs, Tp, D, W, y.shape[1],
        a.stride(0), record.stride(0), out.stride(0), y.stride(0), *conv_state.stride(), *weight.stride(),
        0 if bias is None else bias.stride(0),
        K=K, BLOCK_K=triton.next_power_of_2(K), BLOCK_R=8, BLOCK_D=block_d,
        HAS_BIAS=bias is not None, SILU=activation == "silu", num_warps=4,
    )
    return out
