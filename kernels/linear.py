"""A block projection's one entry, ``linear(x, weight, bias)``: the product chosen by the weight's
kind (a tensor, or an ``Fp8Weight``) and the number of rows.

- plain weights: on CUDA up to ``FEW_ROWS_PLAIN_MAX`` rows over at least ``FEW_ROWS_PLAIN_MIN_N``
  columns, the few-row product with the weight's rows as the tensor cores' 64-row side; up to
  ``SHORT_SKINNY_MAX`` rows over fewer columns, the skinny decode projection; otherwise
  ``F.linear`` (cuBLAS);
- FP8 weights beside bf16/fp16 activations on CUDA, by rows (swept on Nemotron-H-8B's
  projections on an H200, docs/experiments.md; at 32 rows the W8A16 few-row product lost to
  cuBLAS's FP8 tensor cores): up to ``SKINNY_MAX_ROWS`` the skinny decode
  projection (``kernels.decode_linear``), W8A16, the FP8 values read once and widened in
  registers, where quantizing the row first only adds a launch; up to ``FEW_ROWS_FP8_MAX`` the
  few-row tensor-core product (``kernels.few_rows``), W8A16; or, for weights scaled per column
  (``FEW_ROWS_W8A8``), the few-row W8A8 product up to ``FEW_ROWS_W8A8_MAX``, the rows quantized
  per token (dynamic) or at the checkpoint's static ``input_scale`` (ModelOpt's); more rows,
  ``fp8_linear`` (FP8 tensor cores through cuBLAS, the rows quantized the same way: W8A8);
- FP8 weights otherwise (fp32 activations, the CPU): ``fp8_linear``, the dequantized product.

Where the product quantizes its rows per token (``takes_rows``), the kernel that made them may
have quantized them already (``kernels.norm.rms_norm``'s ``rows``): passed as ``rows``, they
spare the product the quantizer's launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .decode_linear import norm_linear
from .few_rows import few_rows_linear
from .fp8 import Fp8Rows, Fp8Weight, fp8_linear, quantize_rows, runs_w8a8
from .fp8 import takes_rows as _fp8_takes_rows

__all__ = ["linear", "takes_rows"]

SKINNY_MAX_ROWS = 2
FEW_ROWS_FP8_MAX = 8
# the few-row products of FP8 weights take their rows quantized (W8A8: the FP8 tensor cores, no
# widening in the K loop), and then up to FEW_ROWS_W8A8_MAX rows, where cuBLAS's FP8 products of a
# few rows read no faster than bf16 (docs/experiments.md)
FEW_ROWS_W8A8 = True
FEW_ROWS_W8A8_MAX = 64
# plain bf16/fp16 weights: up to this many rows, over at least FEW_ROWS_PLAIN_MIN_N columns, the
# few-row product with the weight's rows as the tensor cores' 64-row side
# (``few_rows_linear(weight_rows=True)``), else cuBLAS: up to 7% off the projections of 6144 columns
# and more; on 2048-4096 columns (64 programs or fewer, no split K) it is 1.0-1.34x slower
# (H100, docs/experiments.md)
FEW_ROWS_PLAIN_MAX = 8
FEW_ROWS_PLAIN_MIN_N = 6144
# and on fewer columns, up to this many rows, the skinny decode projection (``norm_linear`` without
# a norm), whose programs of a few columns each fill the SMs where cuBLAS's do not: whole steps at 3
# and 4 rows 1.6-1.9% faster (Granite-4.0-H-micro, Nemotron-H-8B), at 5-8 rows 3-8% slower (its
# tiles for over 4 rows; H100, docs/experiments.md); 0: cuBLAS
SHORT_SKINNY_MAX = 4


def takes_rows(M: int, dtype: torch.dtype, device: torch.device, weight) -> bool:
    """Whether ``linear`` over M rows of ``dtype`` on ``device`` quantizes them per row (FP8
    tensor cores, dynamic scales), and so takes them quantized already as ``rows``."""
    first = SKINNY_MAX_ROWS if FEW_ROWS_W8A8 else FEW_ROWS_FP8_MAX  # the rows past which it quantizes
    return (isinstance(weight, Fp8Weight) and device.type == "cuda" and M > first
            and _fp8_takes_rows(dtype, weight))


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, rows: Fp8Rows | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T + bias [N] -> [M, N] in x's dtype (see the module doc). rows:
    x quantized per row (``quantize_rows(x)``), read where the product would make them
    (``takes_rows``), else unread."""
    M = x.shape[0]
    if not isinstance(weight, Fp8Weight):
        if M > FEW_ROWS_PLAIN_MAX or not x.is_cuda or x.dtype != weight.dtype or x.dtype == torch.float32:
            return F.linear(x, weight, bias)
        x = x if x.stride(1) == 1 else x.contiguous()
        if weight.shape[0] < FEW_ROWS_PLAIN_MIN_N:
            return norm_linear(x, None, 0.0, weight, bias=bias) if M <= SHORT_SKINNY_MAX else F.linear(x, weight, bias)
        y = few_rows_linear(x, weight, weight_rows=True)
        return y if bias is None else y.add_(bias)
    w8a8 = FEW_ROWS_W8A8 and runs_w8a8(x.dtype, weight)
    if not x.is_cuda or x.dtype == torch.float32 or M > (FEW_ROWS_W8A8_MAX if w8a8 else FEW_ROWS_FP8_MAX):
        return fp8_linear(x, weight, bias, rows)
    x = x if x.stride(1) == 1 else x.contiguous()
    if M <= SKINNY_MAX_ROWS:
        return norm_linear(x, None, 0.0, weight, bias=bias)
    if w8a8:  # the rows at the static scale, or per token where x's maker did not quantize them
        if weight.input_scale is not None:
            rows = quantize_rows(x, weight.input_scale)
        elif rows is None:
            rows = quantize_rows(x)
        y = few_rows_linear(x, weight, rows=rows)
    else:
        y = few_rows_linear(x, weight)
    return y if bias is None else y.add_(bias)
