"""A mixture of experts' router (``moe_route``): each token's k experts and their weights,
static shapes throughout, so a step is captured once per bucket and replays with no host sync.

Router logits in fp32: a decode step's few rows on CUDA cores split over D (``_logits_kernel``),
more on tensor cores (bf16 rows
against the router's exact bf16 terms, ``router_terms``, else TF32 x 3). Then one kernel for the
choice (``_choose``: sigmoid scores, the score-correction bias for the choice, group-limited
top-k, normalisation and routed scaling, exactly as HF's NemotronH; or Granite's softmax over
the top-k logits), which also counts each block of tokens' pairs per expert (``block_counts``,
what ``kernels.moe.moe_experts`` takes to skip a counting pass). A token's k experts come out in
ascending expert order, the order HF's loop adds them in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .decode_linear import _TL_DTYPES
from .dispatch import with_reference

__all__ = ["ROUTE_BLOCK_T", "SCORINGS", "block_counts_buffer", "block_counts_ref", "moe_route", "moe_route_ref",
           "router_terms"]


@triton.jit
def _logits_kernel(x_ptr, gate_ptr, part_ptr, T, E, D, CHUNK, stride_x,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """A few tokens' router logits, split over experts and over D: part[s, t, e] = the sum over
    chunk s of D of x[t, d] * gate[e, d], in fp32 multiply-adds (x rounded up from its dtype, as
    HF's ``hidden.float()``). The top-k kernel adds the chunks in order, so no atomics."""
    es = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    s = tl.program_id(1)
    ts = tl.arange(0, BLOCK_T)
    e_ok, t_ok = es < E, ts < T
    if USE_PDL:  # x is the previous kernel's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_T, BLOCK_E, BLOCK_D), tl.float32)
    for d0 in range(s * CHUNK, tl.minimum(s * CHUNK + CHUNK, D), BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        d_ok = ds < D
        g = tl.load(gate_ptr + es[:, None] * D + ds[None, :], mask=e_ok[:, None] & d_ok[None, :], other=0.0)
        x = tl.load(x_ptr + ts[:, None] * stride_x + ds[None, :], mask=t_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += x[:, None, :] * g[None, :, :]
    tl.store(part_ptr + s * T * E + ts[:, None] * E + es[None, :], tl.sum(acc, axis=2),
             mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _choose(logits, bias, cols, col_ok, scale, TOP_K: tl.constexpr, N_GROUP: tl.constexpr,
            PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr,
            BLOCK_G: tl.constexpr, SOFTMAX: tl.constexpr, ROUND_DTYPE: tl.constexpr):
    """Rows' choices from their fp32 logits [BLOCK_T, BLOCK_E]: (chosen [BLOCK_T, BLOCK_E], 1
    where an expert is among the row's TOP_K, and the weights, zero elsewhere), as ``moe_route``
    defines them."""
    if SOFTMAX:
        scores = logits.to(ROUND_DTYPE).to(tl.float32)
        choice = tl.where(col_ok[None, :], scores, float("-inf"))
    else:
        scores = tl.sigmoid(logits)
        choice = tl.where(col_ok[None, :], scores + bias[None, :], float("-inf"))
    if N_GROUP > 1:
        # a group's score is the sum of its two best choices; keep the TOPK_GROUP best groups
        group = cols // PER_GROUP
        gcols = tl.arange(0, BLOCK_G)
        gscore = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            v = tl.where((group == g)[None, :], choice, float("-inf"))
            best = tl.argmax(v, axis=1)
            s = tl.max(v, axis=1)
            if PER_GROUP > 1:
                s += tl.max(tl.where(cols[None, :] == best[:, None], float("-inf"), v), axis=1)
            gscore = tl.where(gcols[None, :] == g, s[:, None], gscore)
        keep = tl.zeros(choice.shape, tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(gscore, axis=1)
            keep = tl.where(group[None, :] == g[:, None], 1, keep)
            gscore = tl.where(gcols[None, :] == g[:, None], float("-inf"), gscore)
        choice = tl.where(keep > 0, choice, float("-inf"))
    chosen = tl.zeros(choice.shape, tl.int32)
    for _ in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1)
        hit = cols[None, :] == best[:, None]
        chosen = tl.where(hit, 1, chosen)
        choice = tl.where(hit, float("-inf"), choice)
    if SOFTMAX:
        top = tl.max(tl.where(chosen > 0, scores, float("-inf")), axis=1)
        w = tl.where(chosen > 0, tl.exp(scores - top[:, None]), 0.0)
        w = (w / tl.sum(w, axis=1)[:, None]).to(ROUND_DTYPE).to(tl.float32)
    else:
        w = tl.where(chosen > 0, scores, 0.0)
        if NORM:
            w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
        w = w * scale
    return chosen, w


@triton.jit
def _summed_logits(logits_ptr, rows, row_ok, cols, col_ok, T, E, SPLIT: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    """Rows' logits [BLOCK_T, BLOCK_E] from their SPLIT partial sums [SPLIT, T, E], added in order."""
    logits = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for s in tl.static_range(SPLIT):
        logits += tl.load(logits_ptr + s * T * E + rows[:, None] * E + cols[None, :],
                          mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    return logits


@triton.jit
def _topk_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, counts_ptr, route_as_ptr, T, E, scale,
                 TOP_K: tl.constexpr, N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 NORM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_G: tl.constexpr, COUNTS: tl.constexpr, USE_PDL: tl.constexpr, SOFTMAX: tl.constexpr,
                 ROUND_DTYPE: tl.constexpr, ROUTE_AS: tl.constexpr):
    """A block of tokens' top-k from their logits, given as SPLIT partial sums [SPLIT, T, E];
    COUNTS: also the block's pairs per expert, counts[block, e] (the alignment's first pass).
    SOFTMAX: the top-k of the logits (rounded to ROUND_DTYPE first, as HF's router computes them
    in the model's dtype), weighted by the softmax over the k chosen, rounded so too; else
    sigmoid scores, the bias steering the choice, NORM and the routed scale. ROUTE_AS: row t
    chooses from row route_as[t]'s logits (a padding row as a live one: no expert more)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok, col_ok = rows < T, cols < E
    bias = cols
    if not SOFTMAX:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
    source = rows
    if ROUTE_AS:  # the step's metadata, uploaded before the step
        source = tl.load(route_as_ptr + rows, mask=row_ok, other=0)
    if USE_PDL:  # the logits are the previous kernel's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    logits = _summed_logits(logits_ptr, source, row_ok, cols, col_ok, T, E, SPLIT, BLOCK_T, BLOCK_E)
    chosen, w = _choose(logits, bias, cols, col_ok, scale, TOP_K, N_GROUP, PER_GROUP, TOPK_GROUP, NORM, BLOCK_T,
                        BLOCK_G, SOFTMAX, ROUND_DTYPE)
    if COUNTS:
        tl.store(counts_ptr + tl.program_id(0) * E + cols, tl.sum(tl.where(row_ok[:, None], chosen, 0), axis=0),
                 mask=col_ok)
    for j in tl.static_range(TOP_K):  # ascending expert order
        e = tl.min(tl.where(chosen > 0, cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == e[:, None]
        tl.store(idx_ptr + rows * TOP_K + j, e, mask=row_ok)
        tl.store(w_ptr + rows * TOP_K + j, tl.sum(tl.where(hit, w, 0.0), axis=1), mask=row_ok)
        chosen = tl.where(hit, 0, chosen)


@triton.jit
def _router_dot_kernel(x_ptr, gate_ptr, part_ptr, T, E, D, CHUNK, stride_x, BLOCK_T: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, TERMS: tl.constexpr):
    """More rows' router logits on tensor cores, split over D: part[s] = x[:, chunk s] @
    gate[:, chunk s].T for a tile of rows and experts, to about fp32's accuracy (HF's fp32 GEMM).
    The top-k kernel adds the chunks in order.

    TERMS 0: gate [E, D] fp32, x rounded up to fp32 (exact), the product in three TF32 products
    (``tf32x3``). TERMS n: x bf16 and gate [n, E, D] bf16 terms whose fp32 sum is the router's
    weights (``router_terms``): n bf16 products, each exact, accumulated in fp32."""
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    es = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    s = tl.program_id(2)
    t_ok, e_ok = ts < T, es < E
    acc = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for d0 in range(s * CHUNK, tl.minimum(s * CHUNK + CHUNK, D), BLOCK_K):
        ds = d0 + tl.arange(0, BLOCK_K)
        d_ok = ds < D
        x = tl.load(x_ptr + ts[:, None].to(tl.int64) * stride_x + ds[None, :], mask=t_ok[:, None] & d_ok[None, :],
                    other=0.0)
        g_tile = gate_ptr + es[:, None] * D + ds[None, :]
        g_ok = e_ok[:, None] & d_ok[None, :]
        if TERMS == 0:
            g = tl.load(g_tile, mask=g_ok, other=0.0)
            acc = tl.dot(x.to(tl.float32), tl.trans(g), acc, input_precision="tf32x3")
        else:
            for j in tl.static_range(TERMS):
                g = tl.load(g_tile + j * E * D, mask=g_ok, other=0.0)
                acc = tl.dot(x, tl.trans(g), acc)
    tl.store(part_ptr + s * T * E + ts[:, None].to(tl.int64) * E + es[None, :], acc,
             mask=t_ok[:, None] & e_ok[None, :])


def router_terms(gate: torch.Tensor) -> torch.Tensor:
    """The router's fp32 weights [E, D] as the fewest bf16 terms [n, E, D] whose fp32 sum is
    exactly ``gate`` (n at most 3: each term carries 8 of fp32's 24 significand bits; a
    checkpoint's bf16 router is one term). Against bf16 rows each term's products are exact, so
    the logits cost n bf16 products where TF32 x 3 costs three TF32 ones."""
    terms, rest = [], gate.float()
    for _ in range(3):
        terms.append(rest.to(torch.bfloat16))
        rest = rest - terms[-1].float()
        if not rest.any():
            break
    return torch.stack(terms)


def block_counts_buffer(tokens: int, n_experts: int, device) -> torch.Tensor:
    """An empty ``block_counts`` for ``moe_route`` and ``moe_experts``."""
    return torch.empty(triton.cdiv(tokens, ROUTE_BLOCK_T), n_experts, dtype=torch.int32, device=device)


def block_counts_ref(idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[cdiv(T, ROUTE_BLOCK_T), E] int32: each block of ``ROUTE_BLOCK_T`` tokens' pairs per expert."""
    T = idx.shape[0]
    blocks = torch.arange(T, device=idx.device).repeat_interleave(idx.shape[1]) // ROUTE_BLOCK_T
    out = torch.zeros(triton.cdiv(T, ROUTE_BLOCK_T), n_experts, dtype=torch.int32, device=idx.device)
    return out.index_put_((blocks, idx.flatten().long()), torch.ones_like(blocks, dtype=torch.int32), accumulate=True)


def _check_block_counts(op: str, block_counts, tokens: int, n_experts: int) -> None:
    """``block_counts`` (if given) is the int32 [cdiv(tokens, ROUTE_BLOCK_T), E] that ``block_counts_buffer`` makes."""
    blocks = triton.cdiv(tokens, ROUTE_BLOCK_T)
    if block_counts is not None and (block_counts.shape != (blocks, n_experts) or block_counts.dtype != torch.int32):
        raise ValueError(f"{op}: block_counts must be int32 [{blocks}, {n_experts}]; got {block_counts.dtype} "
                         f"{list(block_counts.shape)}")


# how a router scores experts: NemotronH's sigmoid (a score-correction bias, group limits) or
# Granite's softmax over the top-k logits
SCORINGS = ("sigmoid", "softmax")


def moe_route_ref(x, gate, bias, *, top_k: int, n_group: int = 1, topk_group: int = 1, norm_topk: bool = True,
                  scale: float = 1.0, gate_terms=None, block_counts=None, pdl: bool = False, scoring="sigmoid",
                  route_as=None):
    if route_as is not None:  # each row chooses as the row it names
        x = x.index_select(0, route_as.long())
    if scoring == "softmax":
        logits = F.linear(x.float(), gate.float()).to(x.dtype).float()
        idx = logits.topk(top_k, dim=-1)[1].sort(dim=-1)[0]
        w = logits.gather(1, idx).softmax(dim=-1).to(x.dtype).float()
        if block_counts is not None:
            block_counts.copy_(block_counts_ref(idx, gate.shape[0]))
        return idx.to(torch.int32), w
    scores = F.linear(x.float(), gate.float()).sigmoid()
    choice = scores + bias
    T, E = scores.shape
    if n_group > 1:
        per_group = E // n_group
        group_scores = choice.view(T, n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(topk_group, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        allowed = group_mask.repeat_interleave(per_group, dim=1).bool()
        choice = choice.masked_fill(~allowed, float("-inf"))
    idx = choice.topk(top_k, dim=-1)[1].sort(dim=-1)[0]
    w = scores.gather(1, idx)
    if norm_topk:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    if block_counts is not None:
        block_counts.copy_(block_counts_ref(idx, E))
    return idx.to(torch.int32), w * scale


# tokens a block of the top-k kernel (and of ``block_counts``) holds
ROUTE_BLOCK_T = 16
# tokens up to which the router logits are a CUDA-core kernel's (split over experts and D: a
# decode step's few rows), beyond which a tensor-core kernel's
ROUTER_KERNEL_MAX_T = 16


@with_reference(moe_route_ref)
def moe_route(x, gate, bias, *, top_k: int, n_group: int = 1, topk_group: int = 1, norm_topk: bool = True,
              scale: float = 1.0, gate_terms=None, block_counts=None, pdl: bool = False, scoring="sigmoid",
              route_as=None):
    """A token's experts and weights, as HF's NemotronH router (``scoring="sigmoid"``) or
    Granite's (``"softmax"``: the top-k of the logits rounded to x's dtype, weighted by their
    softmax, rounded so too: already normalised, so norm_topk changes nothing; no bias, groups
    or scale).

    x [T, D] (any float dtype), gate [E, D] fp32, bias [E] fp32 (the score-correction bias, which
    steers the choice but not the weights; None with softmax) -> (idx [T, top_k] int32 in
    ascending order, weights [T, top_k] fp32). ``n_group``/``topk_group``: the choice is limited
    to the ``topk_group`` groups (of E / n_group experts) with the best two-expert sums.
    ``gate_terms``: ``router_terms(gate)``, for bf16 rows past a decode step's few (the logits as
    bf16 products). ``block_counts``: an int32 [cdiv(T, ROUTE_BLOCK_T), E] buffer, filled with
    each block of tokens' pairs per expert (what ``moe_experts`` takes to skip a counting pass).
    ``pdl``: its kernels launch as programmatic dependents of the previous kernel
    (``kernels.decode_linear``). ``route_as`` [T] int32 (a step's metadata): row t takes the
    experts and weights of row ``route_as[t]``, so a bucket's padding rows, routed as a live row,
    add no expert for the step to read.
    """
    T, D = x.shape
    E = gate.shape[0]
    bias = _checked_router(x, gate, bias, top_k, n_group, topk_group, scale, scoring)
    _check_block_counts("moe_route", block_counts, T, E)
    if route_as is not None and (route_as.shape != (T,) or route_as.dtype != torch.int32):
        raise ValueError(f"moe_route: route_as must be int32 [{T}]; got {route_as.dtype} {list(route_as.shape)}")
    extra = {"launch_pdl": True} if pdl else {}
    if T <= ROUTER_KERNEL_MAX_T:
        logits, split = _few_rows_logits(x, gate, pdl)
    else:
        terms = gate_terms if gate_terms is not None and x.dtype == torch.bfloat16 else None
        logits, split = _router_dot(x, gate if terms is None else terms)
    idx = torch.empty(T, top_k, dtype=torch.int32, device=x.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    block_t = min(ROUTE_BLOCK_T, triton.next_power_of_2(T))
    _topk_kernel[(triton.cdiv(T, ROUTE_BLOCK_T),)](
        logits, bias, idx, w, block_counts if block_counts is not None else idx,
        route_as if route_as is not None else idx, T, E, float(scale), TOP_K=top_k,
        SPLIT=split, BLOCK_T=block_t, COUNTS=block_counts is not None, USE_PDL=pdl, ROUTE_AS=route_as is not None,
        **_choice_args(E, n_group, topk_group, norm_topk, scoring, x.dtype), num_warps=1 if block_t < 4 else 4,
        **extra)
    return idx, w


def _checked_router(x, gate, bias, top_k: int, n_group: int, topk_group: int, scale: float, scoring: str):
    """``moe_route``'s router arguments checked (a one-line error naming what is wrong); returns
    the bias the kernels take (a stand-in for a softmax router, which has none)."""
    T, D = x.shape
    E = gate.shape[0]
    if scoring not in SCORINGS:
        raise ValueError(f"moe_route: scoring must be one of {SCORINGS}, got {scoring!r}")
    if scoring == "softmax":
        if n_group != 1 or topk_group != 1 or scale != 1.0:
            raise ValueError(f"moe_route: a softmax router takes no groups and no routed scale, got n_group="
                             f"{n_group}, topk_group={topk_group}, scale={scale}")
        bias = gate[:, 0]  # any [E] stand-in: the softmax kernel does not read it
    if gate.shape != (E, D) or bias.shape != (E,) or x.stride(1) != 1 or not gate.is_contiguous():
        raise ValueError(f"moe_route: x [T, D] with contiguous rows, contiguous gate [E, D] and bias [E]; got "
                         f"{list(x.shape)}, {list(gate.shape)}, {list(bias.shape)}")
    if E % n_group or not 1 <= topk_group <= n_group or top_k > topk_group * (E // n_group):
        raise ValueError(f"moe_route: {top_k} of {E} experts in {topk_group} of {n_group} groups do not fit")
    return bias


def _choice_args(E: int, n_group: int, topk_group: int, norm_topk: bool, scoring: str, dtype: torch.dtype) -> dict:
    """The top-k kernel's constexprs for ``_choose`` over a router of E experts."""
    return dict(N_GROUP=n_group, PER_GROUP=E // n_group, TOPK_GROUP=topk_group, NORM=norm_topk,
                BLOCK_E=max(16, triton.next_power_of_2(E)), BLOCK_G=max(2, triton.next_power_of_2(n_group)),
                SOFTMAX=scoring == "softmax", ROUND_DTYPE=_TL_DTYPES[dtype])


def _few_rows_logits(x, gate, pdl: bool):
    """The logits' partial sums [split, T, E] of up to ``ROUTER_KERNEL_MAX_T`` rows, and the
    split: the cast and cuBLAS's fp32 product and its reduction took three launches (7 us a layer
    at one row); here one, split over D, its chunks added in order."""
    T, D = x.shape
    E = gate.shape[0]
    block_t = triton.next_power_of_2(T)
    block_d = max(32, 512 // block_t)
    chunk = block_d * triton.cdiv(D, 4 * block_d)
    split = triton.cdiv(D, chunk)
    logits = torch.empty(split, T, E, dtype=torch.float32, device=x.device)
    extra = {"launch_pdl": True} if pdl else {}
    _logits_kernel[(triton.cdiv(E, 4), split)](
        x, gate, logits, T, E, D, chunk, x.stride(0), BLOCK_T=block_t, BLOCK_E=4, BLOCK_D=block_d, USE_PDL=pdl,
        num_warps=4, **extra)
    return logits, split


# programs _router_dot's split over D aims for: about two per SM (one 4-warp tile per SM left the
# tensor cores idle between dependent loads: 31.8 us at 2048 Nano rows, split 4; split 8, 24.7)
ROUTER_PROGRAMS = 256


def _router_dot(x, gate):
    """The logits' partial sums [split, T, E] on tensor cores and the split: split over D (chunks
    of 256 or more) until the grid is about ``ROUTER_PROGRAMS`` programs (a decode step of 64 rows
    is one tile of rows). gate: fp32 [E, D], or bf16 terms [n, E, D] (``router_terms``) for bf16 x.
    A one-term router takes 128-wide K tiles and half the programs: at 2048 Nano rows 6.5 us
    against 7.3 in the fp32 router's tiles (its partial sums, half as many, save the top-k 1.5 us)."""
    T, D = x.shape
    E = gate.shape[-2]
    terms = gate.shape[0] if gate.dim() == 3 else 0
    block_k, programs = (128, ROUTER_PROGRAMS // 2) if terms == 1 else (32, ROUTER_PROGRAMS)
    block_t, block_e = min(64, max(16, triton.next_power_of_2(T))), min(128, triton.next_power_of_2(E))
    tiles = triton.cdiv(T, block_t) * triton.cdiv(E, block_e)
    want = max(1, min(triton.cdiv(D, 256), programs // tiles))
    chunk = block_k * triton.cdiv(D, want * block_k)
    split = triton.cdiv(D, chunk)
    part = torch.empty(split, T, E, dtype=torch.float32, device=x.device)
    _router_dot_kernel[(triton.cdiv(T, block_t), triton.cdiv(E, block_e), split)](
        x, gate, part, T, E, D, chunk, x.stride(0), BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, TERMS=terms,
        num_warps=4, num_stages=3)
    return part, split
