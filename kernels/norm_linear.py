"""RMSNorm fused into the prologue of the next projection, for decode batches of at most 16 rows.

At small batch a norm kernel followed by a cuBLAS GEMV is two launches whose cost is mostly
latency. Here one kernel does both: each program owns ``BLOCK_N`` output columns, recomputes the
row norms of all (at most 16) rows itself in a first pass over the activations, then streams its
``[BLOCK_N, K]`` slice of the weight once while it normalises the activations chunk by chunk in
registers and feeds them to ``tl.dot``. Programs never communicate; the activations are tiny and
are re-read from L2 by every program, the weight is read from memory exactly once.

- ``add_norm_linear``: ``residual + x`` -> RMSNorm -> ``@ weight.T`` (Mamba2's block norm and
  in_proj), numerics of :func:`~mambastep.kernels.norm.rms_norm_ref`.
- ``gated_norm_linear``: grouped RMSNorm of ``y * silu(z)`` -> ``@ weight.T`` (the mixer's gated
  norm and out_proj), numerics of :func:`~mambastep.kernels.norm.gated_rms_norm_ref`.

Larger batches should call the unfused norm and cuBLAS; the launchers refuse more than 16 rows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = [
    "MAX_ROWS",
    "add_norm_linear",
    "add_norm_linear_triton",
    "add_norm_linear_ref",
    "gated_norm_linear",
    "gated_norm_linear_triton",
    "gated_norm_linear_ref",
]

# Rows are padded to one 16-row tl.dot tile; beyond that a GEMM (cuBLAS) is the better kernel.
MAX_ROWS = 16


@triton.jit
def _norm_dot(acc, a, rstd, wn_ptr, w_ptr, stride_w, n, n_mask, cols, col_mask,
              NORM_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """acc + h @ weight[n, cols].T with h = round(round(a * rstd, NORM_DTYPE) * wn[cols]).

    a: [BLOCK_M, BLOCK_K] fp32 rows to normalise; rstd: [BLOCK_M]; acc: [BLOCK_M, BLOCK_N] fp32.
    """
    # HF rounds the normalised row to the activation dtype before scaling by the norm weight
    y = (a * rstd[:, None]).to(NORM_DTYPE).to(tl.float32)
    wn = tl.load(wn_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    h = (y * wn[None, :]).to(w_ptr.dtype.element_ty)
    w = tl.load(w_ptr + n[:, None] * stride_w + cols[None, :],
                mask=n_mask[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
    return tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def _new_residual(x_ptr, res_ptr, stride_x, stride_res, rows, cols, mask, HAS_X: tl.constexpr):
    """residual + x rounded to the residual's dtype, as fp32: [BLOCK_M, BLOCK_K]."""
    r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_X:
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = (r + x).to(res_ptr.dtype.element_ty).to(tl.float32)
    return r


@triton.jit
def _add_norm_linear_kernel(
    x_ptr, res_ptr, res_out_ptr, wn_ptr, w_ptr, out_ptr,
    M, N, D, eps,
    stride_x, stride_res, stride_res_out, stride_w, stride_out,
    HAS_X: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N),); all M rows, BLOCK_N output columns
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    n = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = n < N

    # pass 1: sum of squares of each new residual row; program 0 also writes the new residual
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols[None, :] < D)
        r = _new_residual(x_ptr, res_ptr, stride_x, stride_res, rows, cols, mask, HAS_X)
        if pid == 0:
            tl.store(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :],
                     r.to(res_out_ptr.dtype.element_ty), mask=mask)
        sq += tl.sum(r * r, axis=1)
    rstd = tl.rsqrt(sq / D + eps)  # padded rows: rsqrt(eps), times zeros

    # pass 2: the same rows again, normalised in registers, against this program's weight rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_mask = cols < D
        r = _new_residual(x_ptr, res_ptr, stride_x, stride_res, rows, cols,
                          row_mask[:, None] & col_mask[None, :], HAS_X)
        acc = _norm_dot(acc, r, rstd, wn_ptr, w_ptr, stride_w, n, n_mask, cols, col_mask,
                        w_ptr.dtype.element_ty, PRECISION)

    tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _gated(y_ptr, z_ptr, stride_y, stride_z, rows, cols, mask):
    """y * silu(z) in fp32: [BLOCK_M, BLOCK_K]."""
    y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return y * z * tl.sigmoid(z)


@triton.jit
def _gated_norm_linear_kernel(
    y_ptr, z_ptr, wn_ptr, w_ptr, out_ptr,
    M, N, group_size, num_chunks, chunks_per_group, eps,
    stride_y, stride_z, stride_w, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N),); all M rows, BLOCK_N output columns.
    # Both passes walk one flat loop of chunks; chunk t covers columns of group t // chunks_per_group
    # only (the group's last chunk is masked at the group's end), so its norm is one column of a
    # [BLOCK_M, BLOCK_G] table, whatever the group size.
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    n = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = n < N
    groups = tl.arange(0, BLOCK_G)

    sq = tl.zeros([BLOCK_M, BLOCK_G], dtype=tl.float32)
    for t in range(0, num_chunks):
        g = t // chunks_per_group
        cols = g * group_size + (t % chunks_per_group) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols[None, :] < (g + 1) * group_size)
        h = _gated(y_ptr, z_ptr, stride_y, stride_z, rows, cols, mask)
        sq += tl.where(groups[None, :] == g, tl.sum(h * h, axis=1)[:, None], 0.0)
    rstd_table = tl.rsqrt(sq / group_size + eps)  # [BLOCK_M, BLOCK_G]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(0, num_chunks):
        g = t // chunks_per_group
        cols = g * group_size + (t % chunks_per_group) * BLOCK_K + tl.arange(0, BLOCK_K)
        col_mask = cols < (g + 1) * group_size
        h = _gated(y_ptr, z_ptr, stride_y, stride_z, rows, cols, row_mask[:, None] & col_mask[None, :])
        rstd = tl.sum(tl.where(groups[None, :] == g, rstd_table, 0.0), axis=1)
        acc = _norm_dot(acc, h, rstd, wn_ptr, w_ptr, stride_w, n, n_mask, cols, col_mask,
                        y_ptr.dtype.element_ty, PRECISION)

    tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


def _check(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None = None) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous, got strides {tuple(t.stride())}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected {dtype}, got {t.dtype}")


def _check_weight(weight: torch.Tensor, K: int, M: int, out: torch.Tensor) -> None:
    if M > MAX_ROWS:
        raise ValueError(f"{M} rows: the fused norm + linear takes at most {MAX_ROWS}; use a GEMM")
    if weight.dim() != 2 or weight.shape[1] != K or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous [N, {K}], got {list(weight.shape)} "
                         f"with strides {tuple(weight.stride())}")
    _check("out", out, (M, weight.shape[0]), weight.dtype)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    def span(t):
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else -1
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: any stand-in will do; an H200's count
    return torch.cuda.get_device_properties(device).multi_processor_count


def _blocks(N: int, span: int, weight: torch.Tensor) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for N output columns and chunks within ``span`` columns (a group).

    BLOCK_N: the widest of 64, 32, 16 that still gives >= 2 programs per SM; wider tiles re-read
    the activations fewer times, but too few programs leave SMs idle on the weight stream.
    BLOCK_K: up to 16 KB of weight per pipeline stage and 512 bytes of a weight row (bf16: 128
    columns of 64 rows, 256 of 32 or 16; fp32: 64 columns of 64 rows, 128 of 32 or 16), which
    keeps a program under ~75 KB of shared memory and 150 registers a thread, without spills
    (ptxas for sm_90a, compiled offline).
    """
    block_n = next((b for b in (64, 32) if triton.cdiv(N, b) >= 2 * _num_sms(weight.device)), 16)
    size = weight.element_size()
    block_k = min(512 // size, 16384 // (block_n * size))
    return block_n, max(16, min(block_k, triton.next_power_of_2(span)))


def _launch_options(weight: torch.Tensor) -> dict:
    # fp32 runs exact FMA dots; bf16/fp16 run tensor-core dots with fp32 accumulation.
    # 3 stages keep up to 48 KB of weight in flight per program (with the activations' chunks).
    return dict(PRECISION="ieee" if weight.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3)


def add_norm_linear_triton(x, residual, weight_norm, eps, weight, *, residual_out, out=None):
    """Triton launcher of :func:`add_norm_linear`. Grid ``(cdiv(N, BLOCK_N),)``."""
    M, D = residual.shape
    if out is None:
        out = torch.empty(M, weight.shape[0], dtype=weight.dtype, device=weight.device)
    _check("residual", residual, (M, D))
    _check("residual_out", residual_out, (M, D), residual.dtype)
    if x is not None:
        _check("x", x, (M, D))
    _check("weight_norm", weight_norm, (D,))
    _check_weight(weight, D, M, out)
    # other programs still read residual while program 0 writes residual_out
    if _overlap(residual, residual_out):
        raise ValueError("residual_out must not overlap residual")
    N = weight.shape[0]
    block_n, block_k = _blocks(N, D, weight)
    _add_norm_linear_kernel[(triton.cdiv(N, block_n),)](
        x if x is not None else residual, residual, residual_out, weight_norm, weight, out,
        M, N, D, eps,
        x.stride(0) if x is not None else 0, residual.stride(0), residual_out.stride(0),
        weight.stride(0), out.stride(0),
        HAS_X=x is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        **_launch_options(weight),
    )
    return out


def gated_norm_linear_triton(y, z, weight_norm, group_size, eps, weight, *, out=None):
    """Triton launcher of :func:`gated_norm_linear`. Grid ``(cdiv(N, BLOCK_N),)``."""
    M, K = y.shape
    if out is None:
        out = torch.empty(M, weight.shape[0], dtype=weight.dtype, device=weight.device)
    _check("y", y, (M, K))
    _check("z", z, (M, K), y.dtype)
    _check("weight_norm", weight_norm, (K,))
    _check_weight(weight, K, M, out)
    if group_size <= 0 or K % group_size:
        raise ValueError(f"group_size {group_size} does not divide {K}")
    N, G = weight.shape[0], K // group_size
    block_n, block_k = _blocks(N, group_size, weight)
    # a group_size (and row strides) divisible by 16, as in every Mamba2 model, lets Triton's
    # integer specialisation prove 16-byte alignment: vector loads, pipelined through cp.async
    chunks_per_group = triton.cdiv(group_size, block_k)
    _gated_norm_linear_kernel[(triton.cdiv(N, block_n),)](
        y, z, weight_norm, weight, out,
        M, N, group_size, G * chunks_per_group, chunks_per_group, eps,
        y.stride(0), z.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_G=triton.next_power_of_2(G),
        **_launch_options(weight),
    )
    return out


def _linear_ref(h, weight, out):
    o = F.linear(h.float(), weight.float())
    if out is None:
        return o.to(weight.dtype)
    return out.copy_(o)


def add_norm_linear_ref(x, residual, weight_norm, eps, weight, *, residual_out, out=None):
    """Plain fp32 torch reference; same contract as :func:`add_norm_linear`."""
    new_res = residual if x is None else (residual.float() + x.float()).to(residual.dtype)
    residual_out.copy_(new_res)
    r = new_res.float()
    y = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    h = (weight_norm.float() * y.to(weight.dtype).float()).to(weight.dtype)
    return _linear_ref(h, weight, out)


def gated_norm_linear_ref(y, z, weight_norm, group_size, eps, weight, *, out=None):
    """Plain fp32 torch reference; same contract as :func:`gated_norm_linear`."""
    M, K = y.shape
    g = (y.float() * F.silu(z.float())).view(M, K // group_size, group_size)
    g = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view(M, K)
    h = (weight_norm.float() * g.to(y.dtype).float()).to(weight.dtype)
    return _linear_ref(h, weight, out)


def add_norm_linear(x, residual, weight_norm, eps, weight, *, residual_out, out=None):
    """``out = rmsnorm(residual + x) @ weight.T``, the new residual written to ``residual_out``.

    x:            [M, D] the previous layer's output (any float dtype), or None: the residual is
                  normalised as it is
    residual:     [M, D] fp32 or the model dtype; read only
    weight_norm:  [D] the RMSNorm weight, any float dtype
    eps:          RMSNorm epsilon
    weight:       [N, D] contiguous, the model dtype (bf16, fp16 or fp32)
    residual_out: [M, D] residual's dtype, a buffer apart from ``residual``; receives
                  ``residual + x`` rounded to residual's dtype (a copy of ``residual`` when x is None)
    out:          [M, N] weight's dtype; allocated if None

    Rows are normalised in fp32, rounded to the model dtype, scaled by ``weight_norm`` and rounded
    again (as :func:`~mambastep.kernels.norm.rms_norm` with ``out`` in the model dtype), then
    multiplied with fp32 accumulation. CUDA tensors run the fused Triton kernel (M <= 16),
    CPU tensors the reference. Returns out.
    """
    fn = add_norm_linear_triton if residual.is_cuda else add_norm_linear_ref
    return fn(x, residual, weight_norm, eps, weight, residual_out=residual_out, out=out)


def gated_norm_linear(y, z, weight_norm, group_size, eps, weight, *, out=None):
    """``out = gated_rmsnorm(y, z) @ weight.T``: Mamba2's gated norm fused into out_proj.

    y, z:        [M, K] one dtype (row-strided views allowed, last dim contiguous)
    weight_norm: [K] the norm weight, any float dtype
    group_size:  columns per norm group; divides K
    eps:         RMSNorm epsilon
    weight:      [N, K] contiguous, the model dtype
    out:         [M, N] weight's dtype; allocated if None

    ``y * silu(z)`` is normalised per group in fp32, rounded to y's dtype, scaled by
    ``weight_norm`` and rounded to the model dtype (as
    :func:`~mambastep.kernels.norm.gated_rms_norm`), then multiplied with fp32 accumulation.
    CUDA tensors run the fused Triton kernel (M <= 16), CPU tensors the reference. Returns out.
    """
    fn = gated_norm_linear_triton if y.is_cuda else gated_norm_linear_ref
    return fn(y, z, weight_norm, group_size, eps, weight, out=out)
