"""Token sampling kernels: greedy, temperature, and top-k / top-p draws (Gumbel-max).

The torch ops of ``runtime/sampling.py`` take a full-vocabulary argmax with torch's reduction
(one block per row: ~16 µs for one row of 50k logits on an H200), derive each row's noise keys
in ~100 one-element kernels, and filter with some twenty full-vocabulary ops. Here:

1. ``_block_best_kernel``  per (row, vocabulary block): the block's largest raw logit and, when
                           drawing, its largest score ``logits / T + Gumbel(seed, position,
                           token)``, each with the lowest token id among ties
2. ``_row_pick_kernel``    per row: the best of its blocks; greedy rows (T = 0 or top_k = 1)
                           take the argmax, the others the draw
3. ``_filtered_draw_kernel`` per row of the logits / T ranked by a torch sort (descending, ties
                           by token id): the top-k prefix's softmax normaliser, then the walk down
                           the ranks while the mass above stays under top_p, keeping the best
                           score; stops where the nucleus ends

The hash is the torch path's, bit for bit (32-bit integer math, IEEE division by T), so the
greedy and sample modes pick the same token as the torch ops but where a float32 log differs
by an ulp at an exact tie. The filtered mode sums the nucleus mass in another order than
torch's softmax and cumsum, so a token whose mass above lies within float32 rounding of top_p
may fall on the other side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MUL1", "MUL2", "KEY_MUL", "KEY_OFF", "UNIFORM_BITS", "filtered_draw_triton", "sample_triton"]

# Multipliers of a low-bias xorshift-multiply 32-bit mixer (hash-prospector's search).
MUL1, MUL2 = 0x21F0AAAD, 0x735A2D97
# Distinct starting words for the two key chains (multiplier and offset), from the golden ratio
# and sqrt(2)'s fractional bits.
KEY_MUL, KEY_OFF = 0x9E3779B9, 0x6A09E667
# Uniforms keep 23 random bits: (2k + 1) / 2**24 for k < 2**23 is exact in float32 and lies in
# (0, 1), so neither log in the Gumbel transform can see 0 or 1.
UNIFORM_BITS = 23

_MUL1, _MUL2 = tl.constexpr(MUL1), tl.constexpr(MUL2)
_KEY_MUL, _KEY_OFF = tl.constexpr(KEY_MUL), tl.constexpr(KEY_OFF)
_DROP: tl.constexpr = tl.constexpr(32 - UNIFORM_BITS)
_UNIT: tl.constexpr = tl.constexpr(2.0**-UNIFORM_BITS)

BLOCK_V = 2048  # vocabulary entries per program: 25 programs a row for a 50k vocabulary


@triton.jit
def _mix32(x):
    # x: uint32; products wrap mod 2**32 as the torch path's masked int64 products do
    x ^= x >> 16
    x *= _MUL1
    x ^= x >> 15
    x *= _MUL2
    x ^= x >> 15
    return x


@triton.jit
def _row_keys(seed, position):
    """(mult, offset): two uint32 hash chains over the 32-bit halves of seed and position."""
    w0 = seed.to(tl.uint32)  # truncation keeps the low word, as ``& 0xFFFFFFFF`` does
    w1 = (seed >> 32).to(tl.uint32)
    w2 = position.to(tl.uint32)
    w3 = (position >> 32).to(tl.uint32)
    mult = _mix32(w0 ^ _KEY_MUL)
    offset = _mix32(w0 ^ _KEY_OFF)
    mult = _mix32(mult ^ w1)
    offset = _mix32(offset ^ w1)
    mult = _mix32(mult ^ w2)
    offset = _mix32(offset ^ w2)
    mult = _mix32(mult ^ w3)
    offset = _mix32(offset ^ w3)
    return mult | 1, offset


@triton.jit
def _gumbel(mult, offset, tokens):
    """-log(-log(u)) of the uniform keyed by (mult, offset) for each token id (uint32)."""
    bits = _mix32(tokens * mult + offset) >> _DROP
    u = (bits.to(tl.float32) + 0.5) * _UNIT
    return -tl.log(-tl.log(u))


@triton.jit
def _block_best_kernel(
    logits_ptr, temperature_ptr, top_k_ptr, seed_ptr, position_ptr, best_ptr, best_id_ptr,
    V, s_row, n_blocks,
    BLOCK: tl.constexpr, DRAW: tl.constexpr,
):
    r = tl.program_id(0)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    live = offs < V
    x = tl.load(logits_ptr + r.to(tl.int64) * s_row + offs, mask=live, other=-float("inf")).to(tl.float32)
    # workspace [R, n_blocks, 2]: (argmax, draw) per block
    ws = (r * n_blocks + b) * 2
    tl.store(best_ptr + ws, tl.max(x, axis=0))
    tl.store(best_id_ptr + ws, b * BLOCK + tl.argmax(x, axis=0, tie_break_left=True))
    if DRAW:
        t = tl.load(temperature_ptr + r)
        greedy = (t == 0) | (tl.load(top_k_ptr + r) == 1)
        # greedy rows divide by 1 instead of 0; their draw is discarded in the second kernel
        t = tl.where(greedy, 1.0, t)
        mult, offset = _row_keys(tl.load(seed_ptr + r), tl.load(position_ptr + r))
        score = tl.math.div_rn(x, t) + _gumbel(mult, offset, offs.to(tl.uint32))
        score = tl.where(live, score, -float("inf"))
        tl.store(best_ptr + ws + 1, tl.max(score, axis=0))
        tl.store(best_id_ptr + ws + 1, b * BLOCK + tl.argmax(score, axis=0, tie_break_left=True))


@triton.jit
def _row_pick_kernel(
    best_ptr, best_id_ptr, temperature_ptr, top_k_ptr, out_ptr, n_blocks,
    BLOCKS: tl.constexpr, DRAW: tl.constexpr,
):
    r = tl.program_id(0)
    j = tl.arange(0, BLOCKS)
    ok = j < n_blocks
    ws = r * n_blocks * 2 + j * 2
    # blocks are in token order, so the first best block holds the lowest tied token id
    first = tl.argmax(tl.load(best_ptr + ws, mask=ok, other=-float("inf")), axis=0, tie_break_left=True)
    token = tl.load(best_id_ptr + r * n_blocks * 2 + first * 2)
    if DRAW:
        greedy = (tl.load(temperature_ptr + r) == 0) | (tl.load(top_k_ptr + r) == 1)
        pick = tl.argmax(tl.load(best_ptr + ws + 1, mask=ok, other=-float("inf")), axis=0, tie_break_left=True)
        token = tl.where(greedy, token, tl.load(best_id_ptr + r * n_blocks * 2 + pick * 2 + 1))
    tl.store(out_ptr + r, token.to(tl.int64))


@triton.jit
def _filtered_draw_kernel(
    vals_ptr, order_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, position_ptr, out_ptr, V,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    row = r.to(tl.int64) * V
    top_k = tl.load(top_k_ptr + r)
    top_p = tl.load(top_p_ptr + r)
    kept = tl.where(top_k > 0, tl.minimum(top_k, V), V)  # the top-k prefix of the ranks
    m = tl.load(vals_ptr + row)  # the largest value
    z = 0.0
    for r0 in range(0, kept, BLOCK):
        ranks = r0 + tl.arange(0, BLOCK)
        z += tl.sum(tl.exp(tl.load(vals_ptr + row + ranks, mask=ranks < kept, other=-float("inf")) - m), axis=0)
    # rank i is in the nucleus when the mass ranked above it is short of top_p; top_p = 1 skips
    # the test, so rounding cannot cut the tail off an unfiltered row
    limit = tl.where(top_p >= 1, float("inf"), top_p * z)
    mult, offset = _row_keys(tl.load(seed_ptr + r), tl.load(position_ptr + r))
    first = tl.load(order_ptr + row)  # the argmax, lowest id among ties (a stable sort)
    best_token = first
    best = -float("inf")
    above = 0.0  # mass of the ranks before this block
    r0 = 0
    while (r0 < kept) & (above < limit):
        ranks = r0 + tl.arange(0, BLOCK)
        live = ranks < kept
        v = tl.load(vals_ptr + row + ranks, mask=live, other=-float("inf"))
        e = tl.exp(v - m)
        keep = live & (above + tl.cumsum(e, axis=0) - e < limit)
        tokens = tl.load(order_ptr + row + ranks, mask=live, other=0)
        score = tl.where(keep, v + _gumbel(mult, offset, tokens.to(tl.uint32)), -float("inf"))
        block_best = tl.max(score, axis=0)
        token = tl.load(order_ptr + row + r0 + tl.argmax(score, axis=0, tie_break_left=True))
        # strictly greater: among equal scores the lower rank wins, as a full argmax would pick
        best_token = tl.where(block_best > best, token, best_token)
        best = tl.maximum(best, block_best)
        above += tl.sum(e, axis=0)
        r0 += BLOCK
    greedy = (tl.load(temperature_ptr + r) == 0) | (top_k == 1)
    tl.store(out_ptr + r, tl.where(greedy, first, best_token))


def sample_triton(logits, temperature, top_k, seed, position, *, draw: bool, out: torch.Tensor,
                  block: int = BLOCK_V) -> torch.Tensor:
    """Argmax (``draw`` False: every row greedy) or temperature draw of each row into ``out``.

    logits: [R, V] float32 (last dim contiguous); temperature [R] float32; top_k [R] int32;
    seed, position [R] int64; out [R] int64. The workspace is allocated here (inside a graph
    capture, from the graph's pool); nothing syncs with the host.
    """
    R, V = logits.shape
    if R == 0:
        return out
    if logits.stride(-1) != 1:
        raise ValueError("logits: the vocabulary dim must be contiguous")
    n_blocks = triton.cdiv(V, block)
    best = torch.empty(R, n_blocks, 2, dtype=torch.float32, device=logits.device)
    best_id = torch.empty(R, n_blocks, 2, dtype=torch.int32, device=logits.device)
    _block_best_kernel[(R, n_blocks)](
        logits, temperature, top_k, seed, position, best, best_id, V, logits.stride(0), n_blocks,
        BLOCK=block, DRAW=draw, num_warps=4,
    )
    _row_pick_kernel[(R,)](
        best, best_id, temperature, top_k, out, n_blocks,
        BLOCKS=max(2, triton.next_power_of_2(n_blocks)), DRAW=draw, num_warps=1,
    )
    return out


def filtered_draw_triton(vals, order, temperature, top_k, top_p, seed, position, *, out: torch.Tensor,
                         block: int = BLOCK_V) -> torch.Tensor:
    """Top-k / top-p draw of each row into ``out`` (greedy rows: the argmax), from the rows'
    ranked logits / T: ``vals`` [R, V] float32 highest first, ties by token id (a stable sort),
    ``order`` [R, V] int64 their token ids (``runtime.sampling._ranked``). Other arguments as
    ``runtime.sampling.sample``."""
    R, V = vals.shape
    if R:
        _filtered_draw_kernel[(R,)](vals, order, temperature, top_k, top_p, seed, position, out, V,
                                    BLOCK=block, num_warps=4)
    return out
