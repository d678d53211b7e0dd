"""relu(x)^2 (NemotronH's MLP activation) in one pass, in place when ``out`` is ``x``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import with_reference

__all__ = ["relu2", "relu2_ref"]


@triton.jit
def _relu2_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.maximum(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
    tl.store(out_ptr + offs, (x * x).to(out_ptr.dtype.element_ty), mask=mask)


def relu2_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.relu(x.float()).square().to(x.dtype)
    return y if out is None else out.copy_(y)


@with_reference(relu2_ref)
def relu2(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """relu(x)**2 computed in fp32. x: any shape, contiguous; out: like x (may be x)."""
    out = torch.empty_like(x) if out is None else out
    if not (x.is_contiguous() and out.is_contiguous() and out.shape == x.shape):
        raise ValueError("relu2: x and out must be contiguous and of one shape")
    n, block = x.numel(), 2048
    _relu2_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block, num_warps=4)
    return out
