"""A block projection's one entry, ``linear(x, weight, bias)``: the product chosen by the weight's
kind (a tensor, or an ``Fp8Weight``) and the number of rows.

- plain weights: ``F.linear`` (cuBLAS);
- FP8 weights, up to ``FEW_ROWS_MAX`` rows on CUDA: ``few_rows_linear``, the FP8 values read once
  and widened in registers (W8A16: at decode batches the weight read is the cost, and quantizing
  the rows first only adds launches);
- FP8 weights, more rows: ``fp8_linear`` (FP8 tensor cores, the rows quantized per token; the
  CPU's reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .few_rows import FEW_ROWS_MAX, few_rows_linear
from .fp8 import Fp8Weight, fp8_linear

__all__ = ["linear"]


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T + bias [N] -> [M, N] in x's dtype (see the module doc)."""
    if not isinstance(weight, Fp8Weight):
        return F.linear(x, weight, bias)
    if x.is_cuda and x.shape[0] <= FEW_ROWS_MAX:
        y = few_rows_linear(x if x.stride(1) == 1 else x.contiguous(), weight)
        return y if bias is None else y.add_(bias)
    return fp8_linear(x, weight, bias)
