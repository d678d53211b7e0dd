"""Products of a few rows (up to 64) against a weight read once: ``x @ W.T``, bf16 or FP8 weights.

At decode batches of a few rows a projection still costs its weight read. For FP8 weights the
tensor-core path (``torch._scaled_mm``) first quantizes the rows, a launch of its own, and at a
few rows reads no faster than bf16 cuBLAS (docs/experiments.md). Here each program owns
``BN`` output columns and streams its ``[BN, K]`` slice of the weight in K tiles through the
tensor cores against all rows at once (a 16-64 row tile, the rows past M masked), FP8 values
widened to the activations' dtype in registers and their scales applied per column or per K
tile: W8A16, the weight's bytes read once; the tile product is the grouped MoE GEMM's
(``kernels.moe._tile_product``), over one expert. Given the rows quantized per row already
(``rows``, made by the kernel that wrote x), FP8 values of both sides go into the FP8 tensor
cores as stored and the sums are scaled by row and column: W8A8, no widening in the K loop
(column-scaled weights). There the weight's rows are the tensor cores' 64-row side and the few
rows the other (Hopper's FP8 instructions take 64 rows a side, and a 16-row side would widen
both to bf16); ``weight_rows`` runs bf16 weights so too.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import with_reference
from .fp8 import Fp8Rows, Fp8Weight
from .moe import _tile_product

__all__ = ["FEW_ROWS_MAX", "few_rows_linear", "few_rows_linear_ref"]

FEW_ROWS_MAX = 64


@triton.jit
def _few_rows_kernel(x_ptr, w_ptr, out_ptr, s_ptr, M, N, K, stride_x, stride_w, stride_out, stride_sn,
                     PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    rows = tl.arange(0, BM)
    one = tl.program_id(0) * 0  # the one expert, as a tensor
    _tile_product(x_ptr, rows, rows < M, rows, one, w_ptr, out_ptr, tl.program_id(0) * BN, N, K, stride_x, 0, stride_w,
                  stride_out, s_ptr, 0, stride_sn, False, PRECISION, BM, BN, BK, False, SCALE=SCALE,
                  SCALE_BLOCK=SCALE_BLOCK)


@triton.jit
def _weight_rows_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCALED: tl.constexpr):
    # out[:, BN columns] = x @ w.T: the program's weight rows [BN, BK] as the tensor cores' 64-row
    # side (a few rows alone cannot be: the Hopper instructions take 64), the rows [BM, BK] (those
    # past M masked) as the other, K streamed. SCALED: FP8 rows and weights (W8A8), the sums scaled
    # by row (xs_ptr) and column (ws_ptr)
    ns = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = ns < N
    ms = tl.arange(0, BM)
    m_ok = ms < M
    w_rows = w_ptr + ns[:, None].to(tl.int64) * stride_w
    x_rows = x_ptr + ms[:, None].to(tl.int64) * stride_x
    acc = tl.zeros((BN, BM), tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(a), acc)
    if SCALED:
        acc *= tl.load(ws_ptr + ns, mask=n_ok, other=0.0)[:, None]
        acc *= tl.load(xs_ptr + ms, mask=m_ok, other=0.0)[None, :]
    out = out_ptr + ms[None, :].to(tl.int64) * stride_out + ns[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def few_rows_linear_ref(x: torch.Tensor, weight, out: torch.Tensor | None = None, config=None,
                        rows: Fp8Rows | None = None) -> torch.Tensor:
    w = weight.dequantize() if isinstance(weight, Fp8Weight) else weight.float()
    a = x.float() if rows is None else rows.values.float() * rows.scale
    y = F.linear(a, w).to(x.dtype)
    return y if out is None else out.copy_(y)


# (block_n, block_k, warps, stages) with the weight's rows as the 64-row side, FP8 (W8A8) and bf16:
# 64 weight rows a program, the least one warpgroup takes; K tiles of 256 bytes a row, deeply
# pipelined, as the skinny stream's (untuned)
WEIGHT_ROWS_CONFIG = {True: (64, 256, 4, 4), False: (64, 128, 4, 4)}
# the stages by the grid (``weight_rows_config``): the sweeps' best tiles at 2 and 4 rows had 3
# stages where 4 left the grid two waves (the 8B's in_proj: 290 programs, two an SM at 4 stages,
# three at 3) and 6 where the grid is under one program an SM (out_proj: 64 programs); whole steps
# at 4-32 rows 1.7-4.3% faster, Nano's tied (H100, docs/experiments.md)
WEIGHT_ROWS_MOST_STAGES = 6


@functools.cache
def _shared_memory(device: torch.device) -> tuple[int, int]:
    """(SMs, shared-memory bytes an SM) of a CUDA device (0 bytes where torch does not say)."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, getattr(props, "shared_memory_per_multiprocessor", 0)


def weight_rows_config(M: int, N: int, fp8: bool, device: torch.device) -> tuple[int, int, int, int]:
    """The weight-rows product's (block_n, block_k, warps, stages) for M rows of an [N, K] weight on
    ``device``: the table's tile in the most stages (up to ``WEIGHT_ROWS_MOST_STAGES``) at which
    every program of the grid is resident at once (each stage holds a K tile of the weight's and
    the rows' bytes; the CUDA runtime keeps 1 KiB of an SM's shared memory a program); a grid
    past that at 3 stages, or off CUDA, the table's stages."""
    bn, bk, warps, stages = WEIGHT_ROWS_CONFIG[fp8]
    if device.type != "cuda":
        return bn, bk, warps, stages
    sms, shared = _shared_memory(device)
    stage_bytes = (bn + max(16, triton.next_power_of_2(M))) * bk * (1 if fp8 else 2)
    programs = triton.cdiv(N, bn)
    for s in range(WEIGHT_ROWS_MOST_STAGES, 2, -1):
        if programs <= sms * (shared // (s * stage_bytes + 1024)):
            return bn, bk, warps, s
    return bn, bk, warps, stages


def _config(fp8: bool) -> tuple[int, int, int, int]:
    """(block_n, block_k, warps, stages): narrow column blocks, so that even a short projection
    spreads over every SM, and long K tiles deeply pipelined (the sweep's best at 8 rows)."""
    return 32, 256 if fp8 else 128, 4, 4


@with_reference(few_rows_linear_ref)
def few_rows_linear(x: torch.Tensor, weight, out: torch.Tensor | None = None, config=None,
                    rows: Fp8Rows | None = None, weight_rows: bool = False) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, rows contiguous), M <= FEW_ROWS_MAX, @ weight [N, K] (plain, or an
    ``Fp8Weight``).T -> out [M, N] in x's dtype. config: (block_n, block_k, warps, stages) in
    place of the table's (benchmarks sweep it). rows: x quantized per row (``quantize_rows(x)``),
    read in x's place (W8A8; FP8 weights scaled per column), the weight's rows as the tensor cores'
    64-row side; weight_rows: plain bf16/fp16 weights so too (Hopper's wgmma)."""
    M, K = x.shape
    fp8 = isinstance(weight, Fp8Weight)
    values = weight.values if fp8 else weight
    N = values.shape[0]
    if M > FEW_ROWS_MAX or values.shape[1] != K or x.stride(1) != 1 or values.stride(1) != 1:
        raise ValueError(f"few_rows_linear: x [M <= {FEW_ROWS_MAX}, K] and weight [N, K] with contiguous rows, got "
                         f"{list(x.shape)} and {list(values.shape)}")
    if rows is not None:
        if not fp8 or weight.block:
            raise ValueError("few_rows_linear: quantized rows (W8A8) need FP8 weights scaled per column")
        rows.check("few_rows_linear: rows", M, K)
    if weight_rows and (fp8 or x.dtype not in (torch.bfloat16, torch.float16) or values.dtype != x.dtype):
        raise ValueError(f"few_rows_linear: weight_rows needs plain weights of x's dtype (bf16 or fp16), got "
                         f"{'FP8' if fp8 else values.dtype} and {x.dtype}")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bm = max(16, triton.next_power_of_2(M))
    if rows is not None or weight_rows:
        bn, bk, warps, stages = config or weight_rows_config(M, N, fp8, x.device)
        a, a_scale = rows if rows is not None else (x, x)
        _weight_rows_kernel[(triton.cdiv(N, bn),)](a, a_scale, values, weight.scale if fp8 else values, out, M, N, K,
                                                   a.stride(0), values.stride(0), out.stride(0), BM=bm, BN=bn, BK=bk,
                                                   SCALED=rows is not None, num_warps=warps, num_stages=stages)
        return out
    bn, bk, warps, stages = config or _config(fp8)
    scale, block = (weight.scale, weight.block) if fp8 else (values, 0)
    if block:
        bk = min(bk, block)
    mode = 0 if not fp8 else 2 if block else 1
    _few_rows_kernel[(triton.cdiv(N, bn),)](
        x, values, out, scale, M, N, K, x.stride(0), values.stride(0), out.stride(0),
        scale.stride(0) if mode == 2 else 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BM=bm, BN=bn, BK=bk,
        SCALE=mode, SCALE_BLOCK=block, num_warps=warps, num_stages=stages)
    return out
