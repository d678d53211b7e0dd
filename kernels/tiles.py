"""Small Triton helpers shared by the decode kernels: one row of a register tile.

Triton has no indexing into a tile held in registers; a kernel that keeps ``BLOCK_M`` rows of
something loaded before its wait, and then works row by row, takes each row out with a masked
sum (a no-op at one row).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pick_row(t, m, BLOCK_M: tl.constexpr):
    """Row m of a [BLOCK_M, X] tile, as [1, X]."""
    if BLOCK_M == 1:
        return t
    rows = tl.arange(0, BLOCK_M)[:, None]
    return tl.sum(tl.where(rows == m, t, 0), axis=0)[None, :]


@triton.jit
def pick_row3(t, m, BLOCK_M: tl.constexpr):
    """Row m of a [BLOCK_M, X, Y] tile, as [1, X, Y]."""
    if BLOCK_M == 1:
        return t
    rows = tl.arange(0, BLOCK_M)[:, None, None]
    return tl.sum(tl.where(rows == m, t, 0), axis=0)[None, :, :]
