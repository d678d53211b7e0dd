"""Mamba2's decode tail in one kernel: state update, gated norm and out_proj, split over K.

A fused decode block (``kernels.decode_linear``) is three dependent kernels: block norm +
in_proj + conv update; state update; gated norm + out_proj + residual add. At one or two rows
each is a few µs of latency more than of bandwidth, so a kernel boundary is worth removing.
Here the last two become one kernel, and what needs the whole row is left to the next block's
first kernel:

- a program owns one head's ``BLOCK_P`` channels, i.e. a K slice of out_proj. It advances those
  state rows, gates its slice of y, ``g = y * silu(z)``, and adds ``W[:, slice] @ (g * norm_w)``
  into the block's accumulator. The gated RMSNorm scales each norm group by one number, so it
  can wait: the program also stores its slice's sum of ``g^2``.
- the next block's first kernel (``norm_linear(..., pending=...)``) sums those per-slice squares
  in a fixed order, scales the accumulator by each group's rstd, adds the bias, rounds as
  ``F.linear`` would, adds the residual stream, and goes on with its own norm.

The accumulator is fixed point: each program's fp32 partial sums are scaled by ``SCALE`` and
truncated to int64 before a relaxed atomic add. Integer addition is associative, so the sums,
and the step, are the same bits whatever order the programs finish in (float atomics would not
be). At 2**-32 the truncation is far below bf16's rounding; an output would have to pass 2**31
in magnitude to overflow.

Numerics against the unfused ops: y is rounded to the activation dtype as the state update hands
it on; the product's operand ``g * norm_w`` is rounded to the weight dtype (the unfused ops round
the normalised row instead; the group's scale comes after the product here). ``split_tail_ref``
composes the same steps in torch.

``Pending`` is the block's output on its way to the residual stream; ``pending_ref`` applies it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .state_update import selective_state_update_ref
from .tiles import pick_row

__all__ = ["SCALE", "SCALE_JIT", "Pending", "split_tail", "split_tail_triton", "split_tail_ref", "pending_ref", "split_count", "BLOCK_P", "MAX_N"]

SCALE = 2.0**32  # fixed point of the accumulator
SCALE_JIT = tl.constexpr(SCALE)


class Pending(NamedTuple):
    """A Mamba2 block's output not yet added to the residual stream.

    acc:      [M, G, N] int64, per norm group g: SCALE * sum over its K of W[n, k] * g_k * norm_w[k]
    ssq:      [M, S] fp32, per K slice s: the sum of g_k^2; slices S/G at a time make a norm group
    group_size, eps: the gated norm's
    bias:     out_proj's bias [N], or None
    residual: [M, N] the residual stream before this block (read, never written)
    dtype:    out_proj's weight dtype, which its product is rounded to (as ``F.linear``)
    """

    acc: torch.Tensor
    ssq: torch.Tensor
    group_size: int
    eps: float
    bias: torch.Tensor | None
    residual: torch.Tensor
    dtype: torch.dtype


@triton.jit
def _split_tail_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr,
    wn_ptr, w_ptr, acc_ptr, ssq_ptr,
    N_OUT, heads_per_group,
    stride_state_s, stride_state_h, stride_state_p,
    stride_x_b, stride_x_h, stride_dt_b, stride_dt_h, stride_B_b, stride_B_g, stride_C_b, stride_C_g,
    stride_z_b, stride_z_h, stride_w, stride_acc_m, stride_acc_g, stride_ssq_m,
    M: tl.constexpr, BLOCK_M: tl.constexpr, HEADDIM: tl.constexpr, DSTATE: tl.constexpr, HEADS_PER_NORM_GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, USE_PDL: tl.constexpr,
):
    # One program: head h, channels [pt * BLOCK_P, +BLOCK_P) of it, all M rows. The program id
    # is also the K slice's index in ssq.
    pid = tl.program_id(0)
    tiles = (HEADDIM + BLOCK_P - 1) // BLOCK_P
    h = pid // tiles
    g = h // heads_per_group
    ng = h // HEADS_PER_NORM_GROUP
    offs_p = (pid % tiles) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = offs_p < HEADDIM
    k = h * HEADDIM + offs_p  # out_proj's input columns
    offs_n = tl.arange(0, BLOCK_N)
    n_ok = offs_n < DSTATE
    o = tl.arange(0, BLOCK_O)
    o_ok = o < N_OUT
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M

    # Before the wait, what no other kernel writes within a step: the weight slice, the layer's
    # state rows (only this kernel touches them), the slots (filled before the step's kernels).
    w = tl.load(w_ptr + o[:, None] * stride_w + k[None, :], mask=o_ok[:, None] & p_ok[None, :], other=0.0)
    wn = tl.load(wn_ptr + k, mask=p_ok, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + h).to(tl.float32)
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    live = slot >= 0
    live_p = live[:, None] & p_ok[None, :]  # [BLOCK_M, BLOCK_P]
    s_mask = live_p[:, :, None] & n_ok[None, None, :]
    s_ptrs = (state_ptr + tl.where(live, slot, 0).to(tl.int64)[:, None, None] * stride_state_s
              + h * stride_state_h + offs_p[None, :, None] * stride_state_p + offs_n[None, None, :])
    state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_P, BLOCK_N]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    # in_proj's outputs (x, B, C after the conv update; dt; z)
    xm = row_ok[:, None] & p_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x_b + h * stride_x_h + offs_p[None, :], mask=xm, other=0.0)
    act_dtype = x.dtype
    x = x.to(tl.float32)
    bc = row_ok[:, None] & n_ok[None, :]
    Bv = tl.load(B_ptr + rows[:, None] * stride_B_b + g * stride_B_g + offs_n[None, :], mask=bc, other=0.0)
    Cv = tl.load(C_ptr + rows[:, None] * stride_C_b + g * stride_C_g + offs_n[None, :], mask=bc, other=0.0)
    z = tl.load(z_ptr + rows[:, None] * stride_z_b + h * stride_z_h + offs_p[None, :], mask=xm, other=0.0)
    dt = tl.load(dt_ptr + rows * stride_dt_b + h * stride_dt_h, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + h).to(tl.float32)
    if DT_SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    dA = tl.exp(dt * A)

    state = state * dA[:, None, None] + (dt[:, None] * x)[:, :, None] * Bv.to(tl.float32)[:, None, :]
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)
    y = tl.sum(state * Cv.to(tl.float32)[:, None, :], axis=2)  # [BLOCK_M, BLOCK_P], from the fp32 state
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * x
    y = y.to(act_dtype).to(tl.float32)  # as the state update hands it on
    z = z.to(tl.float32)
    gate = tl.where(live_p, y * z * tl.sigmoid(z), 0.0)
    tl.store(ssq_ptr + rows * stride_ssq_m + pid, tl.sum(gate * gate, axis=1), mask=row_ok)
    # The product on the tensor cores, the rows as columns of a [BLOCK_P, 16] operand: a
    # broadcast multiply-add would pull the weight tile into the state tile's layout.
    gw = gate * wn[None, :]
    cols = tl.arange(0, 16)
    g_op = tl.zeros([BLOCK_P, 16], dtype=tl.float32)
    for m in tl.static_range(M):
        g_op += tl.where(cols[None, :] == m, tl.trans(pick_row(gw, m, BLOCK_M)), 0.0)
    part = tl.dot(w, g_op.to(w.dtype))  # [BLOCK_O, 16] fp32
    for m in tl.static_range(M):
        part_m = tl.sum(tl.where(cols[None, :] == m, part, 0.0), axis=1)
        tl.atomic_add(acc_ptr + m * stride_acc_m + ng * stride_acc_g + o, (part_m * SCALE_JIT).to(tl.int64),
                      mask=o_ok, sem="relaxed")


# Channels a program owns: one tensor-core K step. On Mamba2-130M, 96 programs, each with 24 KB
# of out_proj and 8 KB of fp32 state.
BLOCK_P = 16
# The widest out_proj a program holds whole ([MAX_N, BLOCK_P] of weights, its product in fp32).
MAX_N = 1024


def split_count(heads: int, headdim: int) -> int:
    """K slices (programs) of a layer: the width of ``Pending.ssq``."""
    return heads * triton.cdiv(headdim, BLOCK_P)


def _check(state, x, dt, A, B, C, D, slot_idx, z, dt_bias, norm_w, norm_groups, weight, bias, residual, acc):
    M, H, P = x.shape
    _, G, N = B.shape
    K, n_out = H * P, weight.shape[0]
    if tuple(state.shape[1:]) != (H, P, N):
        raise ValueError(f"state: expected [S, {H}, {P}, {N}], got {list(state.shape)}")
    expect = {"dt": (dt, (M, H)), "A": (A, (H,)), "C": (C, (M, G, N)), "D": (D, (H,)), "slot_idx": (slot_idx, (M,)),
              "z": (z, (M, H, P)), "dt_bias": (dt_bias, (H,)), "norm_w": (norm_w, (K,)), "weight": (weight, (n_out, K)),
              "bias": (bias, (n_out,)), "residual": (residual, (M, n_out)), "acc": (acc, (M, norm_groups, n_out))}
    for name, (t, shape) in expect.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if H % G or H % norm_groups:
        raise ValueError(f"heads ({H}) must be a multiple of the groups ({G}) and the norm groups ({norm_groups})")
    if n_out > MAX_N:
        raise ValueError(f"out_proj has {n_out} outputs; a split tail holds at most {MAX_N}")
    if acc.dtype != torch.int64:
        raise ValueError(f"acc must be int64, got {acc.dtype}")
    if slot_idx.dtype != torch.int32:
        raise ValueError(f"slot_idx must be int32, got {slot_idx.dtype}")
    for name, t in {"state": state, "x": x, "B": B, "C": C, "z": z, "weight": weight, "acc": acc}.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, strides {tuple(t.stride())}")


def split_tail_triton(state, x, dt, A, B, C, D, slot_idx, z, *, dt_bias, dt_softplus=True, norm_w, norm_groups,
                      eps, weight, bias=None, residual, acc, pdl=False) -> Pending:
    """Triton launcher of :func:`split_tail`."""
    _check(state, x, dt, A, B, C, D, slot_idx, z, dt_bias, norm_w, norm_groups, weight, bias, residual, acc)
    M, H, P = x.shape
    N, n_out = B.shape[2], weight.shape[0]
    ssq = torch.empty(M, split_count(H, P), dtype=torch.float32, device=x.device)
    _split_tail_kernel[(ssq.shape[1],)](
        state, x, dt, A, B, C, D if D is not None else A, z, dt_bias if dt_bias is not None else A, slot_idx,
        norm_w, weight, acc, ssq,
        n_out, H // B.shape[1],
        state.stride(0), state.stride(1), state.stride(2),
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        z.stride(0), z.stride(1), weight.stride(0), acc.stride(0), acc.stride(1), ssq.stride(0),
        M=M, BLOCK_M=triton.next_power_of_2(M), HEADDIM=P, DSTATE=N, HEADS_PER_NORM_GROUP=H // norm_groups,
        BLOCK_P=BLOCK_P, BLOCK_N=triton.next_power_of_2(N), BLOCK_O=triton.next_power_of_2(n_out),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, USE_PDL=pdl,
        num_warps=8, **({"launch_pdl": True} if pdl else {}),
    )
    return Pending(acc, ssq, H * P // norm_groups, eps, bias, residual, weight.dtype)


def split_tail_ref(state, x, dt, A, B, C, D, slot_idx, z, *, dt_bias, dt_softplus=True, norm_w, norm_groups,
                   eps, weight, bias=None, residual, acc, pdl=False) -> Pending:
    """The same steps in torch: the state update's reference, then each K slice's squares and
    fixed-point partial product, as the kernel's programs would add them."""
    _check(state, x, dt, A, B, C, D, slot_idx, z, dt_bias, norm_w, norm_groups, weight, bias, residual, acc)
    M, H, P = x.shape
    N, n_out = B.shape[2], weight.shape[0]
    y = selective_state_update_ref(state, x, dt, A, B, C, D, slot_idx, dt_bias=dt_bias, dt_softplus=dt_softplus)
    live = (slot_idx >= 0)[:, None, None]
    gate = torch.where(live, y.float() * F.silu(z.float()), 0.0).reshape(M, H * P)
    ssq = torch.empty(M, split_count(H, P), dtype=torch.float32, device=x.device)
    gw = (gate * norm_w.float()).to(weight.dtype).float()  # the tensor cores' operand
    heads_per_norm_group = H // norm_groups
    for s in range(ssq.shape[1]):
        h, first = divmod(s, triton.cdiv(P, BLOCK_P))
        cols = slice(h * P + first * BLOCK_P, h * P + min(P, (first + 1) * BLOCK_P))
        ssq[:, s] = gate[:, cols].square().sum(1)
        part = gw[:, cols] @ weight[:, cols].float().T  # [M, n_out]
        acc[:, h // heads_per_norm_group] += (part * SCALE).to(torch.int64)
    return Pending(acc, ssq, H * P // norm_groups, eps, bias, residual, weight.dtype)


def pending_ref(p: Pending) -> torch.Tensor:
    """The residual stream with the block's output added: residual + round(out_proj(norm(g)))."""
    M, G, n_out = p.acc.shape
    ssq = p.ssq.view(M, G, -1).sum(-1)  # [M, G]
    rstd = torch.rsqrt(ssq / p.group_size + p.eps)
    out = (p.acc.double() / SCALE * rstd[:, :, None].double()).sum(1).float()
    if p.bias is not None:
        out = out + p.bias.float()
    out = out.to(p.dtype)
    return (p.residual.float() + out.float()).to(p.residual.dtype)


def split_tail(state, x, dt, A, B, C, D, slot_idx, z, *, dt_bias, dt_softplus=True, norm_w, norm_groups, eps,
               weight, bias=None, residual, acc, pdl=False) -> Pending:
    """A Mamba2 decode block's tail, its output left pending for the next block's first kernel.

    state, x, dt, A, B, C, D, slot_idx, dt_bias, dt_softplus: as ``selective_state_update``
    z:           [M, H, P] the gate (in_proj's z columns)
    norm_w:      [H * P] the gated RMSNorm's weight; norm_groups: its groups (dividing H); eps
    weight:      out_proj [n_out, H * P]; bias: [n_out] or None
    residual:    [M, n_out] the residual stream before this block, carried to the ``Pending``
    acc:         [M, norm_groups, n_out] int64, zeroed by the caller; summed into
    pdl:         launch as a programmatic dependent of the previous kernel (CUDA, sm_90+)

    Advances the state in place and returns the ``Pending`` output; ``pending_ref`` (or a
    ``norm_linear(..., pending=...)``) adds it into the residual stream.
    """
    fn = split_tail_triton if x.is_cuda else split_tail_ref
    return fn(state, x, dt, A, B, C, D, slot_idx, z, dt_bias=dt_bias, dt_softplus=dt_softplus, norm_w=norm_w,
              norm_groups=norm_groups, eps=eps, weight=weight, bias=bias, residual=residual, acc=acc, pdl=pdl)
