"""Token sampling inside the step graph: greedy, temperature, top-k and top-p, with per-request
seeds; the Triton kernels and their torch reference.

``sample`` is a fixed sequence of kernels over static shapes: no host sync, no branch on data,
so it is captured into the step's CUDA graph (one graph per rows x mode) and its token ids stay
on the device as the next step's input. On CUDA the modes run the kernels below (the filtered
mode after a torch sort); on the CPU the same draws in torch ops (``sample_torch``).

Randomness is counter-based. Each (seed, position, token id) hashes to its own uniform with
integer ops, and the Gumbel-max trick turns the uniforms into a draw from softmax(logits / T)
restricted to the allowed tokens. A request's token therefore depends only on its own logits,
seed and position: not on the other rows of the batch, not on the row it sits in, and replaying
a request reproduces its tokens. The hash is written in Triton for the kernels and once in torch
integer ops for both torch paths (``sample_torch`` and the row-by-row ``sample_ref``).

Modes are a static per-step choice of the host (``sampling_mode`` picks the cheapest that
serves every row):

    greedy    argmax only; every row must be greedy
    sample    temperature only: top-k and top-p are ignored, no sort
    filtered  top-k and/or top-p: one full-vocabulary sort per row

A row gets the same token from every mode that can serve it, so the mode is a cost choice, never
a semantic one. Greedy rows (temperature 0 or top_k 1) take the argmax of the raw logits in
every mode.

The kernels:

1. ``_block_best_kernel``  per (row, vocabulary block): the block's largest raw logit and, when
                           drawing, its largest score ``logits / T + Gumbel(seed, position,
                           token)``, each with the lowest token id among ties
2. ``_row_pick_kernel``    per row: the best of its blocks; greedy rows take the argmax, the
                           others the draw
3. ``_filtered_draw_kernel`` per row of the logits / T ranked by a torch sort (descending, ties
                           by token id): the top-k prefix's softmax normaliser, then the walk down
                           the ranks while the mass above stays under top_p, keeping the best
                           score; stops where the nucleus ends

The kernels' hash is the torch one bit for bit (32-bit integer math, IEEE division by T), so the
greedy and sample modes pick the same token as the torch ops but where a float32 log differs
by an ulp at an exact tie. The filtered mode sums the nucleus mass in another order than
torch's softmax and cumsum, so a token whose mass above lies within float32 rounding of top_p
may fall on the other side.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["MODES", "filtered_draw_triton", "sample", "sample_ref", "sample_torch", "sample_triton", "sampling_mode"]

MODES = ("greedy", "sample", "filtered")

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
    ``order`` [R, V] int64 their token ids (``_ranked``). Other arguments as ``sample``."""
    R, V = vals.shape
    if R:
        _filtered_draw_kernel[(R,)](vals, order, temperature, top_k, top_p, seed, position, out, V,
                                    BLOCK=block, num_warps=4)
    return out


# The torch reference of the hash: the same mixer and keys as the Triton functions above. Both
# multipliers are below 2**31, so a 32-bit value times either stays below 2**63: the int64 math
# here never overflows and needs no wraparound guarantee from any device.
_MASK32 = 0xFFFFFFFF


def _mix32_ref(x):
    """Mix 32-bit values held in int64 tensors (or Python ints) in [0, 2**32).

    The in-place operators update a tensor argument in place (callers pass temporaries) and
    rebind a Python int, so the same code is the exact-integer reference for the tests.
    """
    x ^= x >> 16
    x *= MUL1
    x &= _MASK32
    x ^= x >> 15
    x *= MUL2
    x &= _MASK32
    x ^= x >> 15
    return x


def _row_keys_ref(seed, position):
    """Per-draw keys from seed and position: int64 ``[R]`` each (or Python ints).

    Returns ``(mult, offset)``, two 32-bit words from two independent hash chains over the
    four 32-bit halves of seed and position; ``mult`` is odd.
    """
    # & and >> on int64 keep two's-complement bits, so negative seeds split like unsigned ones
    words = (seed & _MASK32, (seed >> 32) & _MASK32, position & _MASK32, (position >> 32) & _MASK32)
    mult, offset = KEY_MUL, KEY_OFF
    for w in words:
        mult = _mix32_ref(mult ^ w)
        offset = _mix32_ref(offset ^ w)
    return mult | 1, offset


def _random_bits_ref(mult, offset, token_ids):
    """``UNIFORM_BITS`` random bits per (draw, token): int64 ``[R, V]``.

    mult, offset: int64 ``[R, 1]`` from ``_row_keys_ref``; token_ids: int64 ``[V]`` or ``[R, V]``.
    Each row walks a Weyl sequence ``token * mult + offset`` (mod 2**32) through the mixer, so
    two draws share a stream only if both key words collide. token_ids * mult stays below 2**63
    for any vocabulary under 2**31 tokens.
    """
    x = token_ids * mult
    x += offset
    x &= _MASK32
    return _mix32_ref(x) >> (32 - UNIFORM_BITS)


def _gumbel_ref(mult, offset, token_ids) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))``, float32 with ``_random_bits_ref``'s shape."""
    u = _random_bits_ref(mult, offset, token_ids).to(torch.float32)
    u.add_(0.5).mul_(2.0**-UNIFORM_BITS)
    return u.log_().neg_().log_().neg_()


def _check(logits, params, out) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [R, V], got {tuple(logits.shape)}")
    R = logits.shape[0]
    for name, t in params.items():
        if t.shape != (R,):
            raise ValueError(f"{name}: expected [{R}], got {tuple(t.shape)}")
    if out.shape != (R,) or out.dtype != torch.int64:
        raise ValueError(f"out: expected [{R}] int64, got {tuple(out.shape)} {out.dtype}")


def sample_torch(logits, temperature, top_k, top_p, seed, position, *, mode: str, out) -> torch.Tensor:
    """``sample`` in torch ops on any device (checked arguments: call ``sample``)."""
    logits = logits.float()
    argmax = logits.argmax(dim=-1)
    if mode == "greedy":
        return out.copy_(argmax)
    is_greedy = _greedy(temperature, top_k)
    scaled = _scaled(logits, temperature, is_greedy)
    mult, offset = (k.unsqueeze(-1) for k in _row_keys_ref(seed, position))
    if mode == "sample":
        tokens = torch.arange(logits.shape[-1], device=logits.device)
        drawn = (scaled + _gumbel_ref(mult, offset, tokens)).argmax(dim=-1)
    else:
        drawn = _draw_filtered(*_ranked(scaled), top_k, top_p, mult, offset)
    return out.copy_(torch.where(is_greedy, argmax, drawn))


def _greedy(temperature, top_k) -> torch.Tensor:
    return (temperature == 0) | (top_k == 1)


def _scaled(logits, temperature, is_greedy) -> torch.Tensor:
    """logits / T per row; greedy rows divide by 1 instead of 0 (their draw is not used)."""
    return logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(-1)


def _ranked(scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's values, highest first, and their token ids: [R, V] each. Stable, so equal
    values rank by token id and the kept set of top-k / top-p is well defined under ties."""
    return scaled.sort(dim=-1, descending=True, stable=True)


def _draw_filtered(vals, order, top_k, top_p, mult, offset) -> torch.Tensor:
    """Gumbel-max over each row's top-k / top-p set of the ranked values: [R, V] -> [R] int64."""
    V = vals.shape[-1]
    rank = torch.arange(V, device=vals.device)
    keep = rank < torch.where(top_k > 0, top_k, V).unsqueeze(-1)
    vals = vals.masked_fill(~keep, -math.inf)
    probs = vals.softmax(dim=-1)
    # a token is in the nucleus when the mass ranked above it is still short of top_p; the top
    # token always is (mass 0). top_p = 1 skips the test, so fp32 rounding of the cumulative sum
    # cannot cut the tail off an unfiltered row.
    mass_above = probs.cumsum(dim=-1) - probs
    keep &= (mass_above < top_p.unsqueeze(-1)) | (top_p >= 1).unsqueeze(-1)
    # noise is keyed by token id (order), not by rank, so it matches the unsorted modes
    score = torch.where(keep, vals + _gumbel_ref(mult, offset, order), -math.inf)
    return order.gather(-1, score.argmax(dim=-1, keepdim=True)).squeeze(-1)


def sample_ref(logits, temperature, top_k, top_p, seed, position) -> torch.Tensor:
    """Row-by-row reference for ``sample`` (any mode that serves the rows), with the same
    random numbers; the allowed set is built in Python with float64 probabilities.

    Same arguments as ``sample`` without ``mode``/``out``; returns [R] int64 on the CPU.
    """
    logits = logits.detach().float().cpu()
    R, V = logits.shape
    out = torch.empty(R, dtype=torch.int64)
    for r in range(R):
        row, temp = logits[r], temperature[r].cpu().float()
        k, p = int(top_k[r]), float(top_p[r])
        if float(temp) == 0 or k == 1:
            out[r] = row.argmax()
            continue
        scaled = row / temp
        values = scaled.tolist()
        # highest first, ties by lower token id
        allowed = sorted(range(V), key=lambda i: (-values[i], i))
        if 0 < k < V:
            allowed = allowed[:k]
        if p < 1:
            probs = torch.softmax(torch.tensor([values[i] for i in allowed], dtype=torch.float64), 0)
            nucleus, mass = [], 0.0
            for token, prob in zip(allowed, probs.tolist()):
                nucleus.append(token)
                mass += prob
                if mass >= p:
                    break
            allowed = nucleus
        tokens = torch.tensor(allowed, dtype=torch.int64)
        mult, offset = _row_keys_ref(int(seed[r]), int(position[r]))
        key = (torch.tensor([[mult]]), torch.tensor([[offset]]))
        score = scaled[tokens] + _gumbel_ref(*key, tokens)[0]
        out[r] = allowed[int(score.argmax())]
    return out


def sampling_mode(temperature, top_k, top_p, vocab_size: int | None = None) -> str:
    """The cheapest mode that serves every row, from host arrays of the rows' parameters.

    temperature: [n] float, top_k: [n] int, top_p: [n] float (numpy or sequences). Without
    ``vocab_size`` any top_k > 0 counts as a filter; with it, top_k >= vocab_size is off.
    """
    t, k, p = np.asarray(temperature), np.asarray(top_k), np.asarray(top_p)
    drawn = (t > 0) & (k != 1)
    if not drawn.any():
        return "greedy"
    k_on = (k > 0) if vocab_size is None else (k > 0) & (k < vocab_size)
    return "filtered" if (drawn & (k_on | (p < 1))).any() else "sample"


def sample(logits, temperature, top_k, top_p, seed, position, *, mode: str, out) -> torch.Tensor:
    """Draw one token per row, without host sync; capturable in a CUDA graph.

    logits:      [R, V] float32 (other float dtypes are upcast)
    temperature: [R] float32, 0 = greedy
    top_k:       [R] int32, 0 (or >= V) = off, 1 = greedy
    top_p:       [R] float32 in (0, 1], 1 = off
    seed:        [R] int64, the request's seed
    position:    [R] int64, the index of this draw within its request
    mode:        "greedy", "sample" or "filtered" (see the module docstring)
    out:         [R] int64, written and returned
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    _check(logits, dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, position=position), out)
    if not logits.is_cuda:
        return sample_torch(logits, temperature, top_k, top_p, seed, position, mode=mode, out=out)
    if mode == "filtered":
        vals, order = _ranked(_scaled(logits.float(), temperature, _greedy(temperature, top_k)))
        return filtered_draw_triton(vals, order, temperature, top_k, top_p, seed, position, out=out)
    return sample_triton(logits.float(), temperature, top_k, seed, position, draw=mode == "sample", out=out)
