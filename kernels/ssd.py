"""Chunked SSD scan (Mamba2 prefill) over packed variable-length sequences.

Five kernels run over the *logical* chunks of ``PrefillMetadata`` (aligned to each sequence's
start, never spanning two sequences), plus one that zeroes the output rows nobody owns:

1. ``_chunk_cumsum_kernel``   per chunk, head block: dt' and the within-chunk cumsum of dt' A
2. ``_state_chain_kernel``    per sequence, head, state tile: walks the sequence's chunks from its
                              initial state; each chunk's own final state
                              sum_l exp(cs_end - cs_l) dt'_l x_l B_l^T (in registers) passes the
                              state on; leaves each chunk's start state in the workspace (in the
                              activations' dtype, as the scan's products take it) and writes the
                              final state to the sequence's final slot (its own, or none), and a
                              snapshot's (a chunk's start state or the final one) to the slot the
                              metadata names for it
3. ``_chunk_cb_kernel``       per chunk, group, causal (row, column) tile: C B^T, which every head
                              of the group shares, into the workspace in fp32
4. ``_chunk_scan_kernel``     per chunk, row block, head, head-dim block:
                              y = exp(cs) C h_start + (C B^T * decay * causal) (dt' x) + D x,
                              gated by silu(z), with C B^T read from the workspace
5. ``_zero_skipped_rows_kernel`` zeroes rows of padding tokens and of skipped sequences

Launch shapes come from static sizes only (max_tokens, max_chunks, max_seqs, H, P, N) and block
sizes from a fixed function of (chunk_size, P, N, dtype): no host sync, no autotuning (the scan
mutates the state pool, so a tuning rerun would apply it twice), nothing allocated when ``out``
and ``workspace`` are given, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import with_reference
from .varlen import PrefillMetadata

__all__ = ["SSDWorkspace", "ssd_scan", "ssd_scan_ref", "ssd_scan_chunked_torch"]


@dataclass
class SSDWorkspace:
    """Scratch buffers of one scan, sized from static dims; reusable by every layer of a stream.

    dt:        [max_chunks, H, chunk_size]  fp32  dt' per chunk position, 0 past the chunk's end
    dA_cumsum: [max_chunks, H, chunk_size]  fp32  within-chunk inclusive cumsum of dt' A
    starts:    [max_chunks, H, P, N]        dtype the state each chunk starts from, rounded to the
                                                  activations' dtype (the scan's product with C
                                                  takes it so: half the bytes of fp32 at bf16)
    cb:        [max_chunks, G, chunk, chunk] fp32 C B^T of each chunk and group, on and below the
                                                  diagonal's tiles (what the causal scan reads)
    """

    dt: torch.Tensor
    dA_cumsum: torch.Tensor
    starts: torch.Tensor
    cb: torch.Tensor

    @classmethod
    def allocate(cls, max_chunks: int, H: int, P: int, N: int, chunk_size: int, device,
                 dtype: torch.dtype, *, groups: int) -> "SSDWorkspace":
        """Workspace for up to ``max_chunks`` chunks (see ``varlen.max_chunks_for``) of a scan over
        ``dtype`` activations whose B and C have ``groups`` groups."""
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            dt=torch.empty(max_chunks, H, chunk_size, **f32),
            dA_cumsum=torch.empty(max_chunks, H, chunk_size, **f32),
            starts=torch.empty(max_chunks, H, P, N, dtype=dtype, device=device),
            cb=torch.empty(max_chunks, groups, chunk_size, chunk_size, **f32),
        )


@triton.jit
def _softplus(x):
    # log1p(exp(x)) without a log1p: log(u) * e / (u - 1) with u = 1 + e is accurate to rounding
    # even where 1 + e loses e's low bits (typical dt' is 1e-3..1e-1, i.e. x near -7..-2)
    e = tl.exp(x)
    u = 1.0 + e
    lp = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    # torch's threshold: above 20 softplus(x) == x in fp32
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Triton's interpreter multiplies the raw bits of bf16 operands; there (CPU tensors) the
    # launcher asks for an fp32 dot of the already-rounded operands, which is exact.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _live_chunk(c, chunk_seq_ptr, slot_idx_ptr):
    """Sequence of chunk c, or -1 when the chunk is unused or its sequence is skipped."""
    seq = tl.load(chunk_seq_ptr + c)
    slot = tl.load(slot_idx_ptr + tl.maximum(seq, 0))
    return tl.where((seq >= 0) & (slot >= 0), seq, -1)


@triton.jit
def _chunk_span(c, chunk_start_ptr, chunk_end_ptr):
    """Chunk c's first token (int64, for row offsets) and its length."""
    start = tl.load(chunk_start_ptr + c)
    return start.to(tl.int64), tl.load(chunk_end_ptr + c) - start


@triton.jit
def _chunk_cumsum_kernel(
    dt_ptr, A_ptr, dt_bias_ptr, dt_out_ptr, cs_out_ptr,
    chunk_seq_ptr, chunk_start_ptr, chunk_end_ptr, slot_idx_ptr,
    H, dt_min, dt_max,
    s_dt_t, s_dt_h,
    CHUNK_SIZE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
):
    c = tl.program_id(0)
    pid_h = tl.program_id(1)
    if _live_chunk(c, chunk_seq_ptr, slot_idx_ptr) < 0:
        return
    t0, length = _chunk_span(c, chunk_start_ptr, chunk_end_ptr)

    offs_l = tl.arange(0, BLOCK_L)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    live = (offs_l[:, None] < length) & mask_h[None, :]
    # [BLOCK_L, BLOCK_H]
    dt = tl.load(dt_ptr + (t0 + offs_l[:, None]) * s_dt_t + offs_h[None, :] * s_dt_h,
                 mask=live, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)[None, :]
    if DT_SOFTPLUS:
        dt = _softplus(dt)
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    # positions past the chunk's end neither decay nor contribute, so later kernels may read the
    # whole row and cs[CHUNK_SIZE - 1] is the decay of the whole chunk
    dt = tl.where(live, dt, 0.0)
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    cs = tl.cumsum(dt * A[None, :], axis=0)

    # workspace rows: [max_chunks, H, CHUNK_SIZE]
    ws = (c.to(tl.int64) * H + offs_h[None, :]) * CHUNK_SIZE + offs_l[:, None]
    in_chunk = (offs_l[:, None] < CHUNK_SIZE) & mask_h[None, :]
    tl.store(dt_out_ptr + ws, dt, mask=in_chunk)
    tl.store(cs_out_ptr + ws, cs, mask=in_chunk)


@triton.jit
def _state_chain_kernel(
    x_ptr, B_ptr, dt_ptr, cs_ptr, starts_ptr, ssm_state_ptr,
    chunk_start_ptr, chunk_end_ptr, slot_idx_ptr, has_initial_state_ptr, seq_chunk_start_ptr,
    final_slot_ptr, snapshot_slot_ptr, snapshot_row_ptr,
    H, P, N, heads_per_group,
    s_x_t, s_x_h, s_x_p, s_B_t, s_B_g, s_B_n, s_st_s, s_st_h, s_st_p, s_st_n,
    CHUNK_SIZE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Per sequence, head, state tile: each chunk's start state, then its own final state from
    zero (x^T against B weighted by dt' and the decay to the chunk's end), which passes the state
    on; the last goes to the sequence's final slot (where >= 0), and a sequence with a snapshot
    slot also leaves there the state its chunk at the snapshot row starts from (or its final
    one). The slot is read first, so either may be it. A chunk's loads do not depend on the state, so they are
    pipelined across the loop; only
    the multiply-add passing the state on is serial, and the chunks' own states never leave
    registers. Against the two kernels before it (a chunk's own state a program, then a pass over
    them through an fp32 workspace), a 2048-token prefill: Nemotron-H-8B 1.7% faster,
    Nemotron-3-Nano 0.3-0.6%, Mamba2-130M 5.6-5.8% slower (24 heads, 256-token chunks: each program
    walks 8 long chunks where the old grid took one a program; no tile won it back), in
    docs/experiments.md."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    pid_pn = tl.program_id(2)
    slot = tl.load(slot_idx_ptr + s).to(tl.int64)
    # int64 so the loop variable below indexes the workspace without overflow
    c0 = tl.load(seq_chunk_start_ptr + s).to(tl.int64)
    c1 = tl.load(seq_chunk_start_ptr + s + 1).to(tl.int64)
    if (slot < 0) | (c1 <= c0):
        return
    g = h // heads_per_group
    n_blocks_n = tl.cdiv(N, BLOCK_N)
    offs_p = (pid_pn // n_blocks_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = (pid_pn % n_blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask = mask_p[:, None] & mask_n[None, :]
    within = h * s_st_h + offs_p[:, None] * s_st_p + offs_n[None, :] * s_st_n
    pool = ssm_state_ptr + slot * s_st_s + within
    final = tl.load(final_slot_ptr + s).to(tl.int64)
    snap = tl.load(snapshot_slot_ptr + s).to(tl.int64)
    snap_row = tl.where(snap >= 0, tl.load(snapshot_row_ptr + s), -1)
    snap_pool = ssm_state_ptr + tl.maximum(snap, 0) * s_st_s + within
    # read the slot before this same program overwrites it (a snapshot or the final state)
    state = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    if tl.load(has_initial_state_ptr + s) != 0:
        state = tl.load(pool, mask=mask, other=0.0).to(tl.float32)
    tile = offs_p[:, None] * N + offs_n[None, :]
    L_TILES: tl.constexpr = (CHUNK_SIZE + BLOCK_L - 1) // BLOCK_L
    for c in range(c0, c1):
        t0, length = _chunk_span(c, chunk_start_ptr, chunk_end_ptr)
        ws_row = (c * H + h) * CHUNK_SIZE
        # the decay of the whole chunk (cs is 0-padded past its end: see the cumsum kernel)
        cs_end = tl.load(cs_ptr + ws_row + CHUNK_SIZE - 1)
        local = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(L_TILES):
            offs_l = j * BLOCK_L + tl.arange(0, BLOCK_L)
            mask_l = offs_l < length
            tok = t0 + offs_l
            # [BLOCK_P, BLOCK_L]: x transposed so the chunk's tokens are the contraction dim
            xT = tl.load(x_ptr + tok[None, :] * s_x_t + h * s_x_h + offs_p[:, None] * s_x_p,
                         mask=mask_l[None, :] & mask_p[:, None], other=0.0)
            b = tl.load(B_ptr + tok[:, None] * s_B_t + g * s_B_g + offs_n[None, :] * s_B_n,
                        mask=mask_l[:, None] & mask_n[None, :], other=0.0)
            cs = tl.load(cs_ptr + ws_row + offs_l, mask=mask_l, other=0.0)
            dt = tl.load(dt_ptr + ws_row + offs_l, mask=mask_l, other=0.0)
            # cs is non-increasing within the chunk, so the decay to its end is <= 1
            w = tl.exp(cs_end - cs) * dt
            b = (b.to(tl.float32) * w[:, None]).to(xT.dtype)
            local += _dot(xT, b, PRECISION, UPCAST)
        tl.store(starts_ptr + (c * H + h) * P * N + tile, state.to(starts_ptr.dtype.element_ty), mask=mask)
        if t0 == snap_row:
            tl.store(snap_pool, state.to(ssm_state_ptr.dtype.element_ty), mask=mask)
        state = tl.exp(cs_end) * state + local
    if tl.load(chunk_end_ptr + c1 - 1) == snap_row:
        tl.store(snap_pool, state.to(ssm_state_ptr.dtype.element_ty), mask=mask)
    tl.store(ssm_state_ptr + tl.maximum(final, 0) * s_st_s + within, state.to(ssm_state_ptr.dtype.element_ty),
             mask=mask & (offs_p[:, None] < tl.where(final >= 0, P, 0)))


@triton.jit
def _row_block(pid, chunk_seq_ptr, chunk_start_ptr, chunk_end_ptr, slot_idx_ptr, CHUNK_SIZE: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """A (chunk, row block) program's chunk c, first row m0, first token t0 and the chunk's
    length; live is 0 when the chunk is skipped or the block lies past its end."""
    n_blocks_m: tl.constexpr = (CHUNK_SIZE + BLOCK_M - 1) // BLOCK_M
    c = pid // n_blocks_m
    m0 = (pid % n_blocks_m) * BLOCK_M
    t0, length = _chunk_span(c, chunk_start_ptr, chunk_end_ptr)
    live = ((_live_chunk(c, chunk_seq_ptr, slot_idx_ptr) >= 0) & (m0 < length)).to(tl.int32)
    return c, m0, t0, length, live


@triton.jit
def _chunk_cb_kernel(
    B_ptr, C_ptr, cb_ptr,
    chunk_seq_ptr, chunk_start_ptr, chunk_end_ptr, slot_idx_ptr,
    G, N,
    s_B_t, s_B_g, s_B_n, s_C_t, s_C_g, s_C_n,
    CHUNK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    g = tl.program_id(1)
    k0 = tl.program_id(2) * BLOCK_K
    c, m0, t0, length, live = _row_block(tl.program_id(0), chunk_seq_ptr, chunk_start_ptr, chunk_end_ptr,
                                         slot_idx_ptr, CHUNK_SIZE, BLOCK_M)
    # the scan reads only the tiles on and below the diagonal
    if (k0 >= m0 + BLOCK_M) | (live == 0):
        return
    dtype = C_ptr.dtype.element_ty

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < length
    mask_k = offs_k < length
    mask_n = offs_n < N
    # [BLOCK_M, BLOCK_N] and [BLOCK_N, BLOCK_K]: the state dim in one block, one dot
    cmat = tl.load(C_ptr + (t0 + offs_m)[:, None] * s_C_t + g * s_C_g + offs_n[None, :] * s_C_n,
                   mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(dtype)
    bT = tl.load(B_ptr + (t0 + offs_k)[None, :] * s_B_t + g * s_B_g + offs_n[:, None] * s_B_n,
                 mask=mask_k[None, :] & mask_n[:, None], other=0.0).to(dtype)
    cb = _dot(cmat, bT, PRECISION, UPCAST)
    # cb: [max_chunks, G, CHUNK_SIZE, CHUNK_SIZE]; only rows and columns inside the chunk
    ptrs = cb_ptr + ((c.to(tl.int64) * G + g) * CHUNK_SIZE + offs_m[:, None]) * CHUNK_SIZE + offs_k[None, :]
    tl.store(ptrs, cb, mask=mask_m[:, None] & mask_k[None, :])


@triton.jit
def _chunk_scan_kernel(
    x_ptr, z_ptr, C_ptr, D_ptr, out_ptr, dt_ptr, cs_ptr, starts_ptr, cb_ptr,
    chunk_seq_ptr, chunk_start_ptr, chunk_end_ptr, slot_idx_ptr,
    H, P, N, G, heads_per_group,
    s_x_t, s_x_h, s_x_p, s_z_t, s_z_h, s_z_p, s_C_t, s_C_g, s_C_n,
    s_o_t, s_o_h, s_o_p,
    CHUNK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr, TAIL_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # head columns pid_p * BLOCK_P + [0, BLOCK_P); with TAIL_P (one program a row block and head),
    # also the TAIL_P columns after them, weighted by the same scores
    h = tl.program_id(1)
    pid_p = tl.program_id(2)
    c, m0, t0, length, live = _row_block(tl.program_id(0), chunk_seq_ptr, chunk_start_ptr, chunk_end_ptr,
                                         slot_idx_ptr, CHUNK_SIZE, BLOCK_M)
    if live == 0:
        return
    g = h // heads_per_group
    dtype = x_ptr.dtype.element_ty

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < length
    mask_p = offs_p < P
    mask_n = offs_n < N
    ws_row = (c.to(tl.int64) * H + h) * CHUNK_SIZE
    cs_m = tl.load(cs_ptr + ws_row + offs_m, mask=mask_m, other=0.0)

    # inter-chunk part: C [BLOCK_M, BLOCK_N] against the start state decayed to each row,
    # [BLOCK_N, BLOCK_P]; C is not needed past this product (C B^T comes from the workspace)
    cmat = tl.load(C_ptr + (t0 + offs_m)[:, None] * s_C_t + g * s_C_g + offs_n[None, :] * s_C_n,
                   mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(dtype)
    starts = starts_ptr + (c.to(tl.int64) * H + h) * P * N + offs_n[:, None]
    state = tl.load(starts + offs_p[None, :] * N, mask=mask_n[:, None] & mask_p[None, :], other=0.0)
    acc = _dot(cmat, state.to(dtype), PRECISION, UPCAST) * tl.exp(cs_m)[:, None]
    if TAIL_P > 0:
        offs_q = BLOCK_P + tl.arange(0, TAIL_P)
        mask_q = offs_q < P
        state_q = tl.load(starts + offs_q[None, :] * N, mask=mask_n[:, None] & mask_q[None, :], other=0.0)
        acc_q = _dot(cmat, state_q.to(dtype), PRECISION, UPCAST) * tl.exp(cs_m)[:, None]

    # intra-chunk part: the group's causal C B^T weighted by the head's decay between positions,
    # against dt' x
    cb_rows = cb_ptr + ((c.to(tl.int64) * G + g) * CHUNK_SIZE + offs_m[:, None]) * CHUNK_SIZE
    k_end = tl.minimum(m0 + BLOCK_M, length)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < length
        tok_k = t0 + offs_k
        # [BLOCK_M, BLOCK_K], written by _chunk_cb_kernel wherever both positions are in the chunk
        scores = tl.load(cb_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        cs_k = tl.load(cs_ptr + ws_row + offs_k, mask=mask_k, other=0.0)
        dt_k = tl.load(dt_ptr + ws_row + offs_k, mask=mask_k, other=0.0)
        causal = (offs_m[:, None] >= offs_k[None, :]) & mask_k[None, :]
        # select before exp: above the diagonal cs_m - cs_k > 0 could overflow
        decay = tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf")))
        scores = scores * decay * dt_k[None, :]
        # [BLOCK_K, BLOCK_P]
        x_rows = x_ptr + tok_k[:, None] * s_x_t + h * s_x_h
        xk = tl.load(x_rows + offs_p[None, :] * s_x_p, mask=mask_k[:, None] & mask_p[None, :], other=0.0)
        scores = scores.to(dtype)
        acc += _dot(scores, xk, PRECISION, UPCAST)
        if TAIL_P > 0:
            xq = tl.load(x_rows + offs_q[None, :] * s_x_p, mask=mask_k[:, None] & mask_q[None, :], other=0.0)
            acc_q += _dot(scores, xq, PRECISION, UPCAST)

    tok_m = t0 + offs_m
    _scan_store(acc, x_ptr, z_ptr, D_ptr, out_ptr, h, tok_m, mask_m, offs_p, mask_p,
                s_x_t, s_x_h, s_x_p, s_z_t, s_z_h, s_z_p, s_o_t, s_o_h, s_o_p, HAS_D, HAS_Z)
    if TAIL_P > 0:
        _scan_store(acc_q, x_ptr, z_ptr, D_ptr, out_ptr, h, tok_m, mask_m, offs_q, mask_q,
                    s_x_t, s_x_h, s_x_p, s_z_t, s_z_h, s_z_p, s_o_t, s_o_h, s_o_p, HAS_D, HAS_Z)


@triton.jit
def _scan_store(acc, x_ptr, z_ptr, D_ptr, out_ptr, h, tok_m, mask_m, offs_p, mask_p,
                s_x_t, s_x_h, s_x_p, s_z_t, s_z_h, s_z_p, s_o_t, s_o_h, s_o_p,
                HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    """A scan program's columns out: + D x, * silu(z), stored."""
    mask_mp = mask_m[:, None] & mask_p[None, :]
    if HAS_D:
        xm = tl.load(x_ptr + tok_m[:, None] * s_x_t + h * s_x_h + offs_p[None, :] * s_x_p,
                     mask=mask_mp, other=0.0).to(tl.float32)
        acc += tl.load(D_ptr + h).to(tl.float32) * xm
    if HAS_Z:
        zm = tl.load(z_ptr + tok_m[:, None] * s_z_t + h * s_z_h + offs_p[None, :] * s_z_p,
                     mask=mask_mp, other=0.0).to(tl.float32)
        acc *= zm * tl.sigmoid(zm)
    tl.store(out_ptr + tok_m[:, None] * s_o_t + h * s_o_h + offs_p[None, :] * s_o_p,
             acc.to(out_ptr.dtype.element_ty), mask=mask_mp)


@triton.jit
def _zero_skipped_rows_kernel(
    out_ptr, seq_idx_ptr, slot_idx_ptr,
    T, P, s_o_t, s_o_h, s_o_p,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    seq = tl.load(seq_idx_ptr + offs_t, mask=mask_t, other=0)
    slot = tl.load(slot_idx_ptr + seq, mask=mask_t & (seq >= 0), other=-1)
    dead = mask_t & (slot < 0)
    rows = out_ptr + offs_t.to(tl.int64)[:, None] * s_o_t + h * s_o_h
    zeros = tl.zeros((BLOCK_T, BLOCK_P), dtype=out_ptr.dtype.element_ty)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        tl.store(rows + offs_p[None, :] * s_o_p, zeros, mask=dead[:, None] & (offs_p[None, :] < P))


# A head dim that 64 does not divide (Nemotron-Nano-9B-v2's 80) goes into a state chain program
# whole, in one power-of-two block of up to this many, rather than in 64-wide blocks the last of
# which is mostly padding (80: 64 + 16 of 64, each block loading and weighting the chunks' B
# again): the 9B-v2's chain 114 -> 93 us a layer. The chunk scan does not take it whole (143 ->
# 173 us) but as 64 columns and a narrow tail (``_scan_tail``). 0: 64-wide blocks.
CHAIN_ODD_P_MAX = 128


def _scan_tail(P: int, block_p: int) -> int:
    """The chunk scan's columns past its one BLOCK_P block that one program takes beside them
    (a head dim between 64 and 128 that 64 does not divide: the 9B-v2's 80 as 64 + a 16-column
    tail), so a row block's scores are weighted once rather than again in a block of its own that
    is mostly padding (the 9B-v2's FP8 prefill of 2048 tokens -1.4%, H100; docs/experiments.md).
    0: BLOCK_P-wide blocks only."""
    whole, rest = divmod(P, block_p)
    return max(16, triton.next_power_of_2(rest)) if whole == 1 and rest else 0


@dataclass(frozen=True)
class _Blocks:
    """Tile sizes per kernel: cumsum heads; the state chain's chunk rows a dot x P x N and its
    stages; scan rows x P x N and its K loop's columns (C B^T is computed in scan_m x scan_m
    tiles); the warps of C B^T and the scan (``warps``) and of the chain."""

    cumsum_h: int
    chain_l: int
    chain_p: int
    chain_n: int
    chain_stages: int
    scan_m: int
    scan_k: int
    scan_p: int
    scan_n: int
    scan_stages: int
    warps: int
    chain_warps: int


def _blocks(chunk_size: int, P: int, N: int, dtype: torch.dtype) -> _Blocks:
    """Block sizes from static dims; tl.dot wants every dim >= 16 on the GPU.

    bf16/fp16: 64-row tiles over 4 warps, so the scan's dots map onto Hopper's wgmma.
    fp32 runs exact (ieee) FMA dots, which hold whole operand tiles in registers: 16-row tiles,
    narrower state tiles and 8 warps keep ptxas from spilling (checked for sm_90, N <= 256).
    """
    p2 = triton.next_power_of_2
    fp32 = dtype == torch.float32
    rows = max(16, min(16 if fp32 else 64, p2(chunk_size)))
    if fp32:
        chain_p = 16
    elif P % 64 and p2(P) <= CHAIN_ODD_P_MAX:
        chain_p = p2(P)
    else:
        chain_p = max(16, min(64, p2(P)))
    return _Blocks(
        cumsum_h=16,
        # a whole 128-token chunk a dot; 64 x 32 state tiles give Nano's and the 8B's heads 256
        # and 512 programs (Nano: 32 x 64, 64 x 16 and 2 stages tie, 32 x 32 and 32 x 16 lose
        # 1-2%; 130M: 64 x 16 ties, wider or narrower tiles and 64-token dots lose 2-20%)
        chain_l=max(16, min(32 if fp32 else 128, p2(chunk_size))),
        chain_p=chain_p,
        chain_n=max(16, min(32, p2(N))),
        chain_stages=2 if fp32 else 3,
        scan_m=rows,
        # 32-column K tiles keep a bf16 scan program at 128 registers (4 an SM; 64: 168, 3 an
        # SM): Nano's 2048-token scan 110 -> 106 us a layer
        scan_k=min(rows, 32),
        scan_p=max(16, min(64, p2(P))),
        # C's whole state dim in one block: one dot per C B^T tile, and one for the start state
        scan_n=max(16, p2(N)),
        # a scan program's K loop is its rows' causal part, a few tiles: pipelining
        # it only held shared memory (3 stages: 37.4 ms for Nano's 2048-token prefill; 1: 36.8)
        scan_stages=2 if fp32 else 1,
        warps=8 if fp32 else 4,
        # a head block wider than 64 in 4 warps holds 239 registers (sm_90)
        chain_warps=8 if chain_p > 64 else 4,
    )


def _check(x, dt, A, B, C, D, z, dt_bias, ssm_state, meta, out, workspace):
    T, H, P = x.shape
    _, G, N = B.shape
    if H % G:
        raise ValueError(f"{H} heads do not split into {G} groups")
    if meta.max_tokens != T:
        raise ValueError(f"x has {T} rows but the metadata max_tokens is {meta.max_tokens}")
    shapes = {"dt": (dt, (T, H)), "A": (A, (H,)), "B": (B, (T, G, N)), "C": (C, (T, G, N)),
              "D": (D, (H,)), "z": (z, (T, H, P)), "dt_bias": (dt_bias, (H,)), "out": (out, (T, H, P))}
    for name, (t, shape) in shapes.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if ssm_state.dim() != 4 or tuple(ssm_state.shape[1:]) != (H, P, N):
        raise ValueError(f"ssm_state has shape {tuple(ssm_state.shape)}, expected [S, {H}, {P}, {N}]")
    if workspace is not None:
        want, states = (meta.max_chunks, H, meta.chunk_size), (meta.max_chunks, H, P, N)
        cb = (meta.max_chunks, G, meta.chunk_size, meta.chunk_size)
        if tuple(workspace.dt.shape) != want or tuple(workspace.cb.shape) != cb:
            raise ValueError("workspace was sized for other static dims")
        if tuple(workspace.starts.shape) != states or workspace.starts.dtype != x.dtype:
            raise ValueError(f"workspace.starts must be {list(states)} in x's dtype {x.dtype}, "
                             f"got {list(workspace.starts.shape)} {workspace.starts.dtype}")

# The torch references: a per-token loop (the oracle) and the SSD block decomposition per
# sequence. Both read the metadata on the host (they sync), loop over sequences in Python, and
# share the kernels' semantics (see ``ssd_scan`` for the argument list).


def process_dt(dt, dt_bias, dt_softplus, dt_limit):
    """dt' = clamp(softplus(dt + dt_bias), *dt_limit) in fp32; dt: [L, H]."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _live_sequences(meta: PrefillMetadata):
    """(tokens start, end, slot, has_initial_state, snapshot, final slot) of every sequence the
    kernels would scan; snapshot: None, or (its slot, the tokens of the sequence before it)."""
    cu = torch.as_tensor(meta.cu_seqlens).tolist()
    slots = torch.as_tensor(meta.slot_idx).tolist()
    finals = torch.as_tensor(meta.final_slot).tolist()
    init = torch.as_tensor(meta.has_initial_state).tolist()
    snap_slots = torch.as_tensor(meta.snapshot_slot).tolist()
    snap_rows = torch.as_tensor(meta.snapshot_row).tolist()
    for s, slot in enumerate(slots):
        if slot >= 0 and cu[s + 1] > cu[s]:
            snapshot = (snap_slots[s], snap_rows[s] - cu[s]) if snap_slots[s] >= 0 else None
            yield cu[s], cu[s + 1], slot, bool(init[s]), snapshot, finals[s]


def _prepare_out(x, out):
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # rows of padding tokens and skipped sequences stay zero
    out.zero_()
    return out


def _per_head(t, H):
    """[L, G, N] -> [L, H, N] (head h reads group h // (H // G)), in fp32."""
    return t.float().repeat_interleave(H // t.shape[1], dim=1)


def ssd_scan_ref(x, dt, A, B, C, D, ssm_state, meta, *, z=None, dt_bias=None, dt_softplus=True,
                 dt_limit=(0.0, float("inf")), out=None, workspace=None):
    """The recurrence one token at a time, in fp32: obviously correct and slow."""
    H = x.shape[1]
    out = _prepare_out(x, out)
    for t0, t1, slot, has_init, snapshot, final in _live_sequences(meta):
        dts = process_dt(dt[t0:t1], dt_bias, dt_softplus, dt_limit)  # [L, H]
        xs, Bs, Cs = x[t0:t1].float(), _per_head(B[t0:t1], H), _per_head(C[t0:t1], H)
        h = ssm_state[slot].float().clone() if has_init else ssm_state.new_zeros(ssm_state.shape[1:],
                                                                                  dtype=torch.float32)
        for i in range(t1 - t0):
            if snapshot is not None and i == snapshot[1]:
                ssm_state[snapshot[0]] = h.to(ssm_state.dtype)
            decay = torch.exp(dts[i] * A.float())  # [H]
            # h: [H, P, N]
            h = decay[:, None, None] * h + (dts[i, :, None] * xs[i])[:, :, None] * Bs[i][:, None, :]
            y = torch.einsum("hpn,hn->hp", h, Cs[i])
            if D is not None:
                y = y + D.float()[:, None] * xs[i]
            if z is not None:
                y = y * F.silu(z[t0 + i].float())
            out[t0 + i] = y.to(out.dtype)
        if snapshot is not None and snapshot[1] == t1 - t0:
            ssm_state[snapshot[0]] = h.to(ssm_state.dtype)
        if final >= 0:
            ssm_state[final] = h.to(ssm_state.dtype)
    return out


def _scan_sequence(x, dt, A, B, C, h0, chunk_size):
    """SSD blocks of one sequence; x: [L, H, P], dt: [L, H], B, C: [L, H, N], h0: [H, P, N].

    Returns y: [L, H, P] (without the D term) and the final state [H, P, N], both fp32.
    """
    L, H, P = x.shape
    nc = -(-L // chunk_size)
    pad = nc * chunk_size - L

    def chunks(t):
        # zero padding: dt = 0 makes padded positions neither decay nor contribute
        return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).reshape(nc, chunk_size, *t.shape[1:])

    xdt = chunks(x * dt[..., None])  # [nc, l, H, P]
    Bc, Cc = chunks(B), chunks(C)  # [nc, l, H, N]
    cs = torch.cumsum(chunks(dt * A), dim=1).transpose(1, 2)  # [nc, H, l]

    # within-chunk decay exp(cs_l - cs_s) for s <= l, else 0
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    seg = (cs[..., :, None] - cs[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [nc, H, l, s]
    scores = torch.einsum("clhn,cshn->chls", Cc, Bc) * seg
    y = torch.einsum("chls,cshp->clhp", scores, xdt)

    # each chunk's own contribution to the state at its end
    to_end = torch.exp(cs[..., -1:] - cs)  # [nc, H, l]
    local = torch.einsum("chl,clhn,clhp->chpn", to_end, Bc, xdt)  # [nc, H, P, N]

    # carry the state across chunks, keeping the state each chunk starts from
    chunk_decay = torch.exp(cs[..., -1])  # [nc, H]
    starts = []
    h = h0
    for c in range(nc):
        starts.append(h)
        h = chunk_decay[c][:, None, None] * h + local[c]
    starts = torch.stack(starts)  # [nc, H, P, N]

    y = y + torch.einsum("clhn,chpn->clhp", Cc, starts) * cs.exp().transpose(1, 2)[..., None]
    return y.reshape(nc * chunk_size, H, P)[:L], h


def ssd_scan_chunked_torch(x, dt, A, B, C, D, ssm_state, meta, *, z=None, dt_bias=None,
                           dt_softplus=True, dt_limit=(0.0, float("inf")), out=None, workspace=None, passed=None):
    """The SSD block decomposition per sequence in fp32 torch ops (chunks of ``meta.chunk_size``
    from its start, and from its snapshot's row: ``varlen``'s chunk grid): the CPU path and the
    benchmark baseline. ``workspace`` and ``passed`` have no use here."""
    H = x.shape[1]
    out = _prepare_out(x, out)
    for t0, t1, slot, has_init, snapshot, final in _live_sequences(meta):
        xs = x[t0:t1].float()
        h = ssm_state[slot].float().clone() if has_init else ssm_state.new_zeros(ssm_state.shape[1:],
                                                                                  dtype=torch.float32)
        dts = process_dt(dt[t0:t1], dt_bias, dt_softplus, dt_limit)
        Bs, Cs = _per_head(B[t0:t1], H), _per_head(C[t0:t1], H)
        cuts = [0, snapshot[1], t1 - t0] if snapshot is not None and snapshot[1] < t1 - t0 else [0, t1 - t0]
        ys, at_snapshot = [], None
        for a, b in zip(cuts, cuts[1:]):
            y, h = _scan_sequence(xs[a:b], dts[a:b], A.float(), Bs[a:b], Cs[a:b], h, meta.chunk_size)
            ys.append(y)
            if snapshot is not None and b == snapshot[1]:
                at_snapshot = h
        y = torch.cat(ys)
        if at_snapshot is not None:
            ssm_state[snapshot[0]] = at_snapshot.to(ssm_state.dtype)
        if D is not None:
            y = y + D.float()[:, None] * xs
        if z is not None:
            y = y * F.silu(z[t0:t1].float())
        out[t0:t1] = y.to(out.dtype)
        if final >= 0:
            ssm_state[final] = h.to(ssm_state.dtype)
    return out


@with_reference(ssd_scan_chunked_torch)
def ssd_scan(x, dt, A, B, C, D, ssm_state, meta: PrefillMetadata, *, z=None, dt_bias=None,
             dt_softplus=True, dt_limit=(0.0, float("inf")), out=None,
             workspace: SSDWorkspace | None = None, passed: torch.cuda.Event | None = None):
    """Chunked SSD scan of packed prefill sequences; updates their slots of ``ssm_state``.

    x:         [T, H, P]  packed tokens (T = meta.max_tokens), bf16/fp16/fp32; any row stride
    dt:        [T, H]     raw time steps
    A:         [H] fp32   -exp(A_log)
    B, C:      [T, G, N]  input/output projections; head h reads group h // (H // G)
    D:         [H] or None skip connection
    ssm_state: [S, H, P, N] bf16 or fp32 state pool, indexed by ``meta.slot_idx``
    meta:      PrefillMetadata on x's device (chunk_size inside)
    z:         [T, H, P] or None gate: y *= silu(z)
    dt_bias:   [H] or None, added to dt before softplus
    dt_softplus, dt_limit: dt' = clamp(softplus(dt + dt_bias), *dt_limit)
    out:       [T, H, P] in x's dtype, written entirely (skipped rows are zero)
    workspace: SSDWorkspace sized for meta's static dims; with ``out`` given nothing is allocated
    passed:    a CUDA event to record on the current stream once every chunk's start state is
               known, before the chunk scan (another stream may wait for it); CUDA only

    Per sequence: h_t = exp(dt'_t A) h_{t-1} + dt'_t x_t B_t^T, y_t = h_t C_t + D x_t, starting
    from its slot when has_initial_state (else zero) and storing the last state in the slot; with
    ``meta.snapshot_slot`` >= 0, also the state before packed row ``meta.snapshot_row`` (a chunk's
    start or the sequence's end) in that slot.
    Sequences whose slot is PAD_SLOT_ID, unused chunks and padding tokens are skipped.
    CUDA tensors run the Triton kernels; CPU tensors the torch block decomposition.
    """
    _check(x, dt, A, B, C, D, z, dt_bias, ssm_state, meta, out, workspace)
    T, H, P = x.shape
    _, G, N = B.shape
    cs_size, max_chunks, max_seqs = meta.chunk_size, meta.max_chunks, meta.max_seqs
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if workspace is None:
        workspace = SSDWorkspace.allocate(max_chunks, H, P, N, cs_size, x.device, x.dtype, groups=G)
    ws = workspace
    bl = _blocks(cs_size, P, N, x.dtype)
    dot = dict(PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=not x.is_cuda)
    chunk_meta = (meta.chunk_seq, meta.chunk_start, meta.chunk_end, meta.slot_idx)

    _chunk_cumsum_kernel[(max_chunks, triton.cdiv(H, bl.cumsum_h))](
        dt, A, dt_bias if dt_bias is not None else A, ws.dt, ws.dA_cumsum, *chunk_meta,
        H, float(dt_limit[0]), float(dt_limit[1]), dt.stride(0), dt.stride(1),
        CHUNK_SIZE=cs_size, BLOCK_L=triton.next_power_of_2(cs_size), BLOCK_H=bl.cumsum_h,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
    )
    grid = (max_seqs, H, triton.cdiv(P, bl.chain_p) * triton.cdiv(N, bl.chain_n))
    _state_chain_kernel[grid](
        x, B, ws.dt, ws.dA_cumsum, ws.starts, ssm_state, meta.chunk_start, meta.chunk_end, meta.slot_idx,
        meta.has_initial_state, meta.seq_chunk_start, meta.final_slot, meta.snapshot_slot, meta.snapshot_row,
        H, P, N, H // G, *x.stride(), *B.stride(),
        *ssm_state.stride(), CHUNK_SIZE=cs_size, BLOCK_L=bl.chain_l, BLOCK_P=bl.chain_p, BLOCK_N=bl.chain_n,
        **dot, num_warps=bl.chain_warps, num_stages=bl.chain_stages,
    )
    if passed is not None:
        passed.record()
    n_blocks_m = triton.cdiv(cs_size, bl.scan_m)
    _chunk_cb_kernel[(max_chunks * n_blocks_m, G, n_blocks_m)](
        B, C, ws.cb, *chunk_meta, G, N, *B.stride(), *C.stride(),
        CHUNK_SIZE=cs_size, BLOCK_M=bl.scan_m, BLOCK_K=bl.scan_m, BLOCK_N=bl.scan_n, **dot,
        num_warps=bl.warps,
    )
    zs = z.stride() if z is not None else (0, 0, 0)
    tail_p = _scan_tail(P, bl.scan_p)
    grid = (max_chunks * n_blocks_m, H, 1 if tail_p else triton.cdiv(P, bl.scan_p))
    _chunk_scan_kernel[grid](
        x, z if z is not None else x, C, D if D is not None else A, out,
        ws.dt, ws.dA_cumsum, ws.starts, ws.cb, *chunk_meta,
        H, P, N, G, H // G, *x.stride(), *zs, *C.stride(), *out.stride(),
        CHUNK_SIZE=cs_size, BLOCK_M=bl.scan_m, BLOCK_K=bl.scan_k, BLOCK_P=bl.scan_p, TAIL_P=tail_p,
        BLOCK_N=bl.scan_n, HAS_D=D is not None, HAS_Z=z is not None, **dot,
        num_stages=bl.scan_stages, num_warps=bl.warps,
    )
    block_t = 32
    _zero_skipped_rows_kernel[(triton.cdiv(T, block_t), H)](
        out, meta.seq_idx, meta.slot_idx, T, P, *out.stride(),
        BLOCK_T=block_t, BLOCK_P=min(triton.next_power_of_2(P), 128),
    )
    return out
