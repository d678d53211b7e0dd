"""A block projection's one entry, ``linear(x, weight, bias)``: the product chosen by the weight's
kind (a tensor, or an ``Fp8Weight``) and the number of rows.

- plain weights: ``F.linear`` (cuBLAS);
- FP8 weights beside bf16/fp16 activations on CUDA, by rows (swept on Nemotron-H-8B's
  projections on an H200, docs/experiments.md; at 32 rows the few-row product lost to the
  tensor-core path): up to ``SKINNY_MAX_ROWS`` the skinny decode
  projection (``kernels.decode_linear``), up to ``FEW_ROWS_FP8_MAX`` the few-row tensor-core
  product (``kernels.few_rows``), both W8A16, the FP8 values read once and widened in
  registers, where quantizing the rows first only adds a launch; more rows, ``fp8_linear`` (FP8
  tensor cores, the rows quantized per token: W8A8);
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
from .fp8 import Fp8Rows, Fp8Weight, fp8_linear
from .fp8 import takes_rows as _fp8_takes_rows

__all__ = ["linear", "takes_rows"]

SKINNY_MAX_ROWS = 2
FEW_ROWS_FP8_MAX = 8


def takes_rows(M: int, dtype: torch.dtype, device: torch.device, weight) -> bool:
    """Whether ``linear`` over M rows of ``dtype`` on ``device`` quantizes them per row (FP8
    tensor cores, dynamic scales), and so takes them quantized already as ``rows``."""
    return (isinstance(weight, Fp8Weight) and device.type == "cuda" and M > FEW_ROWS_FP8_MAX
            and _fp8_takes_rows(dtype, weight))


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, rows: Fp8Rows | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T + bias [N] -> [M, N] in x's dtype (see the module doc). rows:
    x quantized per row (``quantize_rows(x)``), read where the product would make them
    (``takes_rows``), else unread."""
    if not isinstance(weight, Fp8Weight):
        return F.linear(x, weight, bias)
    M = x.shape[0]
    if not x.is_cuda or x.dtype == torch.float32 or M > FEW_ROWS_FP8_MAX:
        return fp8_linear(x, weight, bias, rows)
    x = x if x.stride(1) == 1 else x.contiguous()
    if M <= SKINNY_MAX_ROWS:
        return norm_linear(x, None, 0.0, weight, bias=bias)
    y = few_rows_linear(x, weight)
    return y if bias is None else y.add_(bias)
