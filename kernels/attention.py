"""Causal GQA attention over a slot-indexed KV cache: decode (one token per row) and packed prefill.

Per attention layer the KV pool is ``k_cache, v_cache: [S, max_ctx, KVH, Dh]``, indexed by the same
state slots as the Mamba2 state: slot ``s`` holds one request's whole context contiguously, position
``p`` at row ``p``. Query head ``h`` reads KV head ``h // (H // KVH)``. Scores are ``scale * q.k``
with no rotary embedding (Nemotron-H); softmax and accumulation run in fp32, and with bf16 inputs
the probabilities are rounded to bf16 before the ``p @ V`` product, as HF's eager attention does.

- ``decode_attention``: row ``b`` writes its new key/value at position ``kv_lens[b] - 1`` of its
  slot and attends to positions ``[0, kv_lens[b])``. Split-KV: the grid has a fixed number of
  splits (set by the static ``max_ctx``), and each row spreads its own length over them, so a short
  row runs several one-tile programs rather than one program looping over a long static split. One
  program per (row, KV head, split) covers the group's query heads, and a combine kernel merges the
  splits' partial softmaxes from a workspace. The program whose split holds the new token stores
  it and takes that position from registers, so no separate write kernel runs and no program
  reads a cache row another program writes.
- ``prefill_attention``: packed varlen tokens (see ``varlen.PrefillMetadata``). ``write_kv`` first
  stores every token's key/value at position ``context_lens[i] + j``; then each token attends to
  its slot's positions ``[0, context_lens[i] + j]``, which includes earlier chunks of the prompt.

The cache is in the queries' dtype, or FP8 (e4m3, ``FP8_KV_DTYPE``) as FP8 checkpoints ask
(ModelOpt's ``kv_cache_quant_algo``): then each layer has a key and a value scale
(``kv_scale``, fp32 [2]); a token is stored divided by them (rounded to nearest, saturated at
448) and read back multiplied, as the queries' dtype, before the products. A decode row attends
to its new token as stored, so a step sees what every later step will.

Rows whose slot is ``PAD_SLOT_ID``, tokens with ``seq_idx == -1`` and unused sequences never read
or write the cache and get zeros in ``out``. Positions are clamped to ``max_ctx`` so that bad
lengths can never reach another slot's rows. Live rows must own distinct slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import with_reference
from .fp8 import FP8_MAX
from .varlen import PAD_SLOT_ID, PrefillMetadata

__all__ = [
    "FP8_KV_DTYPE", "decode_attention", "decode_attention_ref", "decode_workspace", "prefill_attention",
    "prefill_attention_ref", "write_kv", "write_kv_ref",
]

# An FP8 KV cache's element type (its keys and values each over one scale a layer)
FP8_KV_DTYPE = torch.float8_e4m3fn

# Scores are carried in log2 units (scale * log2(e) folded into one multiply) so kernels use exp2.
_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, kt, vt, valid, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr):
    """One online-softmax step: q [M, D], kt/vt [N, D], valid [M, N] (used when MASKED).

    "ieee" gives fp32 operands exact fp32 dots (tf32 would cost ~1e-3 relative error); 16-bit
    operands run on the tensor cores whatever it says.
    """
    s = tl.dot(q, tl.trans(kt), input_precision="ieee") * qk_scale
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    # Every row has seen at least one visible key by the time it gets here (position 0 comes
    # first), so m_new is finite and no exp2(-inf - -inf) arises.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _split_len(kv_len, num_splits, QUANTUM: tl.constexpr):
    """Positions each split of a row of ``kv_len`` covers: the row's QUANTUM-position tiles spread
    evenly over ``num_splits`` splits. The split and combine kernels compute it alike."""
    return tl.cdiv(tl.cdiv(kv_len, QUANTUM), num_splits) * QUANTUM


@triton.jit
def _to_cache(x, scale_ptr, cache_ptr, FP8_KV: tl.constexpr):
    """Keys or values as the cache stores them: in its dtype, or FP8 over the layer's scale
    (``scale_ptr``: x / scale, saturated at the largest e4m3 value, rounded to nearest)."""
    if FP8_KV:
        x = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)), -448.0), 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _from_cache(x, scale_ptr, q_ptr, FP8_KV: tl.constexpr):
    """Cached keys or values in the queries' dtype (``q_ptr``'s): FP8 ones times the layer's scale."""
    if FP8_KV:
        x = (x.to(tl.float32) * tl.load(scale_ptr)).to(q_ptr.dtype.element_ty)
    return x


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, len_ptr, ws_ptr, kvs_ptr,
    qk_scale, max_ctx, num_splits,
    stride_q_b, stride_q_h,
    stride_k_b, stride_k_h,
    stride_v_b, stride_v_h,
    stride_kc_s, stride_kc_p, stride_kc_h,
    stride_vc_s, stride_vc_p, stride_vc_h,
    stride_ws_b, stride_ws_h, stride_ws_s,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
    FP8_KV: tl.constexpr,
    SIGNAL: tl.constexpr,
):
    # One program: row b, KV head kvh with its GROUP query heads, positions
    # [split * split_len, +split_len) cut at the row's length; split_len follows the row's length.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr + b)
    kv_len = tl.minimum(tl.load(len_ptr + b), max_ctx)
    split_len = _split_len(kv_len, num_splits, BLOCK_N)
    start = split * split_len
    if USE_PDL:
        # q and the new key and value are the previous kernel's; every program waits, the ones
        # that exit below too, so the chain's order holds (``kernels.decode_linear``)
        tl.extra.cuda.gdc_wait()
    if SIGNAL:  # the combine is a programmatic dependent (after the wait, or a plain launch's start)
        tl.extra.cuda.gdc_launch_dependents()
    # Splits past the row's length write nothing: the combine kernel knows from kv_len how many
    # splits a row has, so stale workspace entries are never read.
    if (slot < 0) | (start >= kv_len):
        return
    end = tl.minimum(start + split_len, kv_len)
    last = kv_len - 1
    # int64: a pool of S * max_ctx * KVH * Dh elements can pass 2**31.
    slot = slot.to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g

    # [BLOCK_G, BLOCK_D]; rows past GROUP are zeros that only pad the dot to 16 rows.
    q = tl.load(
        q_ptr + b * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :], other=0.0,
    )
    k_new = tl.load(k_ptr + b * stride_k_b + kvh * stride_k_h + offs_d, mask=mask_d, other=0.0)
    v_new = tl.load(v_ptr + b * stride_v_b + kvh * stride_v_h + offs_d, mask=mask_d, other=0.0)
    # as stored, and as attended to: what every later step reads back from the cache
    k_store = _to_cache(k_new, kvs_ptr, kc_ptr, FP8_KV)
    v_store = _to_cache(v_new, kvs_ptr + 1, vc_ptr, FP8_KV)
    k_new = _from_cache(k_store, kvs_ptr, q_ptr, FP8_KV)
    v_new = _from_cache(v_store, kvs_ptr + 1, q_ptr, FP8_KV)

    kc_base = kc_ptr + slot * stride_kc_s + kvh * stride_kc_h
    vc_base = vc_ptr + slot * stride_vc_s + kvh * stride_vc_h
    # Exactly one program of (b, kvh) holds the last position: it stores the new token. It never
    # loads that row (the loads below stop before `last`), so there is no read-after-write race.
    if end == kv_len:
        tl.store(kc_base + last * stride_kc_p + offs_d, k_store, mask=mask_d)
        tl.store(vc_base + last * stride_vc_p + offs_d, v_store, mask=mask_d)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # split_len is a multiple of BLOCK_N, so tiles never cross into the next split.
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        cached = (pos < last)[:, None] & mask_d[None, :]
        is_new = (pos == last)[:, None]
        kt = tl.load(kc_base + pos[:, None] * stride_kc_p + offs_d[None, :], mask=cached, other=0.0)
        vt = tl.load(vc_base + pos[:, None] * stride_vc_p + offs_d[None, :], mask=cached, other=0.0)
        kt = _from_cache(kt, kvs_ptr, q_ptr, FP8_KV)
        vt = _from_cache(vt, kvs_ptr + 1, q_ptr, FP8_KV)
        kt = tl.where(is_new, k_new[None, :], kt)
        vt = tl.where(is_new, v_new[None, :], vt)
        m_i, l_i, acc = _attend_tile(q, kt, vt, (pos < end)[None, :], m_i, l_i, acc, qk_scale, True)

    # Partial result of this split: the normalised output and its log2-sum-exp2.
    ws = ws_ptr + b * stride_ws_b + heads * stride_ws_h + split * stride_ws_s  # [BLOCK_G]
    tl.store(ws[:, None] + offs_d[None, :], acc / l_i[:, None], mask=mask_g[:, None] & mask_d[None, :])
    tl.store(ws + HEAD_DIM, m_i + tl.log2(l_i), mask=mask_g)


@triton.jit
def _decode_combine_kernel(
    ws_ptr, slot_ptr, len_ptr, out_ptr,
    max_ctx, num_splits,
    stride_ws_b, stride_ws_h, stride_ws_s,
    stride_out_b, stride_out_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTUM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + b)
    kv_len = tl.maximum(tl.minimum(tl.load(len_ptr + b), max_ctx), 0)
    if USE_PDL:  # the partials are the previous kernel's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Splits that ran for this row; none for a pad row, whose output becomes zeros.
    split_len = _split_len(kv_len, num_splits, QUANTUM)
    n_splits = tl.where(slot >= 0, tl.cdiv(kv_len, tl.maximum(split_len, 1)), 0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < n_splits
    mask_d = offs_d < HEAD_DIM
    ws = ws_ptr + b * stride_ws_b + h * stride_ws_h + offs_s * stride_ws_s  # [BLOCK_S]
    lse = tl.load(ws + HEAD_DIM, mask=mask_s, other=float("-inf"))
    o = tl.load(ws[:, None] + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    # Masked splits hold -inf and weigh 0; a pad row has no split, so shift by 0 instead of -inf.
    w = tl.exp2(lse - tl.where(n_splits > 0, tl.max(lse, 0), 0.0))
    den = tl.sum(w, 0)
    y = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_out_b + h * stride_out_h + offs_d, y.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, seq_idx_ptr, cu_ptr, slot_ptr, ctx_ptr, kvs_ptr,
    max_ctx,
    stride_k_t, stride_k_h,
    stride_v_t, stride_v_h,
    stride_kc_s, stride_kc_p, stride_kc_h,
    stride_vc_s, stride_vc_p, stride_vc_h,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    # One program: one packed token, all its KV heads ([KVH, Dh] is a few KiB at most).
    t = tl.program_id(0)
    seq = tl.load(seq_idx_ptr + t)
    if seq < 0:
        return
    slot = tl.load(slot_ptr + seq)
    pos = tl.load(ctx_ptr + seq) + t - tl.load(cu_ptr + seq)
    if (slot < 0) | (pos >= max_ctx):
        return
    slot = slot.to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    kc = kc_ptr + slot * stride_kc_s + pos * stride_kc_p + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    vc = vc_ptr + slot * stride_vc_s + pos * stride_vc_p + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(kc, _to_cache(k, kvs_ptr, kc_ptr, FP8_KV), mask=mask)
    tl.store(vc, _to_cache(v, kvs_ptr + 1, vc_ptr, FP8_KV), mask=mask)


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, cu_ptr, slot_ptr, ctx_ptr, kvs_ptr,
    qk_scale, num_tokens, num_seqs, max_ctx,
    stride_q_t, stride_q_h,
    stride_kc_s, stride_kc_p, stride_kc_h,
    stride_vc_s, stride_vc_p, stride_vc_h,
    stride_out_t, stride_out_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    # One program: query head h, one block of BLOCK_M tokens of one sequence. Blocks are aligned
    # to sequence starts (sequence i owns cdiv(len_i, BLOCK_M) consecutive block ids), so a block
    # never holds two sequences and reads a single slot. The grid has cdiv(T, BLOCK_M) + max_seqs
    # blocks per head, enough for every sequence block plus the padding rows after them. Blocks
    # run last to first (the grid launches in order): a sequence's later blocks see more keys, so
    # the longest programs start first and the short ones fill the tail.
    h = tl.program_id(0)
    pid = tl.num_programs(1) - 1 - tl.program_id(1)

    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_seqs
    seq_lo = tl.load(cu_ptr + offs_s, mask=mask_s, other=0)
    seq_hi = tl.load(cu_ptr + offs_s + 1, mask=mask_s, other=0)
    n_blocks = tl.cdiv(seq_hi - seq_lo, BLOCK_M)
    blocks_end = tl.cumsum(n_blocks, 0)  # [BLOCK_S] inclusive prefix sum
    seq = tl.sum((blocks_end <= pid).to(tl.int32), 0)
    total_blocks = tl.sum(n_blocks, 0)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    out_h = out_ptr + h * stride_out_h
    if seq >= num_seqs:
        # Past every sequence's blocks: zero a block of the padding tokens after the last one.
        rows = tl.load(cu_ptr + num_seqs) + (pid - total_blocks) * BLOCK_M + offs_m
        zero = tl.zeros([BLOCK_M, BLOCK_D], out_ptr.dtype.element_ty)
        tl.store(out_h + rows[:, None] * stride_out_t + offs_d[None, :], zero,
                 mask=(rows < num_tokens)[:, None] & mask_d[None, :])
        return

    first_block = tl.sum(tl.where(offs_s == seq, blocks_end - n_blocks, 0), 0)
    tok0 = tl.load(cu_ptr + seq)
    seq_len = tl.load(cu_ptr + seq + 1) - tok0
    j0 = (pid - first_block) * BLOCK_M
    j = j0 + offs_m  # index within the sequence
    rows = tok0 + j
    mask_m = j < seq_len
    slot = tl.load(slot_ptr + seq)
    if slot < 0:
        zero = tl.zeros([BLOCK_M, BLOCK_D], out_ptr.dtype.element_ty)
        tl.store(out_h + rows[:, None] * stride_out_t + offs_d[None, :], zero,
                 mask=mask_m[:, None] & mask_d[None, :])
        return
    slot = slot.to(tl.int64)
    ctx = tl.load(ctx_ptr + seq)
    kvh = h // GROUP

    q = tl.load(q_ptr + rows[:, None] * stride_q_t + h * stride_q_h + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = ctx + j  # [BLOCK_M] cache position of each query token
    # One past the last key any row of the block sees.
    j_last = tl.minimum(j0 + BLOCK_M, seq_len) - 1
    kv_hi = tl.minimum(ctx + j_last + 1, max_ctx)
    # Keys below `full` are visible to every row of the block: no causal mask there.
    full = tl.minimum((ctx + j0 + 1) // BLOCK_N * BLOCK_N, kv_hi)

    kc_base = kc_ptr + slot * stride_kc_s + kvh * stride_kc_h
    vc_base = vc_ptr + slot * stride_vc_s + kvh * stride_vc_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, full, BLOCK_N):
        pos = n0 + offs_n
        kt = tl.load(kc_base + pos[:, None] * stride_kc_p + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        vt = tl.load(vc_base + pos[:, None] * stride_vc_p + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        kt = _from_cache(kt, kvs_ptr, q_ptr, FP8_KV)
        vt = _from_cache(vt, kvs_ptr + 1, q_ptr, FP8_KV)
        m_i, l_i, acc = _attend_tile(q, kt, vt, mask_m[:, None], m_i, l_i, acc, qk_scale, False)
    # The diagonal tiles: each row sees the keys at or before its own position.
    for n0 in range(full, kv_hi, BLOCK_N):
        pos = n0 + offs_n
        in_kv = pos < kv_hi
        kt = tl.load(kc_base + pos[:, None] * stride_kc_p + offs_d[None, :],
                     mask=in_kv[:, None] & mask_d[None, :], other=0.0)
        vt = tl.load(vc_base + pos[:, None] * stride_vc_p + offs_d[None, :],
                     mask=in_kv[:, None] & mask_d[None, :], other=0.0)
        kt = _from_cache(kt, kvs_ptr, q_ptr, FP8_KV)
        vt = _from_cache(vt, kvs_ptr + 1, q_ptr, FP8_KV)
        valid = (pos[None, :] <= q_pos[:, None]) & in_kv[None, :]
        m_i, l_i, acc = _attend_tile(q, kt, vt, valid, m_i, l_i, acc, qk_scale, True)

    y = acc / l_i[:, None]
    tl.store(out_h + rows[:, None] * stride_out_t + offs_d[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


# Decode splits: the grid has about this many splits a row (fewer when max_ctx is short), as many as
# cutting max_ctx into pieces of a multiple of _SPLIT_QUANTUM positions gives. 32 splits of a 4096
# context give 256 programs at batch 1 with 8 KV heads, about two per H200 SM; the partials they
# write are ~3% of the KV bytes they read. Each row spreads its own length over the splits
# (``_split_len``): in a 4352-position pool a 256-position row runs four one-tile programs, where a
# static split of 192 positions gave one program three serial tiles (Nano batch 1: -1.3% a step).
_DECODE_SPLITS = 32
_SPLIT_QUANTUM = 64


def _decode_num_splits(max_ctx: int) -> int:
    """Splits a row of the decode grid has for a static ``max_ctx``."""
    split_len = _SPLIT_QUANTUM * max(1, triton.cdiv(triton.cdiv(max_ctx, _DECODE_SPLITS), _SPLIT_QUANTUM))
    return triton.cdiv(max_ctx, split_len)


def decode_workspace(batch: int, num_heads: int, head_dim: int, max_ctx: int, device=None) -> torch.Tensor:
    """Workspace for :func:`decode_attention`: fp32 ``[batch, H, num_splits, Dh + 1]``.

    Allocate it once at the largest batch; a step may pass ``workspace[:b]``.
    """
    splits = _decode_num_splits(max_ctx)
    return torch.empty(batch, num_heads, splits, head_dim + 1, dtype=torch.float32, device=device)


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None = None) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")


def _check_inner_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {tuple(t.stride())}")


def _check_kv_dtype(x: torch.Tensor, k_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> bool:
    """Whether the cache is FP8 (e4m3, over ``kv_scale``); else it must be in ``x``'s dtype, and
    no scale is taken (one passed to a full-precision cache would be ignored)."""
    if k_cache.dtype == FP8_KV_DTYPE:
        if kv_scale is None:
            raise ValueError("an FP8 KV cache needs kv_scale, the layer's (key scale, value scale)")
        _check("kv_scale", kv_scale, (2,), torch.float32)
        if kv_scale.device != k_cache.device:
            raise ValueError(f"kv_scale must be on the cache's device ({k_cache.device}), got {kv_scale.device}")
        return True
    if kv_scale is not None:
        raise ValueError(f"kv_scale is for an FP8 KV cache; this one is {k_cache.dtype}")
    _check("k_cache", k_cache, tuple(k_cache.shape), x.dtype)
    return False


def _check_cache(q, k, v, k_cache, v_cache, out, rows, kv_scale) -> tuple[int, int, int, int]:
    """Shared shape checks; returns (H, KVH, Dh, max_ctx)."""
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [S, max_ctx, KVH, Dh], got {list(k_cache.shape)}")
    S, max_ctx, KVH, Dh = k_cache.shape
    H = q.shape[1]
    _check_kv_dtype(q, k_cache, kv_scale)
    _check("q", q, (rows, H, Dh))
    _check("k", k, (rows, KVH, Dh), q.dtype)
    _check("v", v, (rows, KVH, Dh), q.dtype)
    _check("v_cache", v_cache, (S, max_ctx, KVH, Dh), k_cache.dtype)
    if out is not None:
        _check("out", out, (rows, H, Dh), q.dtype)
    if KVH == 0 or H % KVH:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({KVH})")
    return H, KVH, Dh, max_ctx


def _check_meta(meta: PrefillMetadata, tokens: int) -> None:
    _check("meta.seq_idx", meta.seq_idx, (tokens,), torch.int32)
    for name in ("cu_seqlens", "slot_idx", "context_lens"):
        t = getattr(meta, name)
        if t.dtype != torch.int32 or t.dim() != 1 or t.stride(0) != 1:
            raise ValueError(f"meta.{name} must be a contiguous int32 vector")
    if meta.cu_seqlens.shape[0] != meta.max_seqs + 1 or meta.context_lens.shape[0] != meta.max_seqs:
        raise ValueError("meta.cu_seqlens must have max_seqs + 1 entries, context_lens max_seqs")


def _to_cache_ref(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Keys or values as ``cache`` stores them (FP8: x / scale, saturated, rounded to nearest)."""
    if cache.dtype != FP8_KV_DTYPE:
        return x
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def _from_cache_ref(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached keys or values in fp32 (FP8 ones times their scale)."""
    return x.float() * scale if x.dtype == FP8_KV_DTYPE else x.float()


def _scales(kv_scale):
    return (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])


def decode_attention_ref(q, k, v, k_cache, v_cache, slot_idx, kv_lens, *, scale, out=None, workspace=None,
                         pdl=False, kv_scale=None, first_pdl=True):
    """Plain fp32 torch reference; same contract as :func:`decode_attention` (``workspace`` unused).

    Loops over rows and reads lengths on the host: the CPU path and the tests' oracle.
    """
    B = q.shape[0]
    H, KVH, Dh, max_ctx = _check_cache(q, k, v, k_cache, v_cache, out, B, kv_scale)
    ks, vs = _scales(kv_scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    out.zero_()
    for b, (slot, n) in enumerate(zip(slot_idx.tolist(), kv_lens.tolist())):
        n = min(n, max_ctx)
        if slot == PAD_SLOT_ID or n <= 0:
            continue
        k_cache[slot, n - 1] = _to_cache_ref(k[b], k_cache, ks)
        v_cache[slot, n - 1] = _to_cache_ref(v[b], v_cache, vs)
        y = _attend_ref(q[b, None], _from_cache_ref(k_cache[slot, :n], ks), _from_cache_ref(v_cache[slot, :n], vs),
                        n - 1, scale)
        out[b] = y[0].to(out.dtype)
    return out


@with_reference(decode_attention_ref)
def decode_attention(q, k, v, k_cache, v_cache, slot_idx, kv_lens, *, scale, out=None, workspace=None,
                     pdl=False, kv_scale=None, first_pdl=True):
    """Attention of one new token per row over its slot's cached context, after caching the token.

    q:         [B, H, Dh] bf16 or fp32 (may be a strided view, last dim contiguous)
    k, v:      [B, KVH, Dh] the new token's key and value, q's dtype (strided views allowed)
    k_cache, v_cache: [S, max_ctx, KVH, Dh] q's dtype, or FP8 (e4m3) over ``kv_scale``; the pool;
               row kv_lens[b] - 1 of slot slot_idx[b] is overwritten with k[b], v[b] (FP8: divided
               by their scale, saturated), nothing else changes
    slot_idx:  [B] int32 slot of each row; PAD_SLOT_ID (-1) skips the row
    kv_lens:   [B] int32 context length including the new token (1 <= kv_lens <= max_ctx)
    scale:     softmax scale (head_dim ** -0.5 for Nemotron-H)
    out:       [B, H, Dh] q's dtype, written in full (zeros for pad rows); allocated if None
    workspace: fp32 [B, H, num_splits, Dh + 1] from :func:`decode_workspace`; allocated if None
    pdl:       both kernels launch as programmatic dependents of the previous one, as the fused
               decode projections around them (``kernels.decode_linear``; CUDA, sm_90+); with
               ``first_pdl`` False only the second (the first kernel on a forked stream)
    kv_scale:  fp32 [2], an FP8 cache's key and value scales (its values times them are the keys
               and values attended to, the new token's too); None for a full-precision cache

    Query head h attends with KV head h // (H // KVH) to positions [0, kv_lens[b]). CUDA tensors
    run the Triton kernels (no host sync, capturable); CPU tensors run the reference. Returns out.
    """
    B = q.shape[0]
    H, KVH, Dh, max_ctx = _check_cache(q, k, v, k_cache, v_cache, out, B, kv_scale)
    _check("slot_idx", slot_idx, (B,), torch.int32)
    _check("kv_lens", kv_lens, (B,), torch.int32)
    num_splits = _decode_num_splits(max_ctx)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if workspace is None:
        workspace = decode_workspace(B, H, Dh, max_ctx, device=q.device)
    _check("workspace", workspace, (B, H, num_splits, Dh + 1), torch.float32)
    _check_inner_contiguous(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, out=out, workspace=workspace)
    if slot_idx.stride(0) != 1 or kv_lens.stride(0) != 1:
        raise ValueError("slot_idx and kv_lens must be contiguous")
    if B == 0:
        return out

    group = H // KVH
    extra = {"launch_pdl": True} if pdl else {}
    first = pdl and first_pdl
    block_d = max(16, triton.next_power_of_2(Dh))
    # 64 positions of bf16 K and V per tile; fp32 tiles are halved to keep the same bytes.
    block_n = 64 if k_cache.element_size() <= 2 else 32
    fp8 = kv_scale is not None
    _decode_split_kernel[(B, KVH, num_splits)](
        q, k, v, k_cache, v_cache, slot_idx, kv_lens, workspace, kv_scale if fp8 else workspace,
        scale * _LOG2E, max_ctx, num_splits,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        workspace.stride(0), workspace.stride(1), workspace.stride(2),
        GROUP=group, HEAD_DIM=Dh,
        # tl.dot needs at least 16 rows; the group (4 in Nemotron-H-8B) is padded with zero rows.
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, BLOCK_D=block_d, USE_PDL=first, FP8_KV=fp8, SIGNAL=pdl,
        num_warps=4, num_stages=2, **({"launch_pdl": True} if first else {}),
    )
    _decode_combine_kernel[(B, H)](
        workspace, slot_idx, kv_lens, out,
        max_ctx, num_splits,
        workspace.stride(0), workspace.stride(1), workspace.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=Dh, BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=triton.next_power_of_2(Dh),
        QUANTUM=block_n, USE_PDL=pdl, num_warps=4, **extra,
    )
    return out


def _sequences(meta: PrefillMetadata, max_ctx: int):
    """(token range, slot, context) of each live sequence, read on the host; positions clamped."""
    cu = meta.cu_seqlens.tolist()
    for i, (slot, ctx) in enumerate(zip(meta.slot_idx.tolist(), meta.context_lens.tolist())):
        n = min(cu[i + 1] - cu[i], max_ctx - ctx)
        if slot != PAD_SLOT_ID and n > 0:
            yield cu[i], n, slot, ctx


def write_kv_ref(k, v, k_cache, v_cache, meta, kv_scale=None):
    """Torch reference of :func:`write_kv` (host loop over sequences)."""
    _check_kv_dtype(k, k_cache, kv_scale)
    ks, vs = _scales(kv_scale)
    for t0, n, slot, ctx in _sequences(meta, k_cache.shape[1]):
        k_cache[slot, ctx : ctx + n] = _to_cache_ref(k[t0 : t0 + n], k_cache, ks)
        v_cache[slot, ctx : ctx + n] = _to_cache_ref(v[t0 : t0 + n], v_cache, vs)


@with_reference(write_kv_ref)
def write_kv(k, v, k_cache, v_cache, meta, kv_scale=None):
    """Store packed prefill tokens' keys and values in their slots.

    k, v:      [T, KVH, Dh] (strided views allowed, last dim contiguous)
    k_cache, v_cache: [S, max_ctx, KVH, Dh], k's dtype or FP8 over ``kv_scale`` (fp32 [2], the
               key and value scales: stored are k / scale, saturated); token j of sequence i goes to row
               meta.context_lens[i] + j of slot meta.slot_idx[i]
    meta:      PrefillMetadata on the caches' device (T = meta.max_tokens); tokens with seq_idx -1,
               sequences with slot PAD_SLOT_ID and positions >= max_ctx are skipped
    """
    T, KVH, Dh = k.shape
    fp8 = _check_kv_dtype(k, k_cache, kv_scale)
    _check("k_cache", k_cache, (k_cache.shape[0], k_cache.shape[1], KVH, Dh))
    _check("v_cache", v_cache, tuple(k_cache.shape), k_cache.dtype)
    _check("v", v, (T, KVH, Dh), k.dtype)
    _check_meta(meta, T)
    _check_inner_contiguous(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, meta.seq_idx, meta.cu_seqlens, meta.slot_idx, meta.context_lens,
        kv_scale if fp8 else meta.context_lens, k_cache.shape[1],
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        KV_HEADS=KVH, HEAD_DIM=Dh,
        BLOCK_H=triton.next_power_of_2(KVH), BLOCK_D=triton.next_power_of_2(Dh), FP8_KV=fp8,
        num_warps=max(1, min(4, KVH * Dh // 256)),
    )


def _attend_ref(q, keys, values, first_pos, scale):
    """fp32 causal GQA attention: q [M, H, Dh] at positions first_pos + i over keys/values [N, KVH, Dh]."""
    M, H, _ = q.shape
    N, KVH, _ = keys.shape
    group = H // KVH
    kf = keys.float().repeat_interleave(group, dim=1)  # [N, H, Dh]
    vf = values.float().repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.float(), kf) * scale
    visible = torch.arange(N)[None, :] <= first_pos + torch.arange(M)[:, None]  # [M, N]
    s = s.masked_fill(~visible.to(s.device), float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s, dim=-1), vf)


def prefill_attention_ref(q, k, v, k_cache, v_cache, meta, *, scale, out=None, kv_scale=None):
    """Plain fp32 torch reference; same contract as :func:`prefill_attention` (host loops)."""
    T = q.shape[0]
    _, _, _, max_ctx = _check_cache(q, k, v, k_cache, v_cache, out, T, kv_scale)
    ks, vs = _scales(kv_scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    out.zero_()
    write_kv_ref(k, v, k_cache, v_cache, meta, kv_scale)
    for t0, n, slot, ctx in _sequences(meta, max_ctx):
        y = _attend_ref(q[t0 : t0 + n], _from_cache_ref(k_cache[slot, : ctx + n], ks),
                        _from_cache_ref(v_cache[slot, : ctx + n], vs), ctx, scale)
        out[t0 : t0 + n] = y.to(out.dtype)
    return out


@with_reference(prefill_attention_ref)
def prefill_attention(q, k, v, k_cache, v_cache, meta, *, scale, out=None, kv_scale=None):
    """Causal attention of packed prefill tokens over their slots' context, after caching them.

    q:        [T, H, Dh] bf16 or fp32, T = meta.max_tokens (strided views allowed, last dim contiguous)
    k, v:     [T, KVH, Dh] the tokens' keys and values, q's dtype (strided views allowed)
    k_cache, v_cache: [S, max_ctx, KVH, Dh] q's dtype, or FP8 over ``kv_scale`` (as
              :func:`decode_attention`'s); token j of sequence i is stored at row
              context_lens[i] + j of slot slot_idx[i] (see :func:`write_kv`), nothing else changes
    meta:     PrefillMetadata (int32, on q's device); uses cu_seqlens, seq_idx, slot_idx, context_lens
    scale:    softmax scale (head_dim ** -0.5 for Nemotron-H)
    out:      [T, H, Dh] q's dtype, written in full (zeros for padding tokens and unused
              sequences); allocated if None

    Token j of sequence i attends to positions [0, context_lens[i] + j] of its slot, so a chunk
    sees the earlier chunks of its prompt. Requires context_lens[i] + len_i <= max_ctx. CUDA
    tensors run the Triton kernels (no host sync, capturable); CPU tensors run the reference.
    """
    T = q.shape[0]
    H, KVH, Dh, max_ctx = _check_cache(q, k, v, k_cache, v_cache, out, T, kv_scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _check_inner_contiguous(q=q, out=out)
    write_kv.triton(k, v, k_cache, v_cache, meta, kv_scale)
    if T == 0:
        return out
    block_m = 64
    # Same K/V tile bytes for fp32 as for 16-bit (shared memory for the pipelined loads).
    block_n = 64 if k_cache.element_size() <= 2 else 32
    _prefill_kernel[(H, triton.cdiv(T, block_m) + meta.max_seqs)](
        q, k_cache, v_cache, out, meta.cu_seqlens, meta.slot_idx, meta.context_lens,
        kv_scale if kv_scale is not None else meta.context_lens, scale * _LOG2E, T, meta.max_seqs, max_ctx,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        GROUP=H // KVH, HEAD_DIM=Dh,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(Dh)),
        BLOCK_S=max(2, triton.next_power_of_2(meta.max_seqs)), FP8_KV=kv_scale is not None,
        num_warps=4, num_stages=2,
    )
    return out
