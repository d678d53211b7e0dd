"""Mixture of experts at the cost of the experts a step routes to: the (token, expert) pairs
sorted by expert, two grouped GEMMs over those pairs only, and a weighted combine.

Static shapes throughout, so a step is captured once per bucket and replays with no host sync:

1. Routing (``kernels.moe_route``): each token's k experts, in ascending order, and weights;
   per block of tokens, its pairs per expert (``block_counts``).
2. ``moe_experts`` (align): the pairs per expert are counted, each expert's run padded to the
   GEMM tile height ``block_m`` and every pair given its slot, tokens in order within an expert
   (one program for a narrow decode step's few pairs; for more, parallel programs over the
   routing's block counts, or a counting pass and those programs).
   Buffers are sized by the bucket: P = tokens x k pairs take at most P + min(E, P) x
   (block_m - 1) slots, whatever the routing. Up to ``PAIR_TILES_MAX`` pairs (a decode step of
   a few rows) nothing is aligned: each pair is a tile of its own, or, for FP8 experts (up to
   ``PAIR_STREAM_MAX``), a matrix-vector product streaming K on CUDA cores (a tile's 16 rows
   would be mostly padding, and with half the bytes the tiles' latency, not the weight read, set
   their time; SwiGLU's activation then rides in the up projection's kernel).
3. Grouped GEMMs: a program per (block of columns, tile of slots), columns fastest, finds its
   tile's expert from the device counts and exits when the tile lies past the last expert's
   run, so the grid is fixed by the bucket and only routed experts' weights are read; on Hopper
   the TMA unit copies the tiles. A last column block narrower than a tile takes tiles of its
   own width in the same launch. Up projection with relu2 (each rounded to the activations'
   dtype, as HF's two ops; a run's padding rows written as zeros), or SwiGLU's kernel after it,
   then down projection.
4. Combine: a token's k rows weighted and summed in fp32 in expert order, rounded, plus the
   shared expert's output, optionally added into the residual stream (for streamed pairs, in the
   down projections' own kernel, which streams a token's k experts one after the other). No
   atomics anywhere, so a step is deterministic run to run.

``moe_experts_ref`` is the dense math every test compares against: every expert over every
token, weighted by the token's routing weight (zero where not chosen).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import decode_linear
from .activation import relu2_ref, silu_mul, silu_mul_ref
from .decode_linear import _block_scaled, _streamed_rows, hopper_or_newer, swiglu_pairs, swiglu_rows
from .dispatch import with_reference
from .fp8 import Fp8Weight, quantize_rows, quantize_rows_ref
from .moe_route import ROUTE_BLOCK_T, _check_block_counts

__all__ = ["ACTIVATIONS", "W8A8_MIN_BLOCK", "block_m", "moe_experts", "moe_experts_ref", "quantizes_rows", "slot_count",
           "takes_w8a8"]


def block_m(tokens: int, top_k: int, n_experts: int) -> int:
    """The grouped GEMMs' tile height for a bucket of ``tokens``: about the mean pairs per expert
    (16 at decode sizes, up to 128 for long prefill chunks), so padding stays a fraction of a
    tile. Past 64 pairs an expert, 128-row tiles pad a run no more than two of 64 do (a run of
    65-128 takes 128 slots either way) and read each weight tile once for twice the rows."""
    mean = tokens * top_k / n_experts
    return 16 if mean <= 16 else 32 if mean <= 48 else 64 if mean <= 64 else 128


def slot_count(tokens: int, top_k: int, n_experts: int, bm: int) -> int:
    """Slots the sorted pairs may take: P pairs, each used expert's run padded to ``bm``."""
    pairs = tokens * top_k
    return pairs + min(n_experts, pairs) * (bm - 1)


@triton.jit
def _one_hot(e, cols):
    """[pairs, experts] int32: 1 where a pair's expert is the column's."""
    return (e[:, None] == cols[None, :]).to(tl.int32)


@triton.jit
def _padded(counts, BM: tl.constexpr):
    """Each expert's run rounded up to whole tiles of BM slots."""
    return (counts + BM - 1) // BM * BM


@triton.jit
def _slots(hit, base):
    """The slot of each pair of a block: its expert's next free slot ``base[e]`` plus its rank
    among the block's pairs of that expert (pairs in order)."""
    return tl.sum(hit * (tl.cumsum(hit, axis=0) - 1 + base[None, :]), axis=1)


@triton.jit
def _count_span(idx_ptr, lo, hi, P, cols, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pairs per expert among pairs [lo, hi)."""
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for p0 in range(lo, hi, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        e = tl.load(idx_ptr + ps, mask=ps < P, other=BLOCK_E)
        counts += tl.sum(_one_hot(e, cols), axis=0)
    return counts


@triton.jit
def _assign_span(idx_ptr, slot_of_pair_ptr, token_of_slot_ptr, lo, hi, P, base, cols, TOP_K: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """The slots of pairs [lo, hi), in order, from each expert's next free slot ``base``."""
    for p0 in range(lo, hi, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        ok = ps < P
        e = tl.load(idx_ptr + ps, mask=ok, other=BLOCK_E)
        hit = _one_hot(e, cols)
        slot = _slots(hit, base)
        tl.store(slot_of_pair_ptr + ps, slot, mask=ok)
        tl.store(token_of_slot_ptr + slot, ps // TOP_K, mask=ok)
        base += tl.sum(hit, axis=0)


@triton.jit
def _align_kernel(idx_ptr, slot_of_pair_ptr, token_of_slot_ptr, starts_ptr, counts_ptr, P, E,
                  TOP_K: tl.constexpr, BM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                  USE_PDL: tl.constexpr):
    """One program: pairs per expert, each expert's run padded to BM, and every pair's slot
    (pairs in order within an expert, so the layout is a function of the routing alone)."""
    if USE_PDL:  # the routing is the previous kernel's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.arange(0, BLOCK_E)
    counts = _count_span(idx_ptr, 0, P, P, cols, BLOCK_P, BLOCK_E)
    padded = _padded(counts, BM)
    starts = tl.cumsum(padded, axis=0) - padded
    tl.store(starts_ptr + cols, starts, mask=cols < E)
    tl.store(starts_ptr + E, tl.sum(padded, axis=0))  # the end of the last run
    tl.store(counts_ptr + cols, counts, mask=cols < E)
    _assign_span(idx_ptr, slot_of_pair_ptr, token_of_slot_ptr, 0, P, P, starts, cols, TOP_K, BLOCK_P, BLOCK_E)


@triton.jit
def _count_kernel(idx_ptr, block_counts_ptr, P, E, SPAN, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    """Many programs, for many pairs: the pairs per expert among block b's SPAN pairs,
    block_counts[b, e]."""
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    counts = _count_span(idx_ptr, b * SPAN, tl.minimum(b * SPAN + SPAN, P), P, cols, BLOCK_P, BLOCK_E)
    tl.store(block_counts_ptr + b * E + cols, counts, mask=cols < E)


@triton.jit
def _assign_kernel(idx_ptr, block_counts_ptr, slot_of_pair_ptr, token_of_slot_ptr, starts_ptr, counts_ptr,
                   P, E, SPAN, NB, TOP_K: tl.constexpr, BM: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr):
    """Many programs: the slots of counted block b's SPAN pairs (the layout ``_align_kernel``
    makes). Each program sums the NB blocks' counts itself (the pairs per expert, and those of
    the blocks before its own), so no pass between the two waits on one program."""
    if USE_PDL:  # the counts are the previous kernel's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    counts = tl.zeros((BLOCK_E,), tl.int32)
    before = tl.zeros((BLOCK_E,), tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B)
        c = tl.load(block_counts_ptr + bs[:, None] * E + cols[None, :], mask=(bs < NB)[:, None] & col_ok[None, :],
                    other=0)
        counts += tl.sum(c, axis=0)
        before += tl.sum(tl.where((bs < b)[:, None], c, 0), axis=0)
    padded = _padded(counts, BM)
    starts = tl.cumsum(padded, axis=0) - padded
    if b == 0:
        tl.store(starts_ptr + cols, starts, mask=col_ok)
        tl.store(starts_ptr + E, tl.sum(padded, axis=0))  # the end of the last run
        tl.store(counts_ptr + cols, counts, mask=col_ok)
    _assign_span(idx_ptr, slot_of_pair_ptr, token_of_slot_ptr, b * SPAN, tl.minimum(b * SPAN + SPAN, P), P,
                 starts + before, cols, TOP_K, BLOCK_P, BLOCK_E)


# pairs up to which one program aligns them (a decode step's), beyond which two passes do
ALIGN_ONE_PROGRAM = 1024
# the same where the routing counted its blocks of tokens (``block_counts``): past it the assigning
# pass alone makes the layout, a program a block of ROUTE_BLOCK_T tokens. One program at 1024
# pairs took 16.8 us a layer at 64 rows; past 96, decode 64 1.3% faster (Nemotron-3-Nano FP8)
# and 1.8% (Granite-4.0-H-Tiny bf16), 32 rows 0.6%, 4-16 rows within noise; the assigning pass
# at every size lost 1.2-1.6% at 4-8 rows (H100, tools/bench_ab, logits equal)
ALIGN_COUNTED_ONE_PROGRAM = 96
# blocks the two passes split the pairs into, at most (each assigning program sums every
# block's counts: more blocks, more programs, but more reading each)
ALIGN_BLOCKS = 64
# block counts an assigning program loads at a time (its rows x E): each program sums every
# block's, so its loop is a chain of L2 round trips; at 128 blocks of 128 experts, 8192 a load
# (two loads) took 9.4 us alone, 4096 (four) 11.0, 16384 over 8 warps 11.3
ASSIGN_COUNT_TILE = 8192
# pairs up to which each is a GEMM tile of its own and nothing is aligned (a decode step of a few
# rows: its pairs have distinct experts or nearly, so the sorted layout would save few weight
# reads, and its alignment pass is a launch on the step's critical path). 48 against 12 (bf16,
# H100, bench ab): Nano decode 4 -3.1%, decode 8 -1.4%, verify 1 x (1 + 4) -1.6%;
# Granite-4.0-H-Tiny decode 4 -7.4%, decode 8 -5.2%; 96 ties at decode 16
PAIR_TILES_MAX = 48
# FP8 experts' pairs (up to PAIR_STREAM_MAX; past it, the sorted layout, W8A8 where asked) stream
# K as matrix-vector products on CUDA cores:
# the up projections (``_pair_up_kernel``) in tiles of 16 columns x 256, 4 stages (Nemotron-3-
# Nano's six experts at one token 27.6 us against 37.7 in pair tiles, at two tokens 47.7 against
# 55.1, up, down and combine each streamed so; H200, swept over 8-64 columns x 128-1024). bf16
# relu2 experts keep the pair tiles: the stream's best there, 36.6 against 35.6 us
# (docs/experiments.md), and so do bf16 SwiGLU ones (Granite-4.0-H-Tiny's decode step 1.3% slower
# streamed at one row, 9.2% at two, for all the two launches it saves).
PAIR_STREAM_MAX = 12
PAIR_UP_BLOCK_N, PAIR_UP_BLOCK_K, PAIR_UP_STAGES = 16, 256, 4
# and the down projections with the combine (``_pair_down_kernel``), (columns a program, K
# tile, stages) for one token and for more: Nano's at one token 14.4 us against 15.4 for a down
# kernel as the up one and the combine, at two 21.6 against 25.2 (H200; 4-16 columns x 256-1024)
PAIR_DOWN_ONE_TOKEN, PAIR_DOWN_TOKENS = (8, 1024, 3), (16, 512, 3)


def _align(idx, E: int, bm: int, S: int, pdl: bool = False, block_counts=None):
    """(slot_of_pair [P], token_of_slot [S], starts [E + 1], counts [E]) on the device (starts[E]: the
    end of the last run, the slots in use; the rest of token_of_slot is left unwritten): one program
    for a decode step's few pairs, two parallel passes (count, assign) for a prefill chunk's
    many, the first skipped where the routing counted its blocks (``block_counts``, from
    ``moe_route``). All make the same layout. ``pdl``: the one program, or the assigning pass
    after the routing's counts, launches as a programmatic dependent."""
    P, k, dev = idx.numel(), idx.shape[1], idx.device
    slot_of_pair = torch.empty(P, dtype=torch.int32, device=dev)
    token_of_slot = torch.empty(S, dtype=torch.int32, device=dev)
    starts = torch.empty(E + 1, dtype=torch.int32, device=dev)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    block_e = max(16, triton.next_power_of_2(E))
    block_p = max(16, min(256, 8192 // block_e))
    if P <= (ALIGN_ONE_PROGRAM if block_counts is None else ALIGN_COUNTED_ONE_PROGRAM):
        _align_kernel[(1,)](idx, slot_of_pair, token_of_slot, starts, counts, P, E, TOP_K=k, BM=bm,
                            BLOCK_P=block_p, BLOCK_E=block_e, USE_PDL=pdl, num_warps=8,
                            **({"launch_pdl": True} if pdl else {}))
        return slot_of_pair, token_of_slot, starts, counts
    if block_counts is None:
        span = max(block_p, triton.next_power_of_2(triton.cdiv(P, ALIGN_BLOCKS)))
        nb = triton.cdiv(P, span)
        block_counts = torch.empty(nb, E, dtype=torch.int32, device=dev)
        _count_kernel[(nb,)](idx, block_counts, P, E, span, BLOCK_P=block_p, BLOCK_E=block_e, num_warps=4)
        extra = {}
    else:  # the routing's blocks of ROUTE_BLOCK_T tokens, one a program (each program sums every
        # block's counts, so programs of 2, 4 and 8 blocks lost: 13.7, 22.0 and 38.6 against 11.0 us)
        nb, span = block_counts.shape[0], ROUTE_BLOCK_T * k
        extra = {"launch_pdl": True} if pdl else {}
    _assign_kernel[(nb,)](
        idx, block_counts, slot_of_pair, token_of_slot, starts, counts, P, E, span, nb, TOP_K=k, BM=bm,
        BLOCK_P=block_p, BLOCK_B=max(16, ASSIGN_COUNT_TILE // block_e), BLOCK_E=block_e, USE_PDL=bool(extra),
        num_warps=4, **extra)
    return slot_of_pair, token_of_slot, starts, counts


@triton.jit
def _tile_product(a_ptr, src, ok, slots, e, w_ptr, out_ptr, n0, N, K, stride_a, stride_we, stride_wn, stride_out,
                  s_ptr, stride_se, stride_sn,
                  RELU2: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, USE_PDL: tl.constexpr, A_TMA: tl.constexpr = False, W_TMA: tl.constexpr = False,
                  ZERO_PAD: tl.constexpr = False, SCALE: tl.constexpr = 0, SCALE_BLOCK: tl.constexpr = 0,
                  as_ptr=None, A_SCALED: tl.constexpr = False):
    """out[slots] = a[src] @ w[e].T over the BN columns from n0 for the rows ``ok`` of a tile;
    relu2 after, when RELU2. With USE_PDL it signals its dependents after its K loop (several
    waves at prefill sizes: they take SM slots as the last one drains).

    SCALE: 0, w holds the weights; 1, FP8 values with a scale per expert and column (s_ptr [E,
    N]), applied to the sums; 2, FP8 values with SCALE_BLOCK x SCALE_BLOCK block scales (s_ptr [E,
    N / SCALE_BLOCK, K / SCALE_BLOCK]; BK divides SCALE_BLOCK), applied to each K tile's product.
    FP8 values enter the tensor cores in a's dtype (exactly: e4m3 fits in bf16). A_SCALED: a
    holds FP8 values too, row r's scale at as_ptr[r] (quantized per row: W8A8), so both enter
    the FP8 tensor cores as stored and the sums are scaled by row and column.

    W_TMA: w_ptr is a tensor descriptor of the weights [E, N, K] in [1, BN, BK] blocks (its
    tiles copied by the TMA unit, the columns past N zeros); A_TMA: a_ptr is one of a [rows, K]
    in [BM, BK] blocks and the tile's rows are src[0] onwards, in order. ZERO_PAD: every slot of
    the tile is the run's, and its rows not ``ok`` (the run's padding) are stored as zeros: the
    up projection's, so that the down projection's tensor cores multiply zeros there rather than
    stale bytes (less power: a prefill chunk's step runs at the H200's power cap)."""
    ns = n0 + tl.arange(0, BN)
    n_ok = ns < N
    if not A_TMA:
        a_rows = a_ptr + src[:, None].to(tl.int64) * stride_a
    else:
        row0 = tl.min(src, axis=0)  # src[0]: the rows are in order
    if not W_TMA:
        w_rows = w_ptr + e.to(tl.int64) * stride_we + ns[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BM, BN), tl.float32)
    if SCALE > 0:
        s_rows = s_ptr + e.to(tl.int64) * stride_se
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        if A_TMA:  # rows past the tile's run are another run's or padding: their products are not stored
            a = a_ptr.load([row0, k0])
        else:
            a = tl.load(a_rows + ks[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        if W_TMA:
            w = w_ptr.load([e, n0, k0]).reshape(BN, BK)
        else:
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SCALE == 2:
            s = tl.load(s_rows + (ns // SCALE_BLOCK) * stride_sn + k0 // SCALE_BLOCK, mask=n_ok, other=0.0)
            acc += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=PRECISION) * s[None, :]
        else:
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PRECISION)
    if SCALE == 1:
        acc *= tl.load(s_rows + ns, mask=n_ok, other=0.0)[None, :]
    if A_SCALED:
        acc *= tl.load(as_ptr + src, mask=ok, other=0.0)[:, None]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = acc.to(out_ptr.dtype.element_ty)
    if RELU2:
        y = tl.maximum(y.to(tl.float32), 0.0)
        y = (y * y).to(out_ptr.dtype.element_ty)
    out = out_ptr + slots[:, None].to(tl.int64) * stride_out + ns[None, :]
    if ZERO_PAD:
        tl.store(out, tl.where(ok[:, None], y, 0.0), mask=n_ok[None, :])
    else:
        tl.store(out, y, mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _grouped_kernel(a_ptr, token_ptr, w_ptr, w_last_ptr, out_ptr, starts_ptr, counts_ptr, N, K, E,
                    stride_a, stride_we, stride_wn, stride_out, s_ptr, stride_se, stride_sn,
                    GATHER: tl.constexpr, RELU2: tl.constexpr, PRECISION: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
                    USE_PDL: tl.constexpr, A_TMA: tl.constexpr, W_TMA: tl.constexpr, ZERO_PAD: tl.constexpr,
                    BN_LAST: tl.constexpr, SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr, as_ptr,
                    A_SCALED: tl.constexpr):
    """The sorted layout: out[slot] = a[row] @ w[expert].T for a tile of BM slots of one
    expert's run (row: the slot's token when GATHER, else the slot itself; A_TMA and W_TMA as
    ``_tile_product``). The grid is (column blocks, tiles), columns fastest: the programs running
    together share their tiles' rows of a, read once from HBM (a prefill chunk's h, a down
    projection's input, is larger than L2), and every weight tile is read once whatever the order.

    BN_LAST (0: none): the last column block, narrower than a tile, is a tile that wide, from
    w_last_ptr (W_TMA: a descriptor in [1, BN_LAST, BK] blocks), so its tensor cores do not
    multiply the zero columns past N. A_SCALED (as_ptr) as ``_tile_product``'s: a's row scales,
    by the rows it is indexed by (tokens when GATHER)."""
    if USE_PDL:  # the layout and a are the kernels' before
        tl.extra.cuda.gdc_wait()
    slot0 = tl.program_id(1) * BM
    cols = tl.arange(0, BLOCK_E)
    starts = tl.load(starts_ptr + cols, mask=cols < E, other=0)
    counts = tl.load(counts_ptr + cols, mask=cols < E, other=0)
    ends = tl.where(cols < E, starts + _padded(counts, BM), 1 << 30)
    e = tl.sum((ends <= slot0).to(tl.int32), axis=0)  # runs are in expert order; empty ones are skipped
    if e < E:
        start = tl.sum(tl.where(cols == e, starts, 0), axis=0)
        count = tl.sum(tl.where(cols == e, counts, 0), axis=0)
        slots = slot0 + tl.arange(0, BM)
        ok = slots - start < count
        src = tl.load(token_ptr + slots, mask=ok, other=0) if GATHER else slots
        n0 = tl.program_id(0) * BN
        if BN_LAST > 0 and n0 + BN > N:  # constexpr first: without a narrow block, no such branch
            _tile_product(a_ptr, src, ok, slots, e, w_last_ptr, out_ptr, n0, N, K, stride_a, stride_we, stride_wn,
                          stride_out, s_ptr, stride_se, stride_sn, RELU2, PRECISION, BM, BN_LAST, BK, USE_PDL,
                          A_TMA, W_TMA, ZERO_PAD, SCALE, SCALE_BLOCK, as_ptr, A_SCALED)
        else:
            _tile_product(a_ptr, src, ok, slots, e, w_ptr, out_ptr, n0, N, K, stride_a, stride_we, stride_wn,
                          stride_out, s_ptr, stride_se, stride_sn, RELU2, PRECISION, BM, BN, BK, USE_PDL,
                          A_TMA, W_TMA, ZERO_PAD, SCALE, SCALE_BLOCK, as_ptr, A_SCALED)


@triton.jit
def _pair_kernel(a_ptr, idx_ptr, w_ptr, out_ptr, N, K, stride_a, stride_we, stride_wn, stride_out,
                 s_ptr, stride_se, stride_sn,
                 GATHER: tl.constexpr, TOP_K: tl.constexpr, RELU2: tl.constexpr, PRECISION: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_PDL: tl.constexpr, W_TMA: tl.constexpr,
                 SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """A few pairs, each a tile of its own (no alignment pass): out[p] = a[row] @ w[idx[p]].T
    for pair p (row: its token p // TOP_K when GATHER, else p), the tile's other rows masked.
    W_TMA as ``_tile_product``'s."""
    if USE_PDL:  # the routing and a are the kernels' before
        tl.extra.cuda.gdc_wait()
    p = tl.program_id(0)
    e = tl.load(idx_ptr + p)
    slots = p + tl.arange(0, BM)
    ok = tl.arange(0, BM) == 0
    src = slots // TOP_K if GATHER else slots
    _tile_product(a_ptr, src, ok, slots, e, w_ptr, out_ptr, tl.program_id(1) * BN, N, K, stride_a, stride_we,
                  stride_wn, stride_out, s_ptr, stride_se, stride_sn, RELU2, PRECISION, BM, BN, BK, USE_PDL,
                  W_TMA=W_TMA, SCALE=SCALE, SCALE_BLOCK=SCALE_BLOCK)


@triton.jit
def _pair_up_kernel(a_ptr, idx_ptr, w_ptr, out_ptr, N, K, stride_a, stride_we, stride_wn, stride_out,
                    s_ptr, stride_se, stride_sn,
                    TOP_K: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr, SCALE: tl.constexpr,
                    SCALE_BLOCK: tl.constexpr, TILE_ROWS: tl.constexpr):
    """Pair p's up projection as a matrix-vector product on CUDA cores (its expert e = idx[p] the
    routing's, the previous kernel's: read after the wait): out[p, cols] = act(a[p // TOP_K] @
    w[e, cols].T) over BLOCK_N weight rows (program axis 0), K streamed in
    pipelined tiles as the skinny projections stream theirs (``decode_linear._streamed_rows``),
    each weight element read once. A 16-row tensor-core tile for one row would be mostly
    padding; here every SM streams a share of the six experts' weights. SCALE as
    ``_tile_product``'s; TILE_ROWS as ``_streamed_rows``'. ACT: 0 none, 1 relu2, 2 SwiGLU over w = [gate |
    up] (N = 2I rows): the program's rows are BLOCK_N / 2 output columns' gate and up rows side by
    side, and it stores silu(gate) * up."""
    p = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    e = tl.load(idx_ptr + p).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    if ACT == 2:
        n, n_ok = swiglu_rows(N, BLOCK_N)
    n64 = n.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    w_e = w_ptr + e * stride_we
    w0 = tl.load(w_e + n64[:, None] * stride_wn + ks[None, :], mask=n_ok[:, None] & (ks[None, :] < K), other=0.0)
    s_e = s_ptr + e * stride_se
    n_blk = n
    if SCALE == 2:
        n_blk = tl.minimum(n, N - 1) // SCALE_BLOCK
    acc = _streamed_rows(w0, n64, n_ok, a_ptr + (p // TOP_K).to(tl.int64) * stride_a, a_ptr, w_e, a_ptr, 1, K,
                         0.0, 0, stride_wn, s_e, n_blk, stride_sn, False, False, 1, BLOCK_N, BLOCK_K, EVEN_K, STAGES,
                         False, SCALE_BLOCK if SCALE == 2 else 0, TILE_ROWS)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if SCALE == 1:
        acc *= tl.load(s_e + n, mask=n_ok, other=0.0)[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    if ACT == 1:
        y = tl.maximum(y.to(tl.float32), 0.0)
        y = (y * y).to(out_ptr.dtype.element_ty)
    if ACT == 2:  # as ``silu_mul``: silu(gate) rounded, times up
        h, col, col_ok = swiglu_pairs(y, n64, n_ok, out_ptr.dtype.element_ty, BLOCK_N)
        tl.store(out_ptr + p * stride_out + col, h.to(out_ptr.dtype.element_ty), mask=col_ok)
    else:
        tl.store(out_ptr + p * stride_out + n64[None, :], y, mask=n_ok[None, :])


@triton.jit
def _pair_down_kernel(h_ptr, idx_ptr, wt_ptr, w_ptr, shared_ptr, out_ptr, N, K, stride_h, stride_we, stride_wn,
                      stride_shared, stride_out, s_ptr, stride_se, stride_sn,
                      TOP_K: tl.constexpr, BLOCK_J: tl.constexpr, SHARED: tl.constexpr, ACCUMULATE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr,
                      SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """A token's down projections and their weighted sum in one pass (program axis 1 the token,
    axis 0 BLOCK_N output columns): out[t] (+)= round(sum_j wt[t, j] * round(h[t * TOP_K + j] @
    down[idx[t, j]].T)) (+ shared[t]), rounding as ``_combine_kernel``. The token's TOP_K
    experts' K are one stream of TOP_K x K, pipelined across the experts' boundaries, where
    each expert's sum is finished (scaled, rounded, weighted) and its accumulator cleared: a
    program streams six experts' columns, not one, and no combine launch follows. SCALE as
    ``_tile_product``'s (FP8 values)."""
    t = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n64 = n.to(tl.int64)
    n_blk = tl.minimum(n, N - 1) // SCALE_BLOCK if SCALE == 2 else n
    ks = tl.arange(0, BLOCK_K)
    js = tl.arange(0, BLOCK_J)
    # the routing is two or more launches back, so complete (``kernels.decode_linear``)
    es = tl.load(idx_ptr + t * TOP_K + js, mask=js < TOP_K, other=0).to(tl.int64)
    if USE_PDL:  # h is the previous kernel's
        tl.extra.cuda.gdc_wait()
    tiles = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    total = tl.zeros((BLOCK_N,), tl.float32)
    for i in tl.range(0, TOP_K * tiles, num_stages=STAGES):
        j = i // tiles
        k0 = (i - j * tiles) * BLOCK_K
        e = tl.sum(tl.where(js == j, es, 0), axis=0)
        cols = k0 + ks
        col_ok = cols < K
        w = tl.load(w_ptr + e * stride_we + n64[:, None] * stride_wn + cols[None, :],
                    mask=n_ok[:, None] & col_ok[None, :], other=0.0)
        a = tl.load(h_ptr + (t * TOP_K + j).to(tl.int64) * stride_h + cols, mask=col_ok, other=0.0).to(tl.float32)
        if SCALE == 2:
            w = _block_scaled(w, s_ptr + e * stride_se, n_blk, cols, col_ok, stride_sn, SCALE_BLOCK)
        acc += w.to(tl.float32) * a[None, :]
        if k0 + BLOCK_K >= K:  # expert j's last tile: its sum, as the down projection hands it on
            y = tl.sum(acc, axis=1)
            if SCALE == 1:
                y *= tl.load(s_ptr + e * stride_se + n, mask=n_ok, other=0.0)
            y = y.to(h_ptr.dtype.element_ty).to(tl.float32)
            total += tl.load(wt_ptr + t * TOP_K + j) * y
            acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dtype = h_ptr.dtype.element_ty
    r = total.to(dtype)
    if SHARED:
        r = (r.to(tl.float32) + tl.load(shared_ptr + t * stride_shared + n, mask=n_ok, other=0.0).to(tl.float32)
             ).to(dtype)
    out = out_ptr + t * stride_out + n64
    if ACCUMULATE:
        r = tl.load(out, mask=n_ok, other=0.0).to(tl.float32) + r.to(tl.float32)
    tl.store(out, r.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _combine_kernel(y_ptr, slot_ptr, w_ptr, shared_ptr, out_ptr, D, stride_y, stride_shared, stride_out,
                    TOP_K: tl.constexpr, SHARED: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_D: tl.constexpr,
                    PAIRS: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t] (+)= round(sum_j w[t, j] * y[slot[t, j]]) (+ shared[t]), rounding as HF's ops;
    PAIRS: y holds pair p in row p (no slot table)."""
    if USE_PDL:  # y is the previous kernel's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = ds < D
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for j in tl.static_range(TOP_K):
        slot = (t * TOP_K + j) if PAIRS else tl.load(slot_ptr + t * TOP_K + j).to(tl.int64)
        acc += tl.load(w_ptr + t * TOP_K + j) * tl.load(y_ptr + slot * stride_y + ds, mask=ok, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    r = acc.to(dtype)
    if SHARED:
        shared = tl.load(shared_ptr + t * stride_shared + ds, mask=ok, other=0.0).to(tl.float32)
        r = (r.to(tl.float32) + shared).to(dtype)
    out = out_ptr + t * stride_out + ds
    if ACCUMULATE:
        r = (tl.load(out, mask=ok, other=0.0).to(tl.float32) + r.to(tl.float32))
    tl.store(out, r.to(out_ptr.dtype.element_ty), mask=ok)


def _finish_ref(r, shared, residual, out):
    if shared is not None:
        r = r + shared
    if residual is not None:
        return residual.copy_((residual.float() + r.float()).to(residual.dtype))
    return r if out is None else out.copy_(r)


def _expert(weight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's weight, an FP8 one dequantized to ``dtype``."""
    return weight.expert(e).dequantize(dtype) if isinstance(weight, Fp8Weight) else weight[e]


# the experts' activations: what follows the up projection (SwiGLU's halves the width)
ACTIVATIONS = ("relu2", "swiglu")


def moe_experts_ref(x, idx, w, up, down, *, shared=None, residual=None, out=None, shared_ready=None,
                    block_counts=None, pdl=False, act="relu2", w8a8=False, x_rows=None):
    """The dense math: every expert over every token, weighted by its routing weight (zero where
    the token did not choose it), summed in fp32 in expert order. ``w8a8`` (FP8 experts): past a
    few pairs the token rows, and each pair's activations, rounded to FP8 per row first, as the
    kernels do (``x_rows``, x so quantized already, which only spares the kernels a launch, unread)."""
    T, E = x.shape[0], up.shape[0]
    activation = relu2_ref if act == "relu2" else silu_mul_ref
    dense = torch.zeros(T, E, dtype=torch.float32, device=x.device).scatter_(1, idx.long(), w.float())
    acc = torch.zeros(T, down.shape[1], dtype=torch.float32, device=x.device)
    if _quantizes_rows(w8a8, x, up, down, idx.shape[1]):  # in fp32 over FP8-rounded rows, rounded after
        def product(a, weight, e):
            q, scale = quantize_rows_ref(a)
            return F.linear(q.float() * scale, _expert(weight, e, torch.float32)).to(x.dtype)
    else:
        def product(a, weight, e):
            return F.linear(a, _expert(weight, e, x.dtype))
    for e in range(E):
        h = activation(product(x, up, e))
        acc += product(h, down, e).float() * dense[:, e : e + 1]
    return _finish_ref(acc.to(x.dtype), shared, residual, out)


@with_reference(moe_experts_ref)
def moe_experts(x, idx, w, up, down, *, shared=None, residual=None, out=None, shared_ready=None, block_counts=None,
                pdl=False, act="relu2", w8a8=False, x_rows=None):
    """sum_j w[t, j] * down_e(act(up_e(x[t]))) over each token's experts e = idx[t, j], over the
    routed pairs only.

    x [T, K] (the activations' dtype), idx [T, k] int32 and w [T, k] fp32 from ``moe_route``,
    act: "relu2", up [E, I, K]; or "swiglu", up [E, 2I, K] (the gate's I rows, then the up's:
    silu(gate) * up, in the pair stream's up kernel, else a kernel of its own after the up
    projection, ``kernels.activation``);
    down [E, D, I], plain or ``Fp8Weight`` (their values streamed, entering the
    tensor cores in x's dtype, and scaled per column or block in the kernel). The routed sum is
    rounded to x's dtype; then ``shared`` [T, D] (the shared expert's output) is added, and the
    result is written to ``out`` [T, D], or added into ``residual`` [T, D] in place. Returns what
    it wrote.

    block_counts: the routing's pairs per expert in blocks of tokens (``moe_route``'s), so
    the alignment does not count them again.
    shared_ready: a CUDA event recorded once ``shared`` is written on another stream (the shared
    expert computed beside the routed ones); the combine waits for it, nothing before it does.
    pdl: the kernels launch as programmatic dependents of the previous one (``kernels.decode_linear``),
    the combine too when it also waits for ``shared_ready``.
    w8a8: with FP8 experts and bf16/fp16 x (``takes_w8a8``; refused otherwise), past the pairs (the sorted
    layout: prefill chunks and wide decode steps), each product's input rows are quantized per
    row (``quantize_rows``, a launch each) and enter the FP8 tensor cores as the weights do,
    rather than the weights being widened to x's dtype inside the K loop
    (``moe_experts_ref(..., w8a8=True)`` rounds as it does). Off unless asked for; the model
    asks (``MoEMixer.w8a8``). x_rows: x quantized per row (``quantize_rows(x)``, ``Fp8Rows``)
    by the kernel that made x, read in place of quantizing x again where w8a8 runs, else unread.
    """
    T, K = x.shape
    w8a8 = _quantizes_rows(w8a8, x, up, down, idx.shape[1])
    (up, up_scale), (down, down_scale) = _values_and_scales(up), _values_and_scales(down)
    if act not in ACTIVATIONS:
        raise ValueError(f"moe_experts: act must be one of {ACTIVATIONS}, got {act!r}")
    swiglu = act == "swiglu"
    E, up_n, _ = up.shape
    I = up_n // 2 if swiglu else up_n
    D = down.shape[1]
    k = idx.shape[1]
    if (up.shape[2] != K or down.shape != (E, D, I) or (swiglu and up_n % 2) or idx.shape != (T, k)
            or w.shape != (T, k)):
        raise ValueError(f"moe_experts: x [T, K], idx and w [T, k], up [E, I, K], down [E, D, I]; got {list(x.shape)}, "
                         f"{list(idx.shape)}, {list(w.shape)}, {list(up.shape)}, {list(down.shape)}")
    if not (x.is_contiguous() and up.is_contiguous() and down.is_contiguous() and idx.is_contiguous()
            and w.is_contiguous()):
        raise ValueError("moe_experts: x, idx, w and the expert weights must be contiguous")
    if residual is None and out is None:
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    target = residual if residual is not None else out
    if target.shape != (T, D) or target.stride(1) != 1 or (shared is not None and shared.shape != (T, D)):
        raise ValueError(f"moe_experts: out, residual and shared must be [{T}, {D}]")
    _check_block_counts("moe_experts", block_counts, T, E)
    if x_rows is not None:
        x_rows.check("moe_experts: x_rows", T, K)
    dev = x.device
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    extra = {"launch_pdl": True} if pdl else {}
    pairs = T * k <= (PAIR_STREAM_MAX if up_scale is not None else PAIR_TILES_MAX)
    if pairs and up_scale is not None:  # FP8 experts' pairs stream
        return _stream_pairs(x, idx, w, (up, up_scale), (down, down_scale), target, swiglu=swiglu, shared=shared,
                             shared_ready=shared_ready, accumulate=residual is not None, pdl=pdl)
    if pairs:  # each pair a tile of its own, row p of h and y pair p's (no slot table)
        bm, S = 16, T * k
        slot_of_pair = idx  # any valid pointer: the combine does not read it
    else:
        bm = block_m(T, k, E)
        S = slot_count(T, k, E, bm)
        slot_of_pair, token_of_slot, starts, counts = _align(idx, E, bm, S, pdl, block_counts)
        block_e = max(16, triton.next_power_of_2(E))
    gate_up = torch.empty(S, up_n, dtype=x.dtype, device=dev) if swiglu else None
    h = torch.empty(S, I, dtype=x.dtype, device=dev)
    y = torch.empty(S, D, dtype=x.dtype, device=dev)
    # up (gathering each slot's token row, relu2 after, or SwiGLU's kernel), then down; the TMA
    # unit copies the weight tiles (and, in the sorted layout, the down projection's input tiles,
    # whose rows are a tile's slots in order), where it can
    for a, weight, scales, result, up_proj in ((x, up, up_scale, h if gate_up is None else gate_up, True),
                                               (h, down, down_scale, y, False)):
        if not up_proj and gate_up is not None:  # padding slots' rows are zeros, and silu(0) * 0 = 0
            silu_mul(gate_up, out=h, pdl=pdl)
        a_scale = None
        if w8a8:  # the rows as FP8 values and a scale each (the padding slots' zero rows: zeros;
            # the down projection's input past the last run, which no tile reads, left alone)
            if up_proj and x_rows is not None:
                a, a_scale = x_rows
            else:
                a, a_scale = quantize_rows(a, row_end=None if up_proj or pairs else starts[E:])
        n, kk = weight.shape[1], weight.shape[2]
        scale, scale_block, mode = _scale_args(weight, scales)
        common = (a.stride(0), weight.stride(0), weight.stride(1), result.stride(0), scale, scale.stride(0),
                  scale.stride(1) if mode == 2 else 0)
        bn, bk, warps, stages = _gemm_config(bm, n, kk, x.dtype)
        if w8a8 and not scale_block:  # FP8 rows: a K tile twice as long is the same bytes
            bk *= 2
        elif w8a8 and bm == 128:  # block scales: the scaled dot's second accumulator spills at 128 x 256
            bn = 128
        if scale_block:  # one block scale a K tile
            bk = min(bk, scale_block)
        tma = _tma(weight) and (pairs or up_proj or _tma(a))
        w_arg = TensorDescriptor.from_tensor(weight, [1, bn, bk]) if tma else weight
        if pairs:
            _pair_kernel[(S, triton.cdiv(n, bn))](
                a, idx, w_arg, result, n, kk, *common, GATHER=up_proj, TOP_K=k, RELU2=up_proj and not swiglu,
                PRECISION=precision,
                BM=bm, BN=bn, BK=bk, USE_PDL=pdl, W_TMA=tma, SCALE=mode, SCALE_BLOCK=scale_block, num_warps=warps,
                num_stages=stages, **extra)
        else:
            bn_last = _last_block_width(bn, n)
            w_last = TensorDescriptor.from_tensor(weight, [1, bn_last, bk]) if tma and bn_last else w_arg
            a_arg = TensorDescriptor.from_tensor(a, [bm, bk]) if tma and not up_proj else a
            _grouped_kernel[(triton.cdiv(n, bn), triton.cdiv(S, bm))](
                a_arg, token_of_slot, w_arg, w_last, result, starts, counts, n, kk, E, *common, GATHER=up_proj,
                RELU2=up_proj and not swiglu, PRECISION=precision, BM=bm, BN=bn, BK=bk, BLOCK_E=block_e, USE_PDL=pdl,
                A_TMA=tma and not up_proj, W_TMA=tma, ZERO_PAD=up_proj, BN_LAST=bn_last, SCALE=mode,
                SCALE_BLOCK=scale_block, as_ptr=a_scale if w8a8 else a, A_SCALED=w8a8, num_warps=warps,
                num_stages=stages, **extra)
    _join(shared_ready, dev)
    block_d = min(1024, triton.next_power_of_2(D))
    _combine_kernel[(T, triton.cdiv(D, block_d))](
        y, slot_of_pair, w, shared if shared is not None else y, target, D, y.stride(0),
        shared.stride(0) if shared is not None else 0, target.stride(0),
        TOP_K=k, SHARED=shared is not None, ACCUMULATE=residual is not None, BLOCK_D=block_d, PAIRS=pairs,
        USE_PDL=pdl, num_warps=4, **extra)
    return target


def _join(shared_ready, device) -> None:
    """Before the combine: wait for the shared expert's stream. The combine still launches as a
    programmatic dependent: it may start as the routed down projection drains, and its wait
    returns only once the other stream's work has completed too (the join is a full dependency;
    a GPU test checks the order)."""
    if shared_ready is not None:
        torch.cuda.current_stream(device).wait_event(shared_ready)


def _stream_pairs(x, idx, w, up, down, target, *, swiglu: bool, shared, shared_ready, accumulate: bool, pdl: bool):
    """A token or two's pairs (up to ``PAIR_STREAM_MAX``) as matrix-vector products streaming K
    on CUDA cores: the up projections, relu2 or SwiGLU in their epilogue, into rows of h a pair
    each; then a token's down projections with the combine in one kernel, into target (added
    when ``accumulate``). up, down: (values, scales or None) as ``_values_and_scales`` gives them."""
    (up, up_scale), (down, down_scale) = up, down
    T, k = idx.shape
    n, K = up.shape[1], up.shape[2]
    D, I = down.shape[1], down.shape[2]
    h = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    extra = {"launch_pdl": True} if pdl else {}
    scale, block, mode = _scale_args(up, up_scale)
    bk = min(PAIR_UP_BLOCK_K, max(32, triton.next_power_of_2(K)))
    # each program streams one pair's row: the 2-D tile (``decode_linear.ONE_ROW_TILES``) at one
    # token, where the step measured it; at two it measured +1.1% (Nano FP8 decode 2, one run)
    _pair_up_kernel[(triton.cdiv(n, PAIR_UP_BLOCK_N), T * k)](
        x, idx, up, h, n, K, x.stride(0), up.stride(0), up.stride(1), h.stride(0), scale, scale.stride(0),
        scale.stride(1) if mode == 2 else 0, TOP_K=k, ACT=2 if swiglu else 1, BLOCK_N=PAIR_UP_BLOCK_N, BLOCK_K=bk,
        EVEN_K=K % bk == 0, STAGES=PAIR_UP_STAGES, USE_PDL=pdl, SCALE=mode, SCALE_BLOCK=block,
        TILE_ROWS=int(decode_linear.ONE_ROW_TILES and T == 1), num_warps=4, **extra)
    _join(shared_ready, x.device)
    scale, block, mode = _scale_args(down, down_scale)
    bn, bk, stages = PAIR_DOWN_ONE_TOKEN if T == 1 else PAIR_DOWN_TOKENS
    _pair_down_kernel[(triton.cdiv(D, bn), T)](
        h, idx, w, down, shared if shared is not None else h, target, D, I, h.stride(0), down.stride(0),
        down.stride(1), shared.stride(0) if shared is not None else 0, target.stride(0), scale, scale.stride(0),
        scale.stride(1) if mode == 2 else 0, TOP_K=k, BLOCK_J=triton.next_power_of_2(k), SHARED=shared is not None,
        ACCUMULATE=accumulate, BLOCK_N=bn, BLOCK_K=min(bk, max(32, triton.next_power_of_2(I))), STAGES=stages,
        USE_PDL=pdl, SCALE=mode, SCALE_BLOCK=block, num_warps=4, **extra)
    return target


# An FP8 tensor-core product takes K tiles of at least 32, and a block-scaled one a block a tile.
W8A8_MIN_BLOCK = 32


def takes_w8a8(x_dtype: torch.dtype, up, down) -> bool:
    """Whether ``moe_experts(..., w8a8=True)`` runs over these experts and activations: FP8
    experts, scaled per column or in blocks of at least ``W8A8_MIN_BLOCK`` along K, and bf16 or
    fp16 activations."""
    return (all(isinstance(t, Fp8Weight) and (t.block == 0 or t.block >= W8A8_MIN_BLOCK) for t in (up, down))
            and x_dtype in (torch.bfloat16, torch.float16))


def quantizes_rows(w8a8: bool, tokens: int, k: int) -> bool:
    """Whether ``moe_experts`` asked for ``w8a8`` (and taking it: ``takes_w8a8``) over ``tokens``
    tokens of ``k`` experts each quantizes its input rows: past the pairs."""
    return w8a8 and tokens * k > PAIR_STREAM_MAX


def _quantizes_rows(w8a8: bool, x: torch.Tensor, up, down, k: int) -> bool:
    """Whether ``moe_experts`` quantizes the activations per row (W8A8): where asked, past the
    pairs (``PAIR_STREAM_MAX``: a decode step of a few streams the weights as without). Asked where
    it does not run (``takes_w8a8``), it is refused by name."""
    if not w8a8:
        return False
    if not takes_w8a8(x.dtype, up, down):
        def named(t):
            return (f"FP8 in blocks of {t.block}" if t.block else "FP8") if isinstance(t, Fp8Weight) else str(t.dtype)
        raise ValueError(f"moe_experts: w8a8 needs FP8 experts (per column or in blocks of at least "
                         f"{W8A8_MIN_BLOCK}) and bf16 or fp16 activations, got {named(up)} up, {named(down)} down, "
                         f"{x.dtype} x")
    return quantizes_rows(True, x.shape[0], k)


def _values_and_scales(weight):
    """(values, None) for plain weights; (values, (scale, block)) for an ``Fp8Weight``."""
    if not isinstance(weight, Fp8Weight):
        return weight, None
    if weight.values.dtype != torch.float8_e4m3fn or not weight.scale.is_contiguous():
        raise ValueError("moe_experts: FP8 experts need float8_e4m3fn values and contiguous scales")
    return weight.values, (weight.scale, weight.block)


def _scale_args(values: torch.Tensor, scales) -> tuple[torch.Tensor, int, int]:
    """A product's scale arguments from ``_values_and_scales``' pair: (the scale tensor, or the
    values as a stand-in pointer the kernel does not read; the block, 0 for per-column scales or
    none; SCALE, as ``_tile_product`` takes it: 0 none, 1 per column, 2 per block)."""
    if scales is None:
        return values, 0, 0
    scale, block = scales
    return scale, block, 2 if block else 1


def _tma(t: torch.Tensor) -> bool:
    """Whether ``t``'s tiles can come through a TMA descriptor: a device with the unit (or the
    interpreter) and 16-byte aligned rows."""
    if t.is_cuda and not hopper_or_newer(t.device):
        return False
    return t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1])


def _gemm_config(bm: int, n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(block_n, block_k, warps, stages) for tiles of ``bm`` slots: at decode sizes a tile is a
    few rows against a weight slab (bandwidth-bound: narrow columns, long K tiles, deep
    pipelining); for prefill chunks, wider square-ish tiles. 128-slot tiles (past 64 pairs an
    expert: Nemotron-3-Nano's chunks of about 1400 tokens and more) take 256 columns in 4
    stages, one program an SM: at the H200's power cap, where a prefill chunk's step runs, they
    read each tile's rows of ``a`` half as often and beat 128 x 128 by 4-6% (docs/experiments.md)."""
    if dtype == torch.float32:
        return 32, 32, 4, 2
    if bm <= 16:
        return 64, 128, 4, 4
    if bm == 128:
        return 256, 64, 8, 4
    return 128, 64, 4 if bm == 32 else 8, 3


def _last_block_width(bn: int, n: int) -> int:
    """The tile width of the grouped kernel's last column block where tiles of ``bn`` do not
    divide ``n`` and a narrower power of two covers the rest (0: the last block is a whole tile).
    Nemotron-3-Nano at 128-slot tiles: its up projection's 1856 = 7 x 256 + 64 and down
    projection's 2688 = 10 x 256 + 128 end in 64- and 128-wide tiles. In the same launch, beside
    the rest, they read their tiles' rows of ``a`` from L2 while the rest's programs do
    (docs/experiments.md)."""
    rest = n % bn
    narrow = max(16, triton.next_power_of_2(rest))
    return narrow if rest and narrow < bn else 0
