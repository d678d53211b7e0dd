"""Token embeddings gathered straight into the residual stream, for the fused decode path.

``F.embedding`` and the cast to the residual's dtype are two launches outside the chain of
programmatic dependent launches, so the first block's in_proj could not start loading its
weights until both had finished. One kernel here gathers and casts; launched as a programmatic
dependent, it signals its own dependents right after its wait (``kernels.decode_linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["embed_rows", "embed_rows_triton", "embed_rows_ref"]


@triton.jit
def _embed_rows_kernel(ids_ptr, table_ptr, out_ptr, D, stride_t, stride_o, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr):
    # grid: (rows, cdiv(D, BLOCK))
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.load(ids_ptr + row).to(tl.int64)
    v = tl.load(table_ptr + token * stride_t + cols, mask=cols < D, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, v.to(out_ptr.dtype.element_ty), mask=cols < D)


def _check(ids, table, out):
    if ids.dim() != 1 or table.dim() != 2 or tuple(out.shape) != (ids.shape[0], table.shape[1]):
        raise ValueError(f"embed_rows: ids [T], table [V, D], out [T, D]; got {list(ids.shape)}, "
                         f"{list(table.shape)}, {list(out.shape)}")
    if table.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("embed_rows: table and out rows must be contiguous")


def embed_rows_triton(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    _check(ids, table, out)
    T, D = out.shape
    if T:
        block = min(1024, triton.next_power_of_2(D))
        _embed_rows_kernel[(T, triton.cdiv(D, block))](
            ids, table, out, D, table.stride(0), out.stride(0), BLOCK=block, USE_PDL=pdl, num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )
    return out


def embed_rows_ref(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    _check(ids, table, out)
    return out.copy_(F.embedding(ids, table))


def embed_rows(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """out[t] = table[ids[t]], cast to out's dtype.

    ids: [T] int token ids (in range: the engine checks them on the way in); table: [V, D];
    out: [T, D] (the residual stream, fp32 or table's dtype). pdl: launch as a programmatic
    dependent of the previous kernel (CUDA, sm_90+).
    """
    return (embed_rows_triton if ids.is_cuda else embed_rows_ref)(ids, table, out, pdl)
