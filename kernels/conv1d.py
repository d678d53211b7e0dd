"""Depthwise causal conv1d of Mamba2 layers: one-token decode update and packed varlen prefill.

The conv state of a sequence is the window of its last ``K - 1`` inputs, oldest first, kept in a
slot of a state pool ``conv_state: [S, D, K - 1]``. The pool may have any strides (a
``[S, K - 1, D]`` buffer exposed as a transposed view is fine). Rows and sequences whose slot is
``PAD_SLOT_ID`` neither read nor write the pool and get zero output; so do padding tokens.

Triton kernels run on CUDA tensors without host syncs; their grids depend only on static buffer
shapes. CPU tensors go through the fp32 torch references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import with_reference
from .varlen import PrefillMetadata

__all__ = ["conv1d_update", "conv1d_varlen", "conv1d_update_ref", "conv1d_varlen_ref"]

_ACTIVATIONS = ("silu", None)


@triton.jit
def _conv1d_update_kernel(
    x_ptr, state_ptr, w_ptr, b_ptr, slot_ptr, out_ptr,
    D,
    sx_b, sx_d,
    ss_s, ss_d, ss_k,
    sw_d, sw_k,
    sb_d,
    so_b, so_d,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    # grid: (rows, channel blocks); one token of one row, BLOCK_D channels
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    k = tl.arange(0, BLOCK_K)
    d_ok = d < D
    slot = tl.load(slot_ptr + row).to(tl.int64)
    # a pad row owns no channels: it reads and writes no state and stores zeros
    live = d < tl.where(slot >= 0, D, 0)

    # [BLOCK_D, BLOCK_K] tiles of the slot's state (a pad row's addresses stay in slot 0)
    s_tile = state_ptr + tl.maximum(slot, 0) * ss_s + d[:, None] * ss_d + k[None, :] * ss_k
    in_state = live[:, None] & (k[None, :] < K - 1)
    x_raw = tl.load(x_ptr + row * sx_b + d * sx_d, mask=live, other=0.0)

    # window: taps 0..K-2 from the state, tap K-1 the new token
    win = tl.load(s_tile, mask=in_state, other=0.0).to(tl.float32)
    win = tl.where(k[None, :] == K - 1, x_raw.to(tl.float32)[:, None], win)
    # the new state is the window shifted left by one: state[j + 1], then the token
    nxt = tl.load(s_tile + ss_k, mask=in_state & (k[None, :] < K - 2), other=0.0)
    nxt = tl.where(k[None, :] == K - 2, x_raw[:, None], nxt)

    w = tl.load(
        w_ptr + d[:, None] * sw_d + k[None, :] * sw_k,
        mask=d_ok[:, None] & (k[None, :] < K), other=0.0,
    ).to(tl.float32)
    acc = tl.sum(win * w, axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + d * sb_d, mask=d_ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(live, acc, 0.0)
    tl.store(out_ptr + row * so_b + d * so_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)

    # Threads of the CTA own different state columns, so every thread must finish reading the
    # old state before any thread overwrites it.
    tl.debug_barrier()
    tl.store(s_tile, nxt.to(state_ptr.dtype.element_ty), mask=in_state)


@triton.jit
def _conv1d_varlen_out_kernel(
    x_ptr, state_ptr, w_ptr, b_ptr, out_ptr,
    cu_ptr, seq_idx_ptr, slot_ptr, init_ptr,
    T, D,
    sx_t, sx_d,
    ss_s, ss_d, ss_k,
    sw_d, sw_k,
    sb_d,
    so_t, so_d,
    K: tl.constexpr,
    RUN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    # grid: (runs of RUN tokens, channel blocks); reads the old states, never writes them.
    # The run's rows and the K - 1 before it are each loaded once, first (a program is short, and
    # its lifetime is its round trips to memory); token i's tap j is row i + j of them.
    t0 = tl.program_id(0) * RUN
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    rows = ()
    for m in tl.static_range(RUN + K - 1):
        p = t0 - (K - 1) + m
        rows = rows + (tl.load(x_ptr + p.to(tl.int64) * sx_t + d * sx_d, mask=d < tl.where((p >= 0) & (p < T), D, 0),
                               other=0.0),)
    w = ()
    for j in tl.static_range(K):
        w = w + (tl.load(w_ptr + d * sw_d + j * sw_k, mask=d_ok, other=0.0).to(tl.float32),)
    if HAS_BIAS:
        bias = tl.load(b_ptr + d * sb_d, mask=d_ok, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_D,), tl.float32)

    # Most runs lie, with the K - 1 rows before them, inside one live sequence: sequences are
    # contiguous, so the first row's and the last row's sequence tell, and every tap is a row.
    first = tl.load(seq_idx_ptr + tl.maximum(t0 - (K - 1), 0))
    last = tl.load(seq_idx_ptr + tl.minimum(t0 + RUN - 1, T - 1))
    inside = (t0 >= K - 1) & (t0 + RUN <= T) & (first == last) & (last >= 0)
    if inside & (tl.load(slot_ptr + tl.maximum(last, 0)) >= 0):
        for i in tl.static_range(RUN):
            acc = bias
            for j in tl.static_range(K):
                acc += w[j] * rows[i + j].to(tl.float32)
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(out_ptr + (t0 + i).to(tl.int64) * so_t + d * so_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)
    else:
        # a run holding a sequence's start, padding or a sequence without a slot: token by token,
        # a tap before its sequence's start comes from the initial window (state column
        # K-1 - (start - p)) or is zero
        for i in tl.static_range(RUN):
            t = t0 + i
            seq = tl.load(seq_idx_ptr + t, mask=t < T, other=-1)
            start = tl.load(cu_ptr + tl.maximum(seq, 0))
            slot = tl.load(slot_ptr + tl.maximum(seq, 0))
            live = (seq >= 0) & (slot >= 0)
            use_init = live & (tl.load(init_ptr + tl.maximum(seq, 0)) != 0)
            s_row = state_ptr + tl.maximum(slot, 0).to(tl.int64) * ss_s + d * ss_d
            acc = bias
            for j in tl.static_range(K):
                p = t - (K - 1) + j
                col = tl.maximum(K - 1 - (start - p), 0)
                old = tl.load(s_row + col * ss_k, mask=d < tl.where(use_init & (p < start), D, 0), other=0.0)
                acc += w[j] * tl.where(p >= start, rows[i + j].to(tl.float32), old.to(tl.float32))
            if SILU:
                acc = acc * tl.sigmoid(acc)
            acc = tl.where(live, acc, 0.0)
            tl.store(out_ptr + t.to(tl.int64) * so_t + d * so_d, acc.to(out_ptr.dtype.element_ty),
                     mask=d < tl.where(t < T, D, 0))


@triton.jit
def _window(x_ptr, s_row, d, d_ok, start, end, has_init, T, sx_t, sx_d, ss_k,
            K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_D, BLOCK_K] the K-1 inputs before packed row ``end`` of concat(initial window at
    ``s_row``, tokens from ``start``), oldest first: column j holds position p = end - (K-1) + j,
    a token when p >= start, else (fewer than K-1 tokens before it) old column j + (end - start),
    or zero."""
    j = tl.arange(0, BLOCK_K)
    p = end - (K - 1) + j
    col_ok = j < K - 1
    # (p < T only guards against metadata that overruns x)
    from_x = col_ok & (p >= start) & (p < T)
    from_state = tl.where(has_init, col_ok & (p < start), False)
    new = tl.load(
        x_ptr + tl.maximum(p, 0).to(tl.int64)[None, :] * sx_t + d[:, None] * sx_d,
        mask=from_x[None, :] & d_ok[:, None], other=0.0,
    )
    old = tl.load(
        s_row + tl.where(from_state, j + end - start, 0)[None, :] * ss_k,
        mask=from_state[None, :] & d_ok[:, None], other=0.0,
    )
    return tl.where(from_state[None, :], old, new.to(old.dtype))


@triton.jit
def _conv1d_varlen_state_kernel(
    x_ptr, state_ptr,
    cu_ptr, slot_ptr, init_ptr, final_ptr, snap_ptr, snap_row_ptr,
    T, D,
    sx_t, sx_d,
    ss_s, ss_d, ss_k,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (max_seqs, channel blocks); launched after the output kernel, which reads old states.
    # Sequence i's window before its end goes to slot final_ptr[i], and the one before packed row
    # snap_row_ptr[i] to snap_ptr[i] (each where >= 0). Both are read before either is written,
    # so either destination may be the slot the initial window is read from.
    i = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_K)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    final = tl.load(final_ptr + i).to(tl.int64)
    snap = tl.load(snap_ptr + i).to(tl.int64)
    # an unused sequence owns no channels: it reads and writes no state; nor does a window
    # that goes nowhere
    final_ok = d < tl.where((slot >= 0) & (final >= 0), D, 0)
    snap_ok = d < tl.where((slot >= 0) & (snap >= 0), D, 0)
    start = tl.load(cu_ptr + i)
    has_init = tl.load(init_ptr + i) != 0
    s_row = state_ptr + tl.maximum(slot, 0) * ss_s + d[:, None] * ss_d
    last = _window(x_ptr, s_row, d, final_ok, start, tl.load(cu_ptr + i + 1), has_init, T, sx_t, sx_d,
                   ss_k, K, BLOCK_K)
    at = _window(x_ptr, s_row, d, snap_ok, start, tl.load(snap_row_ptr + i), has_init, T, sx_t, sx_d,
                 ss_k, K, BLOCK_K)

    # old columns are read by other threads of the CTA than the ones that overwrite them
    tl.debug_barrier()
    col_ok = (j < K - 1)[None, :]
    tl.store(state_ptr + tl.maximum(final, 0) * ss_s + d[:, None] * ss_d + j[None, :] * ss_k, last,
             mask=col_ok & final_ok[:, None])
    tl.store(state_ptr + tl.maximum(snap, 0) * ss_s + d[:, None] * ss_d + j[None, :] * ss_k, at,
             mask=col_ok & snap_ok[:, None])


# the prefill conv's tile: runs of CONV_RUN tokens (each reads K - 1 rows more) x CONV_BLOCK_D
# channels in CONV_WARPS warps, 4 channels a thread. At Nemotron-3-Nano's 2048-token chunk (6144
# channels) on an H200: 23 us against 41 for 16 x 128 tiles of every tap loaded apart
# (docs/experiments.md)
CONV_RUN, CONV_BLOCK_D, CONV_WARPS = 8, 512, 4


def _block_d(D: int, cap: int) -> int:
    # a power of two (tl.arange), at least a warp wide, at most cap
    return max(32, min(cap, triton.next_power_of_2(D)))


def _num_warps(elems: int, per_thread: int) -> int:
    # enough warps that each thread handles about per_thread elements, 1 to 8 of them
    return max(1, min(8, elems // (32 * per_thread)))


def _check_common(x, conv_state, weight, bias, out, activation):
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2 or weight.dim() != 2:
        shapes = f"{tuple(x.shape)}, {tuple(weight.shape)}"
        raise ValueError(f"expected x [N, D] and weight [D, K], got {shapes}")
    D, K = weight.shape
    if K < 2:
        raise ValueError(f"conv width K must be >= 2, got {K}")
    if x.shape[1] != D:
        raise ValueError(f"x has {x.shape[1]} channels, weight has {D}")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (D, K - 1):
        raise ValueError(f"conv_state must be [S, {D}, {K - 1}], got {tuple(conv_state.shape)}")
    if bias is not None and bias.shape != (D,):
        raise ValueError(f"bias must be [{D}], got {tuple(bias.shape)}")
    if out.shape != x.shape:
        raise ValueError(f"out must be {tuple(x.shape)}, got {tuple(out.shape)}")
    tensors = [x, conv_state, weight, out] + ([bias] if bias is not None else [])
    if any(t.device != x.device for t in tensors):
        raise ValueError("x, conv_state, weight, bias and out must share one device")
    return D, K


def _check_index(name, t, n, device):
    if t.dim() != 1 or t.shape[0] < n or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 (or int64) vector of at least {n} entries")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the data on {device}")


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    return F.silu(y) if activation == "silu" else y


def conv1d_update_ref(x, conv_state, weight, bias, slot_idx, *, out=None, activation="silu"):
    """fp32 torch reference of :func:`conv1d_update` (loops over rows; syncs with the host)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    w = weight.float()
    b = torch.zeros(w.shape[0], device=x.device) if bias is None else bias.float()
    out.zero_()
    for row, slot in enumerate(slot_idx[: x.shape[0]].tolist()):
        if slot < 0:
            continue
        window = torch.cat([conv_state[slot].float(), x[row].float()[:, None]], dim=1)  # [D, K]
        out[row] = _activate((window * w).sum(-1) + b, activation).to(out.dtype)
        conv_state[slot] = window[:, 1:].to(conv_state.dtype)
    return out


def conv1d_varlen_ref(x, weight, bias, conv_state, meta, *, out=None, activation="silu"):
    """fp32 torch reference of :func:`conv1d_varlen` (loops over sequences; syncs with the host)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    D, K = weight.shape
    w = weight.float()
    b = torch.zeros(D, device=x.device) if bias is None else bias.float()
    out.zero_()
    cu = meta.cu_seqlens.tolist()
    has_init = meta.has_initial_state.tolist()
    snap_slots, snap_rows = meta.snapshot_slot.tolist(), meta.snapshot_row.tolist()
    finals = meta.final_slot.tolist()
    for i, slot in enumerate(meta.slot_idx.tolist()):
        if slot < 0:
            continue
        if has_init[i]:
            window = conv_state[slot].float()
        else:
            window = torch.zeros(D, K - 1, device=x.device)
        seq = torch.cat([window, x[cu[i] : cu[i + 1]].float().T], dim=1)  # [D, K-1 + L]
        taps = seq.unfold(1, K, 1)  # [D, L, K]: token t sees seq[:, t : t + K]
        y = (taps * w[:, None, :]).sum(-1) + b[:, None]  # [D, L]
        out[cu[i] : cu[i + 1]] = _activate(y, activation).T.to(out.dtype)
        if snap_slots[i] >= 0:  # the window before the snapshot's row: seq's columns up to it
            at = snap_rows[i] - cu[i] + K - 1
            conv_state[snap_slots[i]] = seq[:, at - (K - 1) : at].to(conv_state.dtype)
        if finals[i] >= 0:
            conv_state[finals[i]] = seq[:, seq.shape[1] - (K - 1) :].to(conv_state.dtype)
    return out


@with_reference(conv1d_update_ref)
def conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slot_idx: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv of one new token per row, updating each row's state slot in place.

    x:          [B, D]        fp32 or bf16, last dim contiguous or not (row stride free)
    conv_state: [S, D, K-1]   fp32 or bf16, any strides; the last K-1 inputs, oldest first
    weight:     [D, K]        fp32 or bf16
    bias:       [D]           fp32 or bf16, or None
    slot_idx:   [B]           int32 state slot of each row; PAD_SLOT_ID skips the row
    out:        [B, D]        x's dtype; allocated when None

    Row b with slot s >= 0: window = concat(conv_state[s], x[b][:, None]) ([D, K]);
    out[b] = act(sum_k weight[:, k] * window[:, k] + bias); conv_state[s] = window[:, 1:].
    A skipped row gets zeros. Live rows must have distinct slots. activation: "silu" or None.
    Returns out.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    D, K = _check_common(x, conv_state, weight, bias, out, activation)
    B = x.shape[0]
    _check_index("slot_idx", slot_idx, B, x.device)
    if B == 0:
        return out
    block_d = _block_d(D, 128)
    block_k = triton.next_power_of_2(K)
    grid = (B, triton.cdiv(D, block_d))
    _conv1d_update_kernel[grid](
        x, conv_state, weight, weight if bias is None else bias, slot_idx, out,
        D,
        x.stride(0), x.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0), weight.stride(1),
        0 if bias is None else bias.stride(0),
        out.stride(0), out.stride(1),
        K=K, BLOCK_K=block_k, BLOCK_D=block_d,
        HAS_BIAS=bias is not None, SILU=activation == "silu",
        num_warps=_num_warps(block_d, 1),
    )
    return out


@with_reference(conv1d_varlen_ref)
def conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    meta: PrefillMetadata,
    *,
    out: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv over packed prefill tokens, leaving each sequence's window in its slot.

    x:          [T, D]        fp32 or bf16 packed tokens (row stride free); T <= meta.max_tokens
    weight:     [D, K]        fp32 or bf16
    bias:       [D]           fp32 or bf16, or None
    conv_state: [S, D, K-1]   fp32 or bf16, any strides; the last K-1 inputs, oldest first
    meta:       PrefillMetadata on x's device, int32: cu_seqlens [max_seqs + 1],
                seq_idx [max_tokens], slot_idx [max_seqs], has_initial_state [max_seqs],
                final_slot, snapshot_slot, snapshot_row [max_seqs] (the chunk fields are unused)
    out:        [T, D]        x's dtype; allocated when None

    Sequence i with slot s >= 0 convolves its tokens x[cu[i]:cu[i+1]] starting from the window
    conv_state[s] when has_initial_state[i], else from zeros; afterwards conv_state[final_slot[i]]
    holds the last K-1 inputs of concat(initial window, tokens), and conv_state[snapshot_slot[i]]
    the K-1 before packed row snapshot_row[i] (each where that slot is >= 0; either may be s).
    Tokens of skipped sequences and padding tokens (seq_idx == -1) get zeros. Live sequences must
    have distinct slots and their tokens must lie within x's rows. activation: "silu" or None.
    Returns out.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    D, K = _check_common(x, conv_state, weight, bias, out, activation)
    T = x.shape[0]
    n_seqs = meta.slot_idx.shape[0]
    _check_index("meta.seq_idx", meta.seq_idx, T, x.device)
    _check_index("meta.cu_seqlens", meta.cu_seqlens, n_seqs + 1, x.device)
    _check_index("meta.slot_idx", meta.slot_idx, n_seqs, x.device)
    _check_index("meta.has_initial_state", meta.has_initial_state, n_seqs, x.device)
    _check_index("meta.final_slot", meta.final_slot, n_seqs, x.device)
    if T == 0:
        return out
    strides = (
        x.stride(0), x.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
    )

    grid = (triton.cdiv(T, CONV_RUN), triton.cdiv(D, CONV_BLOCK_D))
    _conv1d_varlen_out_kernel[grid](
        x, conv_state, weight, weight if bias is None else bias, out,
        meta.cu_seqlens, meta.seq_idx, meta.slot_idx, meta.has_initial_state,
        T, D,
        *strides,
        weight.stride(0), weight.stride(1),
        0 if bias is None else bias.stride(0),
        out.stride(0), out.stride(1),
        K=K, RUN=CONV_RUN, BLOCK_D=CONV_BLOCK_D,
        HAS_BIAS=bias is not None, SILU=activation == "silu",
        num_warps=CONV_WARPS,
    )

    # stream order puts the output kernel's reads of old states before their overwrite
    block_d = _block_d(D, 256)
    grid = (n_seqs, triton.cdiv(D, block_d))
    _conv1d_varlen_state_kernel[grid](
        x, conv_state,
        meta.cu_seqlens, meta.slot_idx, meta.has_initial_state, meta.final_slot, meta.snapshot_slot,
        meta.snapshot_row,
        T, D,
        *strides,
        K=K, BLOCK_K=triton.next_power_of_2(K), BLOCK_D=block_d,
        num_warps=_num_warps(block_d, 2),
    )
    return out
