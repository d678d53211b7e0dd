"""Token embeddings gathered straight into the residual stream: the first kernel of every step.

One kernel gathers the rows and casts them to the residual's dtype; in a fused decode step it is
launched as a programmatic dependent and signals its own dependents right after its wait
(``kernels.decode_linear``), so the first block's in_proj loads its weights meanwhile. It also
takes the token a decode row's slot drew last step where the row's id is -1: decode inputs never
make a host round trip.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import with_reference

__all__ = ["embed_rows", "embed_rows_ref"]


@triton.jit
def _embed_rows_kernel(ids_ptr, slots_ptr, drawn_ptr, table_ptr, out_ptr, D, first_decode, stride_t, stride_o, scale,
                       BLOCK: tl.constexpr, DRAWN: tl.constexpr, USE_PDL: tl.constexpr, SCALED: tl.constexpr):
    # grid: (rows, cdiv(D, BLOCK))
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.load(ids_ptr + row).to(tl.int64)
    if DRAWN:  # -1: the token the row's slot drew last step (a padding row's slot is -1: token 0)
        d = row - first_decode
        slot = tl.load(slots_ptr + tl.maximum(d, 0), mask=d >= 0, other=-1)
        take = (token < 0) & (slot >= 0)
        token = tl.where(take, tl.load(drawn_ptr + tl.maximum(slot, 0)), tl.maximum(token, 0))
    v = tl.load(table_ptr + token * stride_t + cols, mask=cols < D, other=0.0)
    if SCALED:  # in fp32, rounded once (HF: the embedding times the multiplier, in its dtype)
        v = (v.to(tl.float32) * scale).to(table_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, v.to(out_ptr.dtype.element_ty), mask=cols < D)


def _check(ids, table, out, slots, drawn):
    if ids.dim() != 1 or table.dim() != 2 or tuple(out.shape) != (ids.shape[0], table.shape[1]):
        raise ValueError(f"embed_rows: ids [T], table [V, D], out [T, D]; got {list(ids.shape)}, "
                         f"{list(table.shape)}, {list(out.shape)}")
    if table.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("embed_rows: table and out rows must be contiguous")
    if (slots is None) != (drawn is None):
        raise ValueError("embed_rows: slots and drawn come together")
    if slots is not None and (slots.dim() != 1 or slots.shape[0] > ids.shape[0]):
        raise ValueError(f"embed_rows: slots [B <= T] for the last B rows; got {list(slots.shape)} "
                         f"for T={ids.shape[0]}")


def embed_rows_ref(ids, table, out, pdl=False, slots=None, drawn=None, scale=1.0):
    _check(ids, table, out, slots, drawn)
    if drawn is not None:
        ids = ids.clone()
        dec = ids[ids.shape[0] - slots.shape[0]:]
        take = (dec < 0) & (slots >= 0)
        dec.copy_(torch.where(take, drawn[slots.clamp(min=0).long()], dec))
        ids.clamp_(min=0)
    rows = F.embedding(ids, table)
    return out.copy_(rows if scale == 1.0 else (rows.float() * scale).to(table.dtype))


@with_reference(embed_rows_ref)
def embed_rows(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor, pdl: bool = False,
               slots: torch.Tensor | None = None, drawn: torch.Tensor | None = None,
               scale: float = 1.0) -> torch.Tensor:
    """out[t] = table[ids[t]] (times ``scale``, rounded to table's dtype: Granite's and
    Falcon-H1's embedding multiplier), cast to out's dtype.

    ids: [T] int token ids (in range, or -1 in a decode row: the engine checks them on the way in);
    table: [V, D]; out: [T, D] (the residual stream, fp32 or table's dtype). pdl: launch as a
    programmatic dependent of the previous kernel (CUDA, sm_90+). slots [B] and drawn [S],
    together: the last B rows are decode rows, and one whose id is -1 takes drawn[slots[b]], the
    token its slot drew last step (a row whose slot is -1 takes token 0); ids stay as they are.
    """
    _check(ids, table, out, slots, drawn)
    T, D = out.shape
    if T:
        block = min(1024, triton.next_power_of_2(D))
        with_drawn = drawn is not None
        first_decode = T - slots.shape[0] if with_drawn else T
        _embed_rows_kernel[(T, triton.cdiv(D, block))](
            ids, slots if with_drawn else ids, drawn if with_drawn else ids, table, out, D, first_decode,
            table.stride(0), out.stride(0), float(scale), BLOCK=block, DRAWN=with_drawn, USE_PDL=pdl,
            SCALED=scale != 1.0, num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )
    return out
