"""The SSD scan of short packed sequences, token by token: one kernel where the chunked scan
(``ssd``) launches five, for steps of a few tokens a sequence (a speculative step's verify
sequences: the last token, the drafts, the accepted drafts replayed).

One program a (sequence, head, head-dim block) keeps its [BLOCK_P, N] state in registers in
fp32 and walks the sequence's tokens with the decode step's recurrence (``state_update``)::

    dt'   = clamp(softplus(dt + dt_bias), *dt_limit)
    state = state * exp(dt' A) + dt' x B^T
    y     = state C + D x, gated by silu(z)

storing the snapshot (the state before the snapshot's row) and the final state where the
metadata names them (``varlen.PrefillMetadata``), as ``ssd.ssd_scan`` does. The chunked scan's
work grows with the chunk, this one's with the sequence's length, which is serial: it wins for
sequences of a few tokens (``SHORT_TOKENS``). Its reference is the chunked scan's per-token
oracle, ``ssd.ssd_scan_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import with_reference
from .ssd import _check, _zero_skipped_rows_kernel, ssd_scan_ref
from .varlen import PrefillMetadata

__all__ = ["SHORT_TOKENS", "ssd_short_scan", "ssd_short_scan_ref"]

# verify steps of at most this many prefill tokens take the token-by-token scan
SHORT_TOKENS = 64


@triton.jit
def _short_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, out_ptr, state_ptr,
    cu_ptr, slot_ptr, init_ptr, final_ptr, snap_ptr, snap_row_ptr, out_rows_ptr,
    P, N, heads_per_group, dt_min, dt_max,
    s_x_t, s_x_h, s_x_p, s_dt_t, s_dt_h, s_B_t, s_B_g, s_B_n, s_C_t, s_C_g, s_C_n, s_z_t, s_z_h, s_z_p,
    s_o_t, s_o_h, s_o_p, s_st_s, s_st_h, s_st_p, s_st_n,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, OUT_ROWS: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + s).to(tl.int64)
    start = tl.load(cu_ptr + s)
    end = tl.load(cu_ptr + s + 1)
    if (slot < 0) | (end <= start):
        return
    g = h // heads_per_group
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask = mask_p[:, None] & mask_n[None, :]
    within = h * s_st_h + offs_p[:, None] * s_st_p + offs_n[None, :] * s_st_n
    state = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    if tl.load(init_ptr + s) != 0:
        state = tl.load(state_ptr + slot * s_st_s + within, mask=mask, other=0.0).to(tl.float32)
    snap = tl.load(snap_ptr + s).to(tl.int64)
    snap_row = tl.where(snap >= 0, tl.load(snap_row_ptr + s), -1)
    snap_pool = state_ptr + tl.maximum(snap, 0) * s_st_s + within
    A = tl.load(A_ptr + h).to(tl.float32)
    # (int32 offsets: a short step's rows times a row's stride stay far below 2**31)
    for t in range(start, end):
        if t == snap_row:
            tl.store(snap_pool, state.to(state_ptr.dtype.element_ty), mask=mask)
        dt = tl.load(dt_ptr + t * s_dt_t + h * s_dt_h).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(dt_bias_ptr + h).to(tl.float32)
        if DT_SOFTPLUS:
            # torch's softplus threshold: linear above 20
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        x = tl.load(x_ptr + t * s_x_t + h * s_x_h + offs_p * s_x_p, mask=mask_p, other=0.0).to(tl.float32)
        b = tl.load(B_ptr + t * s_B_t + g * s_B_g + offs_n * s_B_n, mask=mask_n, other=0.0).to(tl.float32)
        c = tl.load(C_ptr + t * s_C_t + g * s_C_g + offs_n * s_C_n, mask=mask_n, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * A) + (dt * x)[:, None] * b[None, :]
        y = tl.sum(state * c[None, :], axis=1)
        if HAS_D:
            y += tl.load(D_ptr + h).to(tl.float32) * x
        if HAS_Z:
            z = tl.load(z_ptr + t * s_z_t + h * s_z_h + offs_p * s_z_p, mask=mask_p, other=0.0).to(tl.float32)
            y *= z * tl.sigmoid(z)
        if OUT_ROWS:  # row t's output to out's row out_rows[t], where that is >= 0
            o = tl.load(out_rows_ptr + t)
            tl.store(out_ptr + tl.maximum(o, 0) * s_o_t + h * s_o_h + offs_p * s_o_p, y.to(out_ptr.dtype.element_ty),
                     mask=offs_p < tl.where(o >= 0, P, 0))
        else:
            tl.store(out_ptr + t * s_o_t + h * s_o_h + offs_p * s_o_p, y.to(out_ptr.dtype.element_ty), mask=mask_p)
    if end == snap_row:
        tl.store(snap_pool, state.to(state_ptr.dtype.element_ty), mask=mask)
    final = tl.load(final_ptr + s).to(tl.int64)
    tl.store(state_ptr + tl.maximum(final, 0) * s_st_s + within, state.to(state_ptr.dtype.element_ty),
             mask=mask & (offs_p[:, None] < tl.where(final >= 0, P, 0)))


def _check_out_rows(x, out, out_rows) -> None:
    T, H, P = x.shape
    if out_rows is not None and (out is None or out.shape[1:] != (H, P) or out_rows.shape[0] < T):
        raise ValueError(f"ssd_short_scan: out_rows needs out [rows, {H}, {P}] and {T} entries; got out "
                         f"{None if out is None else tuple(out.shape)} and {out_rows.shape[0]}")


def ssd_short_scan_ref(x, dt, A, B, C, D, ssm_state, meta, *, z=None, dt_bias=None, dt_softplus=True,
                       dt_limit=(0.0, float("inf")), out=None, workspace=None, passed=None, out_rows=None):
    """The per-token oracle (``ssd.ssd_scan_ref``); ``workspace`` and ``passed`` have no use here."""
    _check_out_rows(x, out, out_rows)
    if out_rows is None:
        return ssd_scan_ref(x, dt, A, B, C, D, ssm_state, meta, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                            dt_limit=dt_limit, out=out)
    y = ssd_scan_ref(x, dt, A, B, C, D, ssm_state, meta, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                     dt_limit=dt_limit)
    seq = meta.seq_idx.long()
    rows = out_rows[: x.shape[0]].long()
    written = (rows >= 0) & (seq >= 0) & (meta.slot_idx.long()[seq.clamp(min=0)] >= 0)
    out[rows[written]] = y[written]
    return out


@with_reference(ssd_short_scan_ref)
def ssd_short_scan(x, dt, A, B, C, D, ssm_state, meta: PrefillMetadata, *, z=None, dt_bias=None,
                   dt_softplus=True, dt_limit=(0.0, float("inf")), out=None, workspace=None,
                   passed: torch.cuda.Event | None = None, out_rows: torch.Tensor | None = None):
    """``ssd.ssd_scan``'s contract (arguments, snapshot and final slots, zeroed skipped rows),
    token by token: for steps of at most ``SHORT_TOKENS`` tokens. ``workspace`` is unused;
    ``passed`` is recorded at the end (every state is passed on by then).

    ``out_rows`` ([T] int32): a live sequence's row t goes to out's row ``out_rows[t]`` (nowhere
    where that is < 0; out [R, H, P], given) and no row is zeroed: a verify step's own rows
    written straight back to the packed rows (``replay.replay_conv`` zeroes the rest)."""
    T, H, P = x.shape
    _check(x, dt, A, B, C, D, z, dt_bias, ssm_state, meta, out if out_rows is None else None, None)
    _check_out_rows(x, out, out_rows)
    _, G, N = B.shape
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_p = min(triton.next_power_of_2(P), 16)
    zs = z.stride() if z is not None else (0, 0, 0)
    _short_scan_kernel[(meta.max_seqs, H, triton.cdiv(P, block_p))](
        x, dt, A, B, C, D if D is not None else A, z if z is not None else x, dt_bias if dt_bias is not None else A,
        out, ssm_state, meta.cu_seqlens, meta.slot_idx, meta.has_initial_state, meta.final_slot, meta.snapshot_slot,
        meta.snapshot_row, out_rows if out_rows is not None else meta.slot_idx, P, N, H // G, float(dt_limit[0]),
        float(dt_limit[1]),
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *zs, *out.stride(), *ssm_state.stride(),
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N), HAS_D=D is not None, HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), OUT_ROWS=out_rows is not None, num_warps=4,
    )
    if out_rows is None:
        block_t = 32
        _zero_skipped_rows_kernel[(triton.cdiv(T, block_t), H)](
            out, meta.seq_idx, meta.slot_idx, T, P, *out.stride(),
            BLOCK_T=block_t, BLOCK_P=min(triton.next_power_of_2(P), 128),
        )
    if passed is not None:
        passed.record()
    return out
