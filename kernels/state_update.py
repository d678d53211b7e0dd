"""Selective state update: one decode token per row through a Mamba2 SSM, state kept in a slot pool.

For each row ``b`` whose slot ``s = slot_idx[b]`` is live and each head ``h`` (group
``g = h // (H // G)``), in fp32::

    dt'   = softplus(dt[b, h] + dt_bias[h])                 # bias and softplus optional
    state[s, h] = state[s, h] * exp(dt' * A[h]) + dt' * x[b, h][:, None] * B[b, g][None, :]
    y     = state[s, h] @ C[b, g] + D[h] * x[b, h]           # D optional
    y     = y * silu(z[b, h])                                # z optional

The state is stored back in its own dtype, but ``y`` is taken from the fp32 updated state before
that rounding. HF's ``mamba2_selective_state_update`` does the same (its ``ssm_states`` is the
fp32 sum, cast only to C's dtype for the matmul), and so does mamba_ssm's kernel. Decode applies
no dt clamp, like HF's recurrent branch.

A row whose slot is ``PAD_SLOT_ID`` never touches the pool and gets zeros in ``out``. Slots of
live rows must be distinct (each row owns its slot for the step).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import with_reference
from .varlen import PAD_SLOT_ID

__all__ = ["selective_state_update", "selective_state_update_ref"]


@triton.jit
def _state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, slot_ptr, out_ptr,
    heads_per_group,
    stride_state_s, stride_state_h, stride_state_p,
    stride_x_b, stride_x_h,
    stride_dt_b, stride_dt_h,
    stride_B_b, stride_B_g,
    stride_C_b, stride_C_g,
    stride_z_b, stride_z_h,
    stride_out_b, stride_out_h,
    NHEADS: tl.constexpr,
    HEADDIM: tl.constexpr,
    DSTATE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program: row b, head h, rows [pid_p * BLOCK_P, +BLOCK_P) of the head's [P, N] state.
    # Heads of one row are neighbours in program order, so B/C of a group and the slot's
    # contiguous [H, P, N] block are read by programs running close together.
    pid_bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    b = pid_bh // NHEADS
    h = pid_bh % NHEADS
    g = h // heads_per_group

    slot = tl.load(slot_ptr + b)
    live = slot >= 0
    # Pad rows keep their pointers in range, but every state access below is masked off for them.
    # int64: a large pool (S * H * P * N) passes 2**31 elements.
    slot = tl.where(live, slot, 0).to(tl.int64)

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < HEADDIM
    mask_n = offs_n < DSTATE
    # A pad row has no state rows at all. Folding that into the row bound, rather than and-ing a
    # scalar into the mask, keeps the mask boolean in Triton's interpreter too.
    live_p = offs_p < tl.where(live, HEADDIM, 0)
    state_mask = live_p[:, None] & mask_n[None, :]

    # [BLOCK_P, BLOCK_N]; the last dim is contiguous, so these are full-width vector accesses.
    state_ptrs = (
        state_ptr + slot * stride_state_s + h * stride_state_h
        + offs_p[:, None] * stride_state_p + offs_n[None, :]
    )
    state = tl.load(state_ptrs, mask=state_mask, other=0.0).to(tl.float32)
    # A programmatic dependent launch streams the state in while the previous kernel drains:
    # only this kernel touches the layer's state within a step. Its inputs come after the wait.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    # Inputs of pad rows are read (they are step buffers, not state) and then discarded.
    x = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + offs_p, mask=mask_p, other=0.0)
    B = tl.load(B_ptr + b * stride_B_b + g * stride_B_g + offs_n, mask=mask_n, other=0.0)
    C = tl.load(C_ptr + b * stride_C_b + g * stride_C_g + offs_n, mask=mask_n, other=0.0)
    x, B, C = x.to(tl.float32), B.to(tl.float32), C.to(tl.float32)

    dt = tl.load(dt_ptr + b * stride_dt_b + h * stride_dt_h).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + h).to(tl.float32)
    if DT_SOFTPLUS:
        # torch's softplus threshold: linear above 20, where exp would only lose precision.
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    dA = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))

    state = state * dA + (dt * x)[:, None] * B[None, :]
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=state_mask)

    # y from the fp32 state, before it was rounded to the pool's dtype (see module docstring).
    y = tl.sum(state * C[None, :], axis=1)  # [BLOCK_P]
    if HAS_D:
        y += tl.load(D_ptr + h).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(z_ptr + b * stride_z_b + h * stride_z_h + offs_p, mask=mask_p, other=0.0)
        z = z.to(tl.float32)
        y *= z * tl.sigmoid(z)
    y = tl.where(live, y, 0.0).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * stride_out_b + h * stride_out_h + offs_p, y, mask=mask_p)


# Bytes of state one program streams in (and out). 8 KiB is a [32, 128] bf16 or [16, 128] fp32
# tile: big enough that the per-program loads of x, B, C and the scalars are a small overhead,
# small enough to leave thousands of programs at decode batch sizes.
_TILE_BYTES = 8192


@functools.lru_cache(maxsize=None)
def _block_config(headdim: int, dstate: int, state_dtype: torch.dtype, one_row: bool = False) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_N, num_warps) for a head of [headdim, dstate] state in ``state_dtype``.

    Static per model (and whether the batch is one row), so each model compiles a variant or two;
    never autotuned, since the kernel mutates the state. At one row, where the step waits on each
    kernel's latency rather than its bandwidth, half the tile in one warp: twice the programs,
    each a shorter chain, which the batch-1 step waits on less (docs/experiments.md).
    """
    elem = state_dtype.itemsize
    tile_bytes = _TILE_BYTES // 2 if one_row else _TILE_BYTES
    block_n = triton.next_power_of_2(dstate)
    target_p = max(1, tile_bytes // (block_n * elem))
    start = min(target_p, triton.next_power_of_2(headdim))
    # Of start, start/2, start/4, start/8 (tiles of at least 1/8 the target) pick the one that
    # wastes the fewest masked rows (headdim 80: 16 x 5 rather than 32 x 3), the largest on a tie.
    min_p = min(start, max(1, tile_bytes // 8 // (block_n * elem)))
    candidates = [start >> k for k in range(4) if start >> k >= min_p]
    block_p = min(candidates, key=lambda bp: (triton.cdiv(headdim, bp) * bp, -bp))
    if one_row:
        return block_p, block_n, 1
    # 16-byte vectors: 8 bf16 or 4 fp32 lanes. Give each thread at least two vectors of the tile
    # so its loads overlap; 4 warps cover an 8 KiB tile in four vectors per thread.
    vec = 16 // elem
    num_warps = max(1, min(4, block_p * block_n // (32 * vec * 2)))
    return block_p, block_n, num_warps


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, strides {tuple(t.stride())}")


def _check_shapes(state, x, dt, A, B, C, D, slot_idx, z, dt_bias, out) -> None:
    if state.dim() != 4:
        raise ValueError(f"state must be [S, H, P, N], got {tuple(state.shape)}")
    _, H, P, N = state.shape
    batch, G = x.shape[0], B.shape[1]
    expect = {
        "x": (x, (batch, H, P)),
        "dt": (dt, (batch, H)),
        "A": (A, (H,)),
        "B": (B, (batch, G, N)),
        "C": (C, (batch, G, N)),
        "slot_idx": (slot_idx, (batch,)),
        "out": (out, (batch, H, P)),
        "D": (D, (H,)),
        "z": (z, (batch, H, P)),
        "dt_bias": (dt_bias, (H,)),
    }
    for name, (t, shape) in expect.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if G == 0 or H % G != 0:
        raise ValueError(f"heads ({H}) must be a multiple of groups ({G})")
    if slot_idx.dtype != torch.int32:
        raise ValueError(f"slot_idx must be int32, got {slot_idx.dtype}")
    if out.dtype != x.dtype:
        raise ValueError(f"out must have x's dtype {x.dtype}, got {out.dtype}")


def selective_state_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    slot_idx: torch.Tensor,
    *,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Plain fp32 torch reference; same contract as :func:`selective_state_update`.

    Selects the live rows with a boolean mask, so on CUDA it syncs with the host: it is the CPU
    path and the tests' oracle, not something to capture.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _check_shapes(state, x, dt, A, B, C, D, slot_idx, z, dt_bias, out)
    H, G = state.shape[1], B.shape[1]

    rows = (slot_idx != PAD_SLOT_ID).nonzero().squeeze(1)
    slots = slot_idx[rows].long()
    f32 = lambda t: t.float()  # noqa: E731
    x_, dt_ = f32(x[rows]), f32(dt[rows])  # [R, H, P], [R, H]
    # groups broadcast to their heads: [R, G, N] -> [R, H, N]
    B_ = f32(B[rows]).repeat_interleave(H // G, dim=1)
    C_ = f32(C[rows]).repeat_interleave(H // G, dim=1)

    if dt_bias is not None:
        dt_ = dt_ + f32(dt_bias)
    if dt_softplus:
        dt_ = F.softplus(dt_)
    dA = torch.exp(dt_ * f32(A))  # [R, H]

    s = f32(state[slots])  # [R, H, P, N]
    s = s * dA[:, :, None, None] + (dt_[:, :, None] * x_)[..., None] * B_[:, :, None, :]
    state[slots] = s.to(state.dtype)

    y = (s * C_[:, :, None, :]).sum(-1)  # [R, H, P]
    if D is not None:
        y = y + f32(D)[:, None] * x_
    if z is not None:
        y = y * F.silu(f32(z[rows]))
    out.zero_()
    out[rows] = y.to(out.dtype)
    return out


@with_reference(selective_state_update_ref)
def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    slot_idx: torch.Tensor,
    *,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Advance the SSM state of each row's slot by one token and return the token's output.

    state:    [S, H, P, N] bf16 or fp32, the slot pool, updated in place (last dim contiguous)
    x:        [batch, H, P] bf16 or fp32 (may be a strided view, last dim contiguous)
    dt:       [batch, H] raw time step, before dt_bias and softplus
    A:        [H] fp32, already -exp(A_log)
    B, C:     [batch, G, N], G dividing H (may be strided views, last dim contiguous)
    D:        [H] skip weight, or None
    slot_idx: [batch] int32 state slot of each row; PAD_SLOT_ID (-1) skips the row
    z:        [batch, H, P] gate, or None; y is multiplied by silu(z)
    dt_bias:  [H] added to dt before the softplus, or None
    dt_softplus: apply softplus to dt (after dt_bias)
    out:      [batch, H, P] in x's dtype, written in full (zeros for pad rows); allocated if None
    pdl:      launch as a programmatic dependent of the previous kernel (CUDA, sm_90+; the
              reference ignores it)

    CUDA tensors run the Triton kernel (no host sync, capturable); CPU tensors run the reference.
    Returns ``out``.
    """
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _check_shapes(state, x, dt, A, B, C, D, slot_idx, z, dt_bias, out)
    for name, t in {"state": state, "x": x, "B": B, "C": C, "z": z, "out": out}.items():
        if t is not None:
            _check_last_dim_contiguous(name, t)
    for name, t in {"A": A, "D": D, "dt_bias": dt_bias, "slot_idx": slot_idx}.items():
        if t is not None and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")

    batch = x.shape[0]
    _, H, P, N = state.shape
    G = B.shape[1]
    if batch == 0:
        return out
    block_p, block_n, num_warps = _block_config(P, N, state.dtype, batch == 1)
    grid = (batch * H, triton.cdiv(P, block_p))
    # Absent optional tensors: any valid pointer will do, the constexpr flags keep it unread.
    _state_update_kernel[grid](
        state, x, dt, A, B, C,
        D if D is not None else x,
        z if z is not None else x,
        dt_bias if dt_bias is not None else x,
        slot_idx, out,
        H // G,
        state.stride(0), state.stride(1), state.stride(2),
        x.stride(0), x.stride(1),
        dt.stride(0), dt.stride(1),
        B.stride(0), B.stride(1),
        C.stride(0), C.stride(1),
        z.stride(0) if z is not None else 0, z.stride(1) if z is not None else 0,
        out.stride(0), out.stride(1),
        NHEADS=H,
        HEADDIM=P,
        DSTATE=N,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus,
        USE_PDL=pdl,
        num_warps=num_warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
