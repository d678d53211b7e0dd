"""Helpers shared by the tests: poisoned buffers and error measures."""

import torch


def poisoned(shape, dtype=torch.float32, device="cpu"):
    """A fresh buffer full of NaN (or the most negative int), so an unwritten element shows."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


def rel_err(out, ref) -> float:
    """Relative RMS error ||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def tol(dtype) -> float:
    """Relative RMS tolerance by dtype: fp32 math far under 1e-3, bf16 operands near 1e-2."""
    return {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]


def assert_close(out, ref, dtype=torch.float32, factor=1.0):
    err = rel_err(out, ref)
    assert err <= tol(dtype) * factor, f"relative error {err:.3e} > {tol(dtype) * factor:.1e}"
