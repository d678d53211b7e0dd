"""Skinny projections for small decode batches, with the neighbouring element-wise work fused in.

At decode batch 1-2 a projection is a matrix-vector product whose cost is its weight read plus
the latency of a launch; the norm before it and the element-wise work after it are launches of
their own that move almost nothing. Here one kernel does all three:

- prologue, the projection's input: the raw rows; RMSNorm of each row (the block norm); or
  Mamba2's gated, grouped RMSNorm of ``y * silu(z)``. Every program recomputes the row norms of
  its (at most ``MAX_ROWS``) rows from L2, so programs never communicate.
- the product: each program owns ``BLOCK_N`` output columns and reads its ``[BLOCK_N, K]``
  slice of the weight once, as plain multiply-adds in fp32 (no tensor cores: a 16-row MMA tile
  would be mostly padding). Two ways through K (``_config``):
  - one tile: up to ``ONE_TILE_MAX_K`` columns (Mamba2-130M's block projections, and its LM
    head at one row), the whole slice is loaded into registers before the wait, and the rows are
    taken one after the other in the tile's layout, mostly one warp a program. The per-row work
    grows with the rows: in a whole decode step 1-4 rows pay, 8 do not.
  - streamed: wider K (Nemotron-H-8B) and vocabulary-wide grids (LM heads) loop over K tiles
    with software pipelining, each tile read once for all rows. A block norm is applied after
    the product (each row's sum of squares comes along in the same pass, and its rstd scales the
    sums at the end); its weight is a third input stream in every tile unless the model folded
    it into the projection (``unit_norm``). A gated norm runs as a kernel of its own first,
    which measured faster than recomputing its groups tile by tile. One row sums its products in
    a 2-D [BLOCK_N, BLOCK_K] tile (``ONE_ROW_TILES``), more rows in a 3-D [rows, BLOCK_N,
    BLOCK_K] one, whose layout has shared memory hand each thread its FP8 weights a byte a load
    (a 2-D tile keeps the 16 contiguous bytes a thread loaded: one FP8 row's step 5-6% faster;
    two rows can keep them too, ``TWO_ROW_TILES``).
- epilogue: store the rounded product; or add it into the residual stream in place; or squared
  ReLU; or SwiGLU over a [gate | up] weight (a program owns output columns' gate and up rows
  side by side, and stores silu(gate) * up: no activation kernel after it); or, for Mamba2's
  in_proj, the causal conv1d decode update (state shift and SiLU) on the ``xBC`` columns, which
  one program owns per channel, so the conv state has a single writer. Beside the plain store
  or the conv update, the rotary embedding of an attention QKV projection's query and key heads
  (``RopeTail``): a program over the rotated dims owns rotation pairs side by side, as SwiGLU's
  gate and up rows, so no rope kernel runs after the projection.

Programmatic dependent launch (sm_90+): with ``pdl=True`` a kernel may start while the previous one
drains. Before ``gdc_wait`` it loads only what the previous kernel cannot be writing: its first
weight tile (and a one-tile kernel's norm weight), the biases, the conv weights and state (no other
kernel touches a layer's conv state within a step), and with ``early=True`` the gate z and the
residual (then the epilogue after the product loads nothing). Those are safe because a kernel here
signals its dependents (``gdc_launch_dependents``) only after its own wait returned, i.e. after its
predecessor completed: so when a kernel starts, everything two or more launches back in the stream
is complete. A one-tile kernel (one wave; or an LM head, the step's last kernel) signals right
after its wait; a streamed one, whose programs run in several waves, only after its K loop, so that
dependents take SM slots as its last wave drains rather than idle in them through it
(docs/experiments.md). Every kernel calls ``gdc_wait`` before reading its direct predecessor's
output, so the chain stays ordered end to end.

A kernel that also waits on another stream (the MoE combine, after the shared expert's join)
launches as a programmatic dependent all the same: its wait returns only once the other stream's
work has completed too, so the rule holds across the join. The gated
norm before a streamed product (``kernels.norm``) and the decode attention's two kernels
(``kernels.attention``) take part in the chain like a one-tile kernel here: every program waits,
then signals, before anything else it reads.

Numerics follow the unfused ops: the product is rounded to the weight dtype (as ``F.linear``),
then the epilogue runs on the rounded value in fp32, as ``conv1d_update`` / ``rms_norm`` would.
The references compose those unfused references. One difference: the streamed path does not
round the normalised input to the weight dtype before the product (it never materialises it),
so it is, if anything, closer to the fp32 result; the tests hold both paths to the references.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import rope as rotary
from .activation import silu_mul, silu_mul_ref
from .conv1d import conv1d_update_ref
from .dispatch import with_reference
from .fp8 import Fp8Weight
from .norm import gated_rms_norm, gated_rms_norm_ref, rms_norm_ref

__all__ = [
    "MAX_ROWS",
    "ONE_TILE_MAX_K",
    "ConvTail",
    "RopeTail",
    "norm_linear",
    "norm_linear_ref",
    "gated_norm_linear",
    "gated_norm_linear_ref",
    "hopper_or_newer",
    "pdl_supported",
    "streams",
]

# The kernels take up to 8 rows; the model uses them at 1-4 (``runtime.decode_options``).
MAX_ROWS = 8
# The widest K held as one tile in registers; wider projections stream K (see ``_config``).
ONE_TILE_MAX_K = 2048

# one row streamed in a 2-D [BLOCK_N, BLOCK_K] tile (``_add_products``), not the rows' 3-D one: the
# FP8 one-row steps of Nemotron-3-Nano and Nemotron-H-8B 5.6% and 4.9% faster, bf16 ones 0.4-1.1%
# (H100, docs/experiments.md)
ONE_ROW_TILES = True
# two rows so too, in a [BLOCK_N, BLOCK_K, 2] tile (``_add_products``): the same FP8 steps a further
# 5.3%, 8.6% and 4.4% faster (H100, docs/experiments.md)
TWO_ROW_TILES = True

_PRO_NONE, _PRO_RMS, _PRO_GATED = 0, 1, 2
_EPI_STORE, _EPI_RESIDUAL, _EPI_RELU2, _EPI_CONV, _EPI_SWIGLU = 0, 1, 2, 3, 4


class ConvTail(NamedTuple):
    """Mamba2's conv1d decode update as an in_proj epilogue, on output columns [lo, lo + D).

    state: [S, D, K-1] slot pool (any strides); weight: [D, K]; bias: [D] or None;
    slots: [rows] int32 slot of each row, PAD_SLOT_ID for padding (state untouched, zeros out).
    """

    state: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    slots: torch.Tensor
    lo: int


class RopeTail(NamedTuple):
    """The rotary embedding (``kernels.rope``'s) of a QKV projection's decode rows as its epilogue:
    ``q_heads`` query then ``k_heads`` key heads of ``head_dim`` columns from output column ``lo``,
    the first ``2 * len(inv_freq)`` dims of each rotated.

    inv_freq: [R / 2] fp32 (``rope_inv_freq``); kv_lens: [rows] int32, each row's context
    including its new token (the row's position is kv_lens - 1).
    """

    inv_freq: torch.Tensor
    kv_lens: torch.Tensor
    lo: int
    q_heads: int
    k_heads: int
    head_dim: int


class _Rows(NamedTuple):
    n: int  # rows computed
    idx: torch.Tensor | None  # [n] source row of each, or None for rows 0..n-1


@triton.jit
def _input_rows(x_ptr, z, src, row_ok, cols, col_ok, stride_x, GATED: tl.constexpr):
    """Rows ``src`` of x over ``cols`` in fp32 ([rows, BLOCK_K]), times silu(z) when GATED."""
    mask = row_ok[:, None] & col_ok[None, :]
    a = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATED:
        z = z.to(tl.float32)
        a = a * z * tl.sigmoid(z)
    return a


@triton.jit
def swiglu_rows(N, BLOCK_N: tl.constexpr):
    """A SwiGLU projection's weight rows for this program, over w = [gate | up] (N = 2I rows):
    BLOCK_N / 2 output columns' gate and up rows side by side (j, I + j, j + 1, I + j + 1, ...),
    so that its epilogue (``swiglu_pairs``) pairs them within the program; and which are in range."""
    i = tl.arange(0, BLOCK_N)
    col = tl.program_id(0) * (BLOCK_N // 2) + i // 2
    return col + (i % 2) * (N // 2), col < N // 2


@triton.jit
def swiglu_pairs(y, n, n_ok, ACT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """silu(gate) * up of the program's rows ``n`` (``swiglu_rows``'s; y: their products, rounded
    as the projection hands them on, [.., BLOCK_N]), silu(gate) rounded to ACT_DTYPE as HF's op:
    (the values [BLOCK_N / 2] in fp32, their output columns, which are in range)."""
    gate, up = tl.split(tl.reshape(y.to(tl.float32), (BLOCK_N // 2, 2)))
    col, _ = tl.split(tl.reshape(n.to(tl.int64), (BLOCK_N // 2, 2)))
    col_ok, _ = tl.split(tl.reshape(n_ok.to(tl.int32), (BLOCK_N // 2, 2)))
    return (gate * tl.sigmoid(gate)).to(ACT_DTYPE).to(tl.float32) * up, col, col_ok > 0


@triton.jit
def rope_rows(n, rope_lo, rope_heads, head_dim, HALF, BLOCK_N: tl.constexpr):
    """A program whose columns fall in a head's rotated dims (``RopeTail``; BLOCK_N divides the
    offset, the head dim and the rotated dims) takes its rotation pairs side by side instead: (j,
    HALF + j, j + 1, HALF + j + 1, ...), so that its epilogue (``rope_pairs``) pairs them within
    the program. Returns its weight rows, the pairs' indices j [BLOCK_N / 2] and whether it rotates."""
    start = tl.program_id(0) * BLOCK_N - rope_lo
    head = tl.maximum(start, 0) // head_dim
    c0 = tl.maximum(start, 0) - head * head_dim
    rotating = (start >= 0) & (head < rope_heads) & (c0 < 2 * HALF)
    i = tl.arange(0, BLOCK_N)
    paired = rope_lo + head * head_dim + c0 // 2 + i // 2 + (i % 2) * HALF
    return tl.where(rotating, paired, n), c0 // 2 + tl.arange(0, BLOCK_N // 2), rotating


@triton.jit
def rope_pairs(y, cos, sin, BLOCK_N: tl.constexpr):
    """``rope_rows``' columns of one row rotated (y [1, BLOCK_N]; cos, sin [1, BLOCK_N / 2]), as
    ``kernels.rope`` rotates: x[j] cos - x[HALF + j] sin, x[HALF + j] cos + x[j] sin."""
    a, b = tl.split(tl.reshape(y, (1, BLOCK_N // 2, 2)))
    return tl.reshape(tl.join(a * cos - b * sin, b * cos + a * sin), (1, BLOCK_N))


@triton.jit
def _load_rows(ptr, src, row_ok, cols, col_ok, stride):
    return tl.load(ptr + src[:, None] * stride + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _pick(t, m, BLOCK_M: tl.constexpr):
    """Row m of a [BLOCK_M, X] tile, as [1, X]."""
    if BLOCK_M == 1:
        return t
    rows = tl.arange(0, BLOCK_M)[:, None]
    return tl.sum(tl.where(rows == m, t, 0), axis=0)[None, :]


@triton.jit
def _pick3(t, m, BLOCK_M: tl.constexpr):
    """Row m of a [BLOCK_M, X, Y] tile, as [1, X, Y]."""
    if BLOCK_M == 1:
        return t
    rows = tl.arange(0, BLOCK_M)[:, None, None]
    return tl.sum(tl.where(rows == m, t, 0), axis=0)[None, :, :]


@triton.jit
def _group_table(acc, v, cols, group_size, NUM_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr):
    """acc[m, g] += sum of v[m, k] over the columns k of group g: [BLOCK_M, BLOCK_G]."""
    if NUM_GROUPS == 1:
        return acc + tl.sum(v, axis=1)[:, None]
    gcol = cols // group_size
    for g in tl.static_range(NUM_GROUPS):
        s_g = tl.sum(tl.where(gcol[None, :] == g, v, 0.0), axis=1)
        acc += tl.where(tl.arange(0, BLOCK_G)[None, :] == g, s_g[:, None], 0.0)
    return acc


@triton.jit
def _normalize(a, cols, rstd, wn, group_size, ROUND_FIRST: tl.constexpr,
               NUM_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """round(wn * (a * rstd of its group)), with the rounding of ``rms_norm`` / ``gated_rms_norm``;
    wn: the norm weight in fp32, [1, BLOCK_K]."""
    if NUM_GROUPS == 1:
        r = tl.sum(rstd, axis=1)[:, None]
    else:
        gcol = cols // group_size
        r = tl.zeros_like(a)
        for g in tl.static_range(NUM_GROUPS):
            r_g = tl.sum(tl.where(tl.arange(0, BLOCK_G)[None, :] == g, rstd, 0.0), axis=1)
            r = tl.where(gcol[None, :] == g, r_g[:, None], r)
    y = a * r
    if ROUND_FIRST:
        y = y.to(OUT_DTYPE).to(tl.float32)
    return (y * wn).to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _tile_row(
    m, w0, wn, z0, ks, x_ptr, z_ptr, row_ptr, K, eps, group_size, stride_x, stride_z,
    PROLOGUE: tl.constexpr, ROUND_FIRST: tl.constexpr, NUM_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
    HAS_ROW_IDX: tl.constexpr, BLOCK_M: tl.constexpr, EARLY: tl.constexpr, ACT_DTYPE: tl.constexpr,
):
    """The product of row m with the program's weight tile w0 ([BLOCK_N, BLOCK_K], the whole K)
    in fp32, as [1, BLOCK_N]; the input row's prologue on the way (wn: the norm weight, loaded),
    rounded to the activations' dtype as the unfused norm would."""
    row = m + tl.arange(0, 1)  # [1]
    row_ok = row >= 0
    if HAS_ROW_IDX:
        src = tl.load(row_ptr + row).to(tl.int64)
    else:
        src = row.to(tl.int64)
    z = z0  # the gate, for a gated prologue
    if PROLOGUE == 2:
        if EARLY:
            z = _pick(z0, m, BLOCK_M)
        else:
            z = _load_rows(z_ptr, src, row_ok, ks, ks < K, stride_z)
    a = _input_rows(x_ptr, z, src, row_ok, ks, ks < K, stride_x, PROLOGUE == 2)
    if PROLOGUE != 0:
        sq = _group_table(tl.zeros([1, BLOCK_G], dtype=tl.float32), a * a, ks, group_size, NUM_GROUPS, BLOCK_G)
        rstd = tl.rsqrt(sq / group_size + eps)
        a = _normalize(a, ks, rstd, wn, group_size, ROUND_FIRST, NUM_GROUPS, BLOCK_G, ACT_DTYPE)
    return tl.sum(w0.to(tl.float32) * a, axis=1)[None, :]


@triton.jit
def _block_scaled(w, s_ptr, n_blk, cols, col_ok, stride_s, SCALE_BLOCK: tl.constexpr):
    """An FP8 tile [BLOCK_N, BLOCK_K] times its block scales, in fp32 (n_blk: each row's block row)."""
    s = tl.load(s_ptr + n_blk[:, None] * stride_s + (cols // SCALE_BLOCK)[None, :], mask=col_ok[None, :], other=0.0)
    return w.to(tl.float32) * s


@triton.jit
def _add_products(acc, w, a, TILE_ROWS: tl.constexpr):
    """acc + w * a over a K tile: w [BLOCK_N, BLOCK_K], a the rows [BLOCK_M, BLOCK_K]. acc by
    TILE_ROWS: 0, [BLOCK_M, BLOCK_N, BLOCK_K]; 1, one row's [BLOCK_N, BLOCK_K]; 2, two rows'
    [BLOCK_N, BLOCK_K, 2], each thread holding both rows' sums of its weights. The 2-D and the
    joined tiles keep the weight in the layout its loads give it (16 contiguous bytes a thread),
    where the 3-D one's layout has shared memory hand each thread its FP8 values a byte a load."""
    if TILE_ROWS == 1:
        acc = acc + w * tl.reshape(a, (a.shape[1],))[None, :]
    elif TILE_ROWS == 2:
        a0, a1 = tl.split(tl.trans(a))
        acc = acc + tl.join(w * a0[None, :], w * a1[None, :])
    else:
        acc = acc + w[None, :, :] * a[:, None, :]
    return acc


@triton.jit
def _sums(acc, TILE_ROWS: tl.constexpr):
    """The sums of ``_add_products``' fp32 tiles over K: [BLOCK_M, BLOCK_N]."""
    if TILE_ROWS == 1:
        y = tl.sum(acc, axis=1)[None, :]
    elif TILE_ROWS == 2:
        s0, s1 = tl.split(acc)
        y = tl.trans(tl.join(tl.sum(s0, axis=1), tl.sum(s1, axis=1)))
    else:
        y = tl.sum(acc, axis=2)
    return y


def _tile_rows(M: int) -> int:
    """``_add_products``' TILE_ROWS for M streamed rows (``ONE_ROW_TILES``, ``TWO_ROW_TILES``)."""
    return 1 if M == 1 and ONE_ROW_TILES else 2 if M == 2 and TWO_ROW_TILES else 0


@triton.jit
def _stream_tile(acc, sq, w, k, ks, x_ptr, wn_ptr, src, row_ok, K, stride_x, s_ptr, n_blk, stride_s,
                 NORM: tl.constexpr, EVEN_K: tl.constexpr, NORM_WEIGHT: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                 TILE_ROWS: tl.constexpr):
    """One K tile of the streamed product, elementwise (reduced once after the loop): acc += w *
    input (times the norm weight, unless NORM_WEIGHT is off: a unit weight, folded into w), and
    with a norm sq += input^2. SCALE_BLOCK: w is FP8 with block scales, applied here."""
    cols = k + ks
    col_ok = cols < K
    if EVEN_K:
        col_ok = cols >= 0
    if SCALE_BLOCK > 0:
        w = _block_scaled(w, s_ptr, n_blk, cols, col_ok, stride_s, SCALE_BLOCK)
    a = _input_rows(x_ptr, src, src, row_ok, cols, col_ok, stride_x, False)  # [BLOCK_M, BLOCK_K]
    if NORM:
        sq += a * a
        if NORM_WEIGHT:
            a = a * tl.load(wn_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return _add_products(acc, w.to(tl.float32), a, TILE_ROWS), sq


@triton.jit
def _weight_tile(w_ptr, n64, n_ok, cols, K, stride_w, EVEN_K: tl.constexpr):
    """The program's weight rows over K columns ``cols``."""
    w_ptrs = w_ptr + n64[:, None] * stride_w + cols[None, :]
    if EVEN_K:
        return tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
    return tl.load(w_ptrs, mask=n_ok[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def _streamed_rows(
    w0, n64, n_ok, x_ptr, wn_ptr, w_ptr, row_ptr, M, K, eps, stride_x, stride_w, s_ptr, n_blk, stride_s,
    NORM: tl.constexpr, HAS_ROW_IDX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr, NORM_WEIGHT: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, TILE_ROWS: tl.constexpr = 0,
):
    """The product of all rows with the program's [BLOCK_N, K] weight slice in fp32, as
    [BLOCK_M, BLOCK_N], in one pass over K tiles (w0 is the first), each weight tile read once
    for all rows. An RMSNorm prologue is applied after the product: the input times the norm
    weight goes in unscaled, its squares come along, and each row is scaled by its rstd at the
    end. So there is no second pass over the input, and no rounding of the normalised input
    (which the one-tile path and the references keep). TILE_ROWS: the sums' tile
    (``_add_products``)."""
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    if HAS_ROW_IDX:
        src = tl.load(row_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    if TILE_ROWS == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif TILE_ROWS == 2:
        acc = tl.zeros([BLOCK_N, BLOCK_K, 2], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    acc, sq = _stream_tile(acc, sq, w0, 0, ks, x_ptr, wn_ptr, src, row_ok, K, stride_x, s_ptr, n_blk, stride_s,
                           NORM, EVEN_K, NORM_WEIGHT, SCALE_BLOCK, TILE_ROWS)
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        w = _weight_tile(w_ptr, n64, n_ok, k + ks, K, stride_w, EVEN_K)
        acc, sq = _stream_tile(acc, sq, w, k, ks, x_ptr, wn_ptr, src, row_ok, K, stride_x, s_ptr, n_blk, stride_s,
                               NORM, EVEN_K, NORM_WEIGHT, SCALE_BLOCK, TILE_ROWS)
    y = _sums(acc, TILE_ROWS)
    if NORM:
        y = y * tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]
    return y


@triton.jit
def _finish_row(
    m, acc, res, window, shifted, cw, slot, n, n_ok, c, c_ok, bias, conv_bias, rotating, cos, sin,
    out_ptr, cs_ptr, stride_out, stride_cs_s, stride_cs_d, stride_cs_k,
    EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, CONV_K: tl.constexpr, BLOCK_C: tl.constexpr,
    CONV_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, EARLY: tl.constexpr, ACT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr, ROPE: tl.constexpr,
):
    """Bias, rounding and epilogue of output row m (acc: its fp32 product, [1, BLOCK_N]), stored.
    The [BLOCK_M, ...] tiles, and the biases ([BLOCK_N] fp32), are what the kernel loaded before the
    wait: nothing here waits on memory."""
    row = m + tl.arange(0, 1)  # [1]
    row_ok = row >= 0
    if HAS_BIAS:
        acc += bias[None, :]
    y = acc.to(ACT_DTYPE).to(tl.float32)  # what F.linear would hand on
    out_mask = row_ok[:, None] & n_ok[None, :]
    out_ptrs = out_ptr + row.to(tl.int64)[:, None] * stride_out + n.to(tl.int64)[None, :]
    if EPILOGUE == 1:
        # residual <- residual + y, in the residual's dtype (the rows are the residual's rows)
        if EARLY:
            r = _pick(res, m, BLOCK_M)
        else:
            r = tl.load(out_ptrs, mask=out_mask, other=0.0)
        y += r.to(tl.float32)
    if EPILOGUE == 2:
        y = tl.maximum(y, 0.0)
        y = y * y
    if EPILOGUE == 3:
        # out = silu(w . [state taps, y] + b) on the conv columns; the state becomes window[1:]
        slot_m = _pick(slot[:, None], m, BLOCK_M)  # [1, 1]
        live = (slot_m >= 0) & c_ok[None, :]  # [1, BLOCK_N]
        taps = tl.arange(0, BLOCK_C)[None, None, :]
        new = y[:, :, None]
        win = tl.where(taps == CONV_K - 1, new, _pick3(window, m, BLOCK_M).to(tl.float32))
        conv = tl.sum(win * cw, axis=2)
        if CONV_BIAS:
            conv += conv_bias[None, :]
        conv = conv * tl.sigmoid(conv)
        y = tl.where(c_ok[None, :], tl.where(live, conv, 0.0), y)
        nxt = tl.where(taps == CONV_K - 2, new, _pick3(shifted, m, BLOCK_M).to(tl.float32))
        s_ptrs = (cs_ptr + tl.maximum(slot_m, 0).to(tl.int64)[:, :, None] * stride_cs_s
                  + c[None, :, None] * stride_cs_d + taps * stride_cs_k)
        tl.store(s_ptrs, nxt.to(cs_ptr.dtype.element_ty), mask=live[:, :, None] & (taps < CONV_K - 1))
    if ROPE:
        if rotating:  # one branch a program
            y = rope_pairs(y, _pick(cos, m, BLOCK_M), _pick(sin, m, BLOCK_M), BLOCK_N)
    if EPILOGUE == 4:  # the program's rows are gate and up pairs (``swiglu_rows``)
        h, col, col_ok = swiglu_pairs(y, n, n_ok, ACT_DTYPE, BLOCK_N)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + col, h.to(out_ptr.dtype.element_ty), mask=col_ok)
    else:
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _skinny_kernel(
    x_ptr, z_ptr, wn_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, row_ptr,
    cs_ptr, cw_ptr, cb_ptr, slot_ptr, inv_ptr, kvl_ptr,
    N, K, eps, group_size, conv_lo, conv_dim, rope_lo, rope_heads, head_dim, HALF,
    stride_x, stride_z, stride_w, stride_s, stride_out,
    stride_cs_s, stride_cs_d, stride_cs_k, stride_cw_d,
    PROLOGUE: tl.constexpr, ROUND_FIRST: tl.constexpr, NUM_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
    EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ROW_IDX: tl.constexpr,
    CONV_K: tl.constexpr, BLOCK_C: tl.constexpr, CONV_BIAS: tl.constexpr, ROPE: tl.constexpr,
    M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LOOP: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr, EARLY: tl.constexpr, USE_PDL: tl.constexpr,
    NORM_WEIGHT: tl.constexpr, SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr, ACT_DTYPE: tl.constexpr,
    TILE_ROWS: tl.constexpr,
):
    # SCALE: 0, w holds the weights; 1, FP8 values scaled per output column (s_ptr [N], applied to
    # the sums); 2, FP8 values scaled per SCALE_BLOCK x SCALE_BLOCK block (s_ptr [N / SCALE_BLOCK,
    # K / SCALE_BLOCK], applied tile by tile). ACT_DTYPE: the activations' dtype, what the
    # product is rounded to (the weights' own, unless they are FP8).
    # grid: (cdiv(N, BLOCK_N),): all M rows over BLOCK_N output columns. Without LOOP, the whole
    # K is one tile held in registers and the rows are taken one after the other in the tile's
    # layout (no cross-row shuffles); with LOOP, K is streamed in tiles.
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    if EPILOGUE == 4:  # SwiGLU: gate and up rows side by side
        n, n_ok = swiglu_rows(N, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rotating, cos, sin = n_ok, n_ok, n_ok  # stand-ins without ROPE (see below)
    if ROPE:  # rotation pairs side by side, and their angles (step metadata: before the wait)
        n, pairs, rotating = rope_rows(n, rope_lo, rope_heads, head_dim, HALF, BLOCK_N)
        cos = tl.zeros([BLOCK_M, BLOCK_N // 2], dtype=tl.float32)
        sin = cos
        if rotating:  # only these programs pay for the cos and sin
            pos = tl.load(kvl_ptr + rows, mask=row_ok, other=1) - 1
            inv = tl.load(inv_ptr + pairs, mask=pairs < HALF, other=0.0)
            angle = pos.to(tl.float32)[:, None] * inv[None, :]
            cos, sin = tl.cos(angle), tl.sin(angle)
    n64 = n.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    if not LOOP and x_ptr.dtype.element_ty == tl.float32:
        # 4-wide (16-byte) vectors, as the fp32 input rows load, for the bf16 tiles too: one
        # layout for every [.., BLOCK_K] tile, so the weight tile is never re-laid out (through
        # shared memory, after the wait) to meet the input row
        ks = tl.max_contiguous(ks, 4)

    # Before the wait, only what the previous kernel cannot be writing: the (first) weight tile;
    # with EARLY, z and the residual (written two or more kernels back, so complete: see the
    # module doc); the layer's conv state and weights (no other kernel touches them in a step).
    w0 = tl.load(w_ptr + n64[:, None] * stride_w + ks[None, :], mask=n_ok[:, None] & (ks[None, :] < K), other=0.0)
    n_blk, col_scale = n, n_ok
    if SCALE == 1:  # a weight: before the wait
        col_scale = tl.load(s_ptr + n, mask=n_ok, other=0.0)
    if SCALE == 2:
        n_blk = tl.minimum(n, N - 1) // SCALE_BLOCK
        if not LOOP:  # the one tile, dequantized once
            w0 = _block_scaled(w0, s_ptr, n_blk, ks, ks < K, stride_s, SCALE_BLOCK)
    # Stand-ins for the prefetched tiles a variant does not use (its constexpr branches never
    # read them); one name each, whatever the variant, keeps single helper signatures.
    z0, res, window, shifted, cw, wn = w0, w0, w0, w0, w0, w0
    slot, c, c_ok = rows, n, n_ok
    bias, conv_bias = n_ok, n_ok
    if HAS_BIAS:  # a weight: before the wait, not in the tail after the product
        bias = tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    if PROLOGUE != 0 and not LOOP:
        wn = tl.load(wn_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)[None, :]
    if EARLY:
        if PROLOGUE == 2 and not LOOP:
            z0 = _load_rows(z_ptr, rows.to(tl.int64), row_ok, ks, ks < K, stride_z)
        if EPILOGUE == 1:
            res = _load_rows(out_ptr, rows.to(tl.int64), row_ok, n64, n_ok, stride_out)
    if EPILOGUE == 3:
        # [BLOCK_M, BLOCK_N, BLOCK_C] windows of each row's slot: taps 0..K-2, and taps 1..K-2
        c = n - conv_lo
        c_ok = n_ok & (c >= 0) & (c < conv_dim)
        c = tl.where(c_ok, c, 0)
        slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
        live = row_ok[:, None] & (slot[:, None] >= 0) & c_ok[None, :]
        taps = tl.arange(0, BLOCK_C)[None, None, :]
        s_ptrs = (cs_ptr + tl.maximum(slot, 0).to(tl.int64)[:, None, None] * stride_cs_s
                  + c[None, :, None] * stride_cs_d + taps * stride_cs_k)
        window = tl.load(s_ptrs, mask=live[:, :, None] & (taps < CONV_K - 1), other=0.0)
        shifted = tl.load(s_ptrs + stride_cs_k, mask=live[:, :, None] & (taps < CONV_K - 2), other=0.0)
        cw = tl.load(cw_ptr + c[None, :, None] * stride_cw_d + taps, mask=c_ok[None, :, None] & (taps < CONV_K),
                     other=0.0).to(tl.float32)
        if CONV_BIAS:
            conv_bias = tl.load(cb_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        # the rows' state is written back per row below; threads holding copies of one element
        # must all have read it first
        tl.debug_barrier()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if not LOOP:
            tl.extra.cuda.gdc_launch_dependents()
    if LOOP:
        tl.static_assert(PROLOGUE != 2, "a gated norm runs as its own kernel before a streamed product")
        acc = _streamed_rows(
            w0, n64, n_ok, x_ptr, wn_ptr, w_ptr, row_ptr, M, K, eps, stride_x, stride_w, s_ptr, n_blk, stride_s,
            PROLOGUE == 1, HAS_ROW_IDX, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, STAGES, NORM_WEIGHT,
            SCALE_BLOCK, TILE_ROWS,
        )
        if USE_PDL:
            # several waves of programs: the dependents take slots only as the last one drains
            tl.extra.cuda.gdc_launch_dependents()
    for m in tl.static_range(M):
        if LOOP:
            acc_m = _pick(acc, m, BLOCK_M)
        else:
            acc_m = _tile_row(
                m, w0, wn, z0, ks, x_ptr, z_ptr, row_ptr, K, eps, group_size, stride_x, stride_z,
                PROLOGUE, ROUND_FIRST, NUM_GROUPS, BLOCK_G, HAS_ROW_IDX, BLOCK_M, EARLY, ACT_DTYPE,
            )
        if SCALE == 1:
            acc_m = acc_m * col_scale[None, :]
        _finish_row(
            m, acc_m, res, window, shifted, cw, slot, n, n_ok, c, c_ok, bias, conv_bias, rotating, cos, sin,
            out_ptr, cs_ptr, stride_out, stride_cs_s, stride_cs_d, stride_cs_k,
            EPILOGUE, HAS_BIAS, CONV_K, BLOCK_C, CONV_BIAS, BLOCK_M, EARLY, ACT_DTYPE, BLOCK_N, ROPE,
        )


@functools.cache
def hopper_or_newer(device: torch.device) -> bool:
    """A CUDA device of compute capability 9 or more (PDL, the TMA unit)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: Hopper or newer, and a Triton that can launch with it."""
    if not hopper_or_newer(device):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any stand-in will do
    return torch.cuda.get_device_properties(device).multi_processor_count


class _Config(NamedTuple):
    loop: bool  # stream K in tiles (else the whole K is one tile)
    block_n: int
    block_k: int
    num_warps: int
    stages: int  # software-pipelining depth of the K loop


def _config(M: int, N: int, K: int, device: torch.device, tile_k: int | None = None, fp8: bool = False) -> _Config:
    """Tile sizes for M rows of an [N, K] weight (FP8 values where ``fp8``), from sweeps of the
    decode projections (``mambastep bench tiles``, and before it throwaway scripts) kept where a
    whole step gained in an A/B (``mambastep bench ab``); the measurements are in
    docs/experiments.md. ``tile_k`` given: K streamed in tiles of that many columns whatever the
    shape (16 columns a program, 2 stages).

    - One tile (``_one_tile``), the program's whole weight slice in registers, loaded before the
      wait: K <= ONE_TILE_MAX_K and a grid of a few waves at most (Mamba2-130M's projections); or
      one row through K <= 1024 (its LM head too); or one bf16 row through any grid short of
      vocabulary-wide (Granite-4.0-H-micro's in_proj and up_proj at K = 2048: 10.6 and 18.8 us
      against 12.1 and 21.0 streamed).
    - Otherwise K streams in tiles, 4 warps a program: by rows, ``_one_row_tiles``,
      ``_two_row_tiles`` and, for more rows and for vocabulary-wide grids (LM heads, 16 columns a
      program), ``_rows_tiles``.
    """
    if tile_k is not None:
        return _Config(True, 16, tile_k, 4, 2)
    sms = _num_sms(device)
    vocabulary_wide = triton.cdiv(N, 16) >= 16 * sms
    one_row_tile = M == 1 and (K <= 1024 or not (vocabulary_wide or fp8))
    if K <= ONE_TILE_MAX_K and (triton.cdiv(N, 16) <= 4 * sms or one_row_tile):
        return _one_tile(M, N, K, sms)
    if not vocabulary_wide:
        # tall: a block's widest projection (Nemotron-H-8B's in_proj and up_proj); many: a grid of
        # more than 8 programs an SM at 8 columns a program
        tall, many = N >= 4 * K and K >= 4096, triton.cdiv(N, 8) > 8 * sms
        config = (_one_row_tiles(N, K, fp8, sms, tall, many) if M == 1 else
                  _two_row_tiles(K, fp8, tall, many) if M == 2 and TWO_ROW_TILES else None)
        if config is not None:
            return config
    return _rows_tiles(M, K, fp8, 16 if vocabulary_wide else 8)


def _one_tile(M: int, N: int, K: int, sms: int) -> _Config:
    """K in one register tile. Up to 1024 columns, one warp a program, so that the row's norm and
    the product reduce within the warp (no shared memory, no barriers): 2 columns a program at one
    row while that is about a wave of resident programs (in_proj), else 4 (each thread holds
    64-128 weights). Wider (the gated out_proj, whose prologue works through two 1536-wide rows,
    better spread over warps): 8 columns, 4 warps at one row, 8 at more. Chosen by sweeps in the
    whole Mamba2-130M decode step."""
    block_k = triton.next_power_of_2(K)
    if block_k <= 1024:
        return _Config(False, 2 if M == 1 and triton.cdiv(N, 2) <= 16 * sms else 4, block_k, 1, 1)
    return _Config(False, 8, block_k, 4 if M == 1 else 8, 1)


def _one_row_tiles(N: int, K: int, fp8: bool, sms: int, tall: bool, many: bool) -> _Config:
    """One row streamed, short of vocabulary-wide.

    - Tall, K whole 1024-column tiles: bf16 16 x 1024 in 2 stages (they lose at two rows and at
      the 9B-v2's ragged K = 4480); FP8 8 x 1024 in 4 stages (the 8B's in_proj 28.0 us against
      29.7 in 16 x 512; its step 3.396 ms against 3.411, H100).
    - FP8 from K = 2048, short of many programs: 8 x 1024 in 3 stages (the 8B's out_proj and
      down_proj, Nemotron-3-Nano's shared expert: 3-9% faster, H200).
    - bf16 over many programs, K whole 1024-column tiles: 8 x 1024 in 2 stages (Falcon-H1-7B's
      in_proj 20.3 us against 22.7, its up_proj with SwiGLU 52.0 against 54.5; whole steps -2.4%
      on Falcon-H1-7B, -2.1% on Bamba-9B, H100).
    - A short grid, at most two programs an SM at 8 columns (Granite-4.0-H's out_proj and
      down_proj, N = 1536-2048): 4 x 512 in 4 stages, twice the programs (micro's down_proj 11.0
      us against 12.3, out_proj 6.9 against 7.7).
    - Else 512-column K tiles from K = 3072 (256 below) in 3 stages, 16 columns a program over
      many programs (Nemotron-3-Nano's in_proj, the 9B-v2's in_proj and up_proj: a program's
      loads of the row and the norm weight serve twice the columns), else 8."""
    whole_kilo = K % 1024 == 0
    if tall and whole_kilo:
        return _Config(True, 8, 1024, 4, 4) if fp8 else _Config(True, 16, 1024, 4, 2)
    if fp8 and K >= 2048 and not many:
        return _Config(True, 8, 1024, 4, 3)
    if not fp8 and many and whole_kilo:
        return _Config(True, 8, 1024, 4, 2)
    if triton.cdiv(N, 8) <= 2 * sms:
        return _Config(True, 4, 512, 4, 4)
    return _Config(True, 16 if many else 8, 512 if K >= 3072 else 256, 4, 3)


def _two_row_tiles(K: int, fp8: bool, tall: bool, many: bool) -> _Config | None:
    """Two rows summed in the joined tile (``TWO_ROW_TILES``), short of vocabulary-wide; None: as
    more rows (``_rows_tiles``). Swept on an H100 (``bench tiles --batch 2``), in 4 stages:

    - FP8, tall or over many programs: 16 x 512, and 32 x 256 from K = 4096 where K is whole
      1024-column tiles (the 8B's in_proj and up_proj: its step 3.849 ms against 3.956 in 16 x
      512; Nano's in_proj, K = 2688, gained alone in 32 x 128 and lost 0.5% in the step); other
      FP8 shapes 8 x 512 (Nano's whole FP8 step 2.905 ms against 3.162 with the rows' rule).
    - bf16, tall over whole 1024-column K tiles: 8 x 1024 (the 8B's in_proj 53.1 us against
      56.1); over many programs below K = 4096: 32 x 128 (Nano's in_proj 20.9 against 26.2,
      Falcon-H1-7B's in_proj and up_proj). Whole steps: the 8B 5.565 ms against 5.653, Nano 3.776
      against 3.796, Falcon-H1-7B 5.959 against 6.013. Other bf16 shapes as more rows."""
    whole_kilo = K % 1024 == 0
    if fp8:
        wide = tall or many
        if wide and K >= 4096 and whole_kilo:
            return _Config(True, 32, 256, 4, 4)
        return _Config(True, 16 if wide else 8, 512, 4, 4)
    if tall and whole_kilo:
        return _Config(True, 8, 1024, 4, 4)
    if many and K < 4096:
        return _Config(True, 32, 128, 4, 4)
    return None


def _rows_tiles(M: int, K: int, fp8: bool, block_n: int) -> _Config:
    """More rows, and every vocabulary-wide grid, in ``block_n`` columns a program; the tile
    narrows in K as the rows grow, so that the per-row partial sums keep their register
    footprint. bf16: 1024 / rows columns of K from K = 4096 (512 / rows below) in 4 stages; the
    best tiles of the H100 sweep (``bench tiles --batch``, 2-8 rows through the 8B's
    projections) kept about that much K whatever the rows, and half of it in 3 stages lost up to
    1.6x on a projection at 8 rows (the 8B's fused step at 4 rows 6.61 ms against 7.12). FP8
    (and one vocabulary-wide row, from K = 3072): half of that, in 3 stages."""
    rows = triton.next_power_of_2(M)
    block_k = (512 if K >= 4096 or (M == 1 and K >= 3072) else 256) // rows
    if fp8 or M == 1:
        return _Config(True, block_n, max(32, block_k), 4, 3)
    return _Config(True, block_n, max(32, 2 * block_k), 4, 4)


def streams(rows: int, weight, tile_k: int | None = None) -> bool:
    """Whether ``rows`` rows through ``weight`` ([N, K], or an ``Fp8Weight``) stream K in tiles,
    rather than hold a program's whole K in one register tile (``_config``)."""
    N, K = weight.shape
    return _config(rows, N, K, weight.device, tile_k, fp8=isinstance(weight, Fp8Weight)).loop


def _check(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous, got strides {tuple(t.stride())}")


def _check_weight(weight, K: int) -> None:
    if isinstance(weight, Fp8Weight):
        _check_fp8(weight)
        weight = weight.values
    if weight.dim() != 2 or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"weight: expected [N, {K}] with contiguous rows, got {list(weight.shape)} "
                         f"with strides {tuple(weight.stride())}")


def _check_fp8(weight: Fp8Weight) -> None:
    N, K = weight.shape
    expected = (N,) if not weight.block else (-(-N // weight.block), -(-K // weight.block))
    if weight.values.dtype != torch.float8_e4m3fn or weight.scale.dtype != torch.float32:
        raise ValueError(f"weight: FP8 values in float8_e4m3fn with fp32 scales, got {weight.values.dtype} and "
                         f"{weight.scale.dtype}")
    if tuple(weight.scale.shape) != expected or weight.scale.stride(-1) != 1:
        raise ValueError(f"weight.scale: expected a contiguous {list(expected)}, got {list(weight.scale.shape)}")


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _act_dtype(weight, x: torch.Tensor, norm_w: torch.Tensor | None) -> torch.dtype:
    """The activations' dtype, which the product is rounded to: a plain weight's own; beside FP8
    weights, the normed input's (the norm weight's dtype) or else the input's."""
    if not isinstance(weight, Fp8Weight):
        return weight.dtype
    return norm_w.dtype if norm_w is not None else x.dtype


def _launch(x, z, norm_w, weight, bias, out, rows: _Rows, *, eps, group_size, prologue, round_first,
            epilogue, conv: ConvTail | None, pdl: bool, act_dtype: torch.dtype, early: bool = False,
            tile_k: int | None = None, unit_norm: bool = False, rope: RopeTail | None = None):
    scale, scale_mode, scale_block = None, 0, 0
    if isinstance(weight, Fp8Weight):
        weight, scale, scale_block = weight.values, weight.scale, weight.block
        scale_mode = 2 if scale_block else 1
    M, (N, K) = rows.n, weight.shape
    if M > MAX_ROWS:
        raise ValueError(f"{M} rows: the skinny projection takes at most {MAX_ROWS}; use a GEMM")
    if M == 0:
        return out
    cfg = _config(M, N, K, weight.device, tile_k, fp8=scale is not None)
    if conv is None:  # any valid pointers: the constexpr epilogue never reads them
        cs, cw, cb, slots, lo, D, conv_k = out, weight, weight, out, 0, 0, 2
        ss_s = ss_d = ss_k = scw = 0
    else:
        (D, conv_k), (ss_s, ss_d, ss_k), scw = conv.weight.shape, conv.state.stride(), conv.weight.stride(0)
        cs, cw, slots, lo = conv.state, conv.weight, conv.slots, conv.lo
        cb = conv.bias if conv.bias is not None else conv.weight
    inv, kvl, rope_lo, rope_heads, head_dim, half = weight, weight, 0, 0, 1, 1
    if rope is not None:
        inv, kvl, rope_lo, head_dim, half = rope.inv_freq, rope.kv_lens, rope.lo, rope.head_dim, rope.inv_freq.shape[0]
        rope_heads = rope.q_heads + rope.k_heads
    groups = K // group_size
    extra = {"launch_pdl": True} if pdl else {}
    _skinny_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, z if z is not None else x, norm_w if norm_w is not None else weight, weight,
        scale if scale is not None else weight, bias if bias is not None else weight, out,
        rows.idx if rows.idx is not None else x,
        cs, cw, cb, slots, inv, kvl,
        N, K, eps, group_size, lo, D, rope_lo, rope_heads, head_dim, half,
        x.stride(0), z.stride(0) if z is not None else 0, weight.stride(0),
        scale.stride(0) if scale is not None else 0, out.stride(0),
        ss_s, ss_d, ss_k, scw,
        PROLOGUE=prologue, ROUND_FIRST=round_first, NUM_GROUPS=groups, BLOCK_G=triton.next_power_of_2(groups),
        EPILOGUE=epilogue, HAS_BIAS=bias is not None, HAS_ROW_IDX=rows.idx is not None,
        CONV_K=conv_k, BLOCK_C=triton.next_power_of_2(conv_k), CONV_BIAS=conv is not None and conv.bias is not None,
        ROPE=rope is not None, M=M, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        LOOP=cfg.loop,
        EVEN_K=K % cfg.block_k == 0, STAGES=cfg.stages, EARLY=early, USE_PDL=pdl, num_warps=cfg.num_warps,
        NORM_WEIGHT=not unit_norm, SCALE=scale_mode, SCALE_BLOCK=scale_block, ACT_DTYPE=_TL_DTYPES[act_dtype],
        TILE_ROWS=_tile_rows(M), **extra,
    )
    return out


def _epilogue(residual, relu2, conv, swiglu=False) -> int:
    if (residual is not None) + bool(relu2) + (conv is not None) + bool(swiglu) > 1:
        raise ValueError("pick one epilogue: residual, relu2, swiglu or conv")
    if residual is not None:
        return _EPI_RESIDUAL
    if relu2:
        return _EPI_RELU2
    if swiglu:
        return _EPI_SWIGLU
    return _EPI_CONV if conv is not None else _EPI_STORE


def _check_rope(rope: RopeTail, rows: int, N: int, epilogue: int, row_idx) -> None:
    end = rope.lo + (rope.q_heads + rope.k_heads) * rope.head_dim
    half = rope.inv_freq.shape[0]
    if epilogue not in (_EPI_STORE, _EPI_CONV) or row_idx is not None:
        raise ValueError("rope: an epilogue of the stored product (or the conv's), over all rows")
    if end > N or 2 * half > rope.head_dim or rope.inv_freq.dtype != torch.float32:
        raise ValueError(f"rope: heads over columns [{rope.lo}, {end}) of {N}, inv_freq [R / 2] fp32 with R <= "
                         f"{rope.head_dim}; got {list(rope.inv_freq.shape)} {rope.inv_freq.dtype}")
    _check("rope.kv_lens", rope.kv_lens, (rows,))


def _rope_fits(rope: RopeTail, block_n: int) -> bool:
    """Whether the kernel's column blocks tile the rotated dims (``rope_rows``): else the rope
    kernel runs after the product."""
    return all(v % block_n == 0 for v in (rope.lo, rope.head_dim, 2 * rope.inv_freq.shape[0]))


def _rope_views(y: torch.Tensor, rope: RopeTail):
    """The query and key heads of a QKV projection's output: [T, q_heads, Dh], [T, k_heads, Dh]."""
    q_end = rope.lo + rope.q_heads * rope.head_dim
    k_end = q_end + rope.k_heads * rope.head_dim
    T = y.shape[0]
    return (y[:, rope.lo : q_end].view(T, rope.q_heads, rope.head_dim),
            y[:, q_end:k_end].view(T, rope.k_heads, rope.head_dim))


def _out_rows(x, rows, out, residual, N, dtype):
    """(row spec, destination): rows computed, and where they go."""
    spec = _Rows(x.shape[0] if rows is None else rows.shape[0], rows)
    if residual is not None:
        if rows is not None:
            raise ValueError("a residual epilogue adds into the residual's own rows: no row indices")
        _check("residual", residual, (spec.n, N))
        return spec, residual
    if out is None:
        out = torch.empty(spec.n, N, dtype=dtype, device=x.device)
    _check("out", out, (spec.n, N))
    return spec, out


def _linear_ref(h, weight, bias, act_dtype):
    w = weight.dequantize() if isinstance(weight, Fp8Weight) else weight.float()
    y = F.linear(h.float(), w, None if bias is None else bias.float())
    return y.to(act_dtype)


def _epilogue_ref(y, residual, relu2, conv, out, swiglu=False):
    if residual is not None:
        residual.copy_((residual.float() + y.float()).to(residual.dtype))
        return residual
    if relu2:
        y = torch.relu(y.float()).square().to(y.dtype)
    if swiglu:
        y = silu_mul_ref(y)
    if conv is not None:
        D = conv.weight.shape[0]
        xbc = y[:, conv.lo: conv.lo + D]
        conv1d_update_ref(xbc.clone(), conv.state, conv.weight, conv.bias, conv.slots, out=xbc)
    if out is None:
        return y
    return out.copy_(y)


def norm_linear_ref(x, norm_w, eps, weight, *, bias=None, round_first=True, rows=None, residual=None,
                    relu2=False, swiglu=False, conv=None, rope=None, out=None, pdl=False, tile_k=None, early=False,
                    unit_norm=False):
    """The unfused composition: :func:`rms_norm_ref`, a rounded fp32 product, the epilogue, the rotation."""
    epi = _epilogue(residual, relu2, conv, swiglu)
    src = x if rows is None else x.index_select(0, rows.long())
    if rope is not None:
        _check_rope(rope, src.shape[0], weight.shape[0], epi, rows)
    act = _act_dtype(weight, x, norm_w)
    h = src
    if norm_w is not None:
        h = torch.empty(src.shape, dtype=act, device=src.device)
        rms_norm_ref(src, norm_w, eps, out=h, round_first=round_first)
    y = _epilogue_ref(_linear_ref(h, weight, bias, act), residual, relu2, conv, out, swiglu)
    if rope is not None:
        rotary.rope_ref(*_rope_views(y, rope), rope.inv_freq, None, rope.kv_lens)
    return y


@with_reference(norm_linear_ref)
def norm_linear(x, norm_w, eps, weight, *, bias=None, round_first=True, rows=None, residual=None,
                relu2=False, swiglu=False, conv=None, rope=None, out=None, pdl=False, tile_k=None, early=False,
                unit_norm=False):
    """``epilogue(rms_norm(x[rows]) @ weight.T + bias)`` for at most ``MAX_ROWS`` rows.

    x:        [T, K] activations (bf16, or the fp32 residual stream); row-strided views allowed
    norm_w:   [K] RMSNorm weight, or None for no norm; eps, round_first as in ``rms_norm``
    weight:   [N, K], rows contiguous; or an ``Fp8Weight`` (its values streamed and scaled in
              registers, the product rounded to the activations' dtype); bias: [N] or None
    rows:     [R] int row indices of x to use (logit rows), or None for all T rows
    epilogue, at most one of:
      residual: [T, N] updated in place to residual + y (its dtype); nothing else is written
      relu2:    y = relu(y)^2
      swiglu:   weight is [2I, K], the gate's I rows then the up's: y = silu(gate) * up, [R, I]
                (each rounded as HF's ops, as ``kernels.activation.silu_mul``; in the epilogue where
                K streams, else ``silu_mul`` launched after the product)
      conv:     ConvTail: the conv1d decode update on columns [conv.lo, conv.lo + D)
    rope:     RopeTail: the query and key heads rotated (beside a stored product or conv; in the
              epilogue where the kernel's column blocks tile the rotated dims, else the rope
              kernel launched after the product)
    out:      [R, N] (any float dtype; the product is rounded to weight's dtype first, or beside
              FP8 weights to norm_w's, else x's)
    pdl:      launch as a programmatic dependent of the previous kernel (CUDA, sm_90+)
    tile_k:   stream K in tiles of this many columns whatever the shape (None: by the table)
    early:    the residual was written two or more kernels back in this stream, so a programmatic
              dependent launch may read it before its wait, not in its tail
    unit_norm: norm_w is all ones (the model folded the norm's weight into ``weight``,
              ``Model``'s ``fold_norms``): the streamed path does not read or multiply it

    CUDA tensors run the Triton kernel (capturable, no host sync); CPU tensors the reference.
    """
    T, K = x.shape
    _check("x", x, (T, K))
    _check_weight(weight, K)
    if conv is not None:
        _check("conv.slots", conv.slots, (T if rows is None else rows.shape[0],))
    epi = _epilogue(residual, relu2, conv, swiglu)
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"swiglu: the weight's rows are [gate | up], an even count; got {weight.shape[0]}")
    act = _act_dtype(weight, x, norm_w)
    N = weight.shape[0]
    spec, dst = _out_rows(x, rows, out, residual, N // (2 if swiglu else 1), act)
    product = dict(eps=eps, group_size=K, prologue=_PRO_NONE if norm_w is None else _PRO_RMS, round_first=round_first,
                   conv=conv, pdl=pdl, act_dtype=act, early=early, tile_k=tile_k,
                   unit_norm=unit_norm and norm_w is not None)
    if rope is not None:
        _check_rope(rope, spec.n, N, epi, rows)
        if not _rope_fits(rope, _config(spec.n, N, K, x.device, tile_k, fp8=isinstance(weight, Fp8Weight)).block_n):
            _launch(x, None, norm_w, weight, bias, dst, spec, epilogue=epi, **product)
            rotary.rope(*_rope_views(dst, rope), rope.inv_freq, None, rope.kv_lens, pdl=pdl)
            return dst
    if swiglu and not _config(spec.n, N, K, x.device, tile_k, fp8=isinstance(weight, Fp8Weight)).loop:
        # K in one register tile: SwiGLU a launch of its own after the product. In the epilogue
        # it cost Granite-4.0-H-micro's one-row decode step 9.7% on the H200 (its up_proj takes
        # one tile there); where K streams it saves about 1% (docs/experiments.md).
        gate_up = torch.empty(spec.n, N, dtype=act, device=x.device)
        _launch(x, None, norm_w, weight, bias, gate_up, spec, epilogue=_EPI_STORE, **product)
        return silu_mul(gate_up, out=dst, pdl=pdl)
    return _launch(x, None, norm_w, weight, bias, dst, spec, epilogue=epi, rope=rope, **product)


def gated_norm_linear_ref(y, z, norm_w, group_size, eps, weight, *, bias=None, residual=None, out=None,
                          pdl=False, early=False, tile_k=None):
    """The unfused composition: :func:`gated_rms_norm_ref`, a rounded fp32 product, the residual add."""
    h = gated_rms_norm_ref(y, z, norm_w, group_size, eps)
    return _epilogue_ref(_linear_ref(h, weight, bias, _act_dtype(weight, y, None)), residual, False, None, out)


@with_reference(gated_norm_linear_ref)
def gated_norm_linear(y, z, norm_w, group_size, eps, weight, *, bias=None, residual=None, out=None, pdl=False,
                      early=False, tile_k=None):
    """``gated_rms_norm(y, z) @ weight.T + bias``, added into ``residual`` in place when given.

    y, z: [T, K] (row-strided views allowed), T <= MAX_ROWS; norm_w: [K]; group_size divides K;
    weight: [N, K] or an ``Fp8Weight`` (as in :func:`norm_linear`; the product rounded to y's
    dtype); residual: [T, N] (fp32 or the activations' dtype) or None, then out: [T, N].
    pdl: as in :func:`norm_linear`; early: z and the residual were written two or more kernels
    back in this stream, so a programmatic dependent launch may read them before its wait (in a
    Mamba2 block: z by in_proj, the residual by the previous block). Where the product streams K
    (see the module doc), the gated norm runs first as a kernel of its own. tile_k: as in
    :func:`norm_linear`.
    """
    T, K = y.shape
    _check("y", y, (T, K))
    _check("z", z, (T, K))
    _check_weight(weight, K)
    if K % group_size:
        raise ValueError(f"group_size {group_size} does not divide {K}")
    act = _act_dtype(weight, y, None)
    spec, dst = _out_rows(y, None, out, residual, weight.shape[0], act)
    if streams(T, weight, tile_k):
        # A streamed product would recompute the grouped norm tile by tile, which costs more
        # than a kernel of its own (measured on Nemotron-H-8B's out_proj)
        h = gated_rms_norm(y, z, norm_w, group_size, eps, pdl=pdl)
        return _launch(h, None, None, weight, bias, dst, spec, eps=eps, group_size=K, prologue=_PRO_NONE,
                       round_first=True, epilogue=_epilogue(residual, False, None), conv=None, pdl=pdl,
                       act_dtype=act, tile_k=tile_k)
    return _launch(y, z, norm_w, weight, bias, dst, spec, eps=eps, group_size=group_size,
                   prologue=_PRO_GATED, round_first=True, epilogue=_epilogue(residual, False, None),
                   conv=None, pdl=pdl, act_dtype=act, early=early, tile_k=tile_k)
