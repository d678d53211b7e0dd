"""The MLP activations, each one pass in fp32: relu(x)^2 (NemotronH's, in place when ``out`` is
``x``; its rows quantized beside it for an FP8 down projection where asked) and silu(gate) * up
(SwiGLU: Granite, Bamba, Falcon-H1), whose input is one projection's output with the gate
columns first, as those checkpoints store it; and the same product over two tensors,
``y * silu(z)`` (Falcon-H1's Mamba2 output gate, where no gated norm follows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import with_reference
from .fp8 import Fp8Rows, store_chunk_quantized, write_rows_ref

__all__ = ["gate_silu", "gate_silu_ref", "relu2", "relu2_ref", "silu_mul", "silu_mul_ref"]

RELU2_BLOCK = 2048  # elements a program of relu2 takes at a time
# relu2 with rows: each row in RELU2_CHUNK-column chunks, a program each, in two launches (relu2
# and the chunks' maxima; then the rows' scales and quantized chunks). Against a program a row
# (holding the row up to 256 rows, past them walking it twice), H100: the 8B's FP8 decode 4 4.5%
# faster; Nemotron-Nano-9B-v2's decode 64 -0.9%, its mixed step of 64 + 223 rows -2.4%, its
# 2048-token prefill +0.6% (docs/experiments.md)
RELU2_CHUNK = 1024


@triton.jit
def _relu2_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.maximum(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
    tl.store(out_ptr + offs, (x * x).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _relu2_chunk(x_ptr, row, cols, mask, I, dtype: tl.constexpr):
    """relu(x)**2 of a row's columns, rounded to dtype."""
    x = tl.maximum(tl.load(x_ptr + row * I + cols, mask=mask, other=0.0).to(tl.float32), 0.0)
    return (x * x).to(dtype)


@triton.jit
def _relu2_chunks_kernel(x_ptr, out_ptr, amax_ptr, I, BLOCK: tl.constexpr, WRITE_OUT: tl.constexpr):
    # grid: (rows, chunks): a chunk's relu2 (stored where WRITE_OUT), and its maximum (amax_ptr
    # [rows, chunks])
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    y = _relu2_chunk(x_ptr, row, cols, mask, I, out_ptr.dtype.element_ty)
    if WRITE_OUT:
        tl.store(out_ptr + row * I + cols, y, mask=mask)
    tl.store(amax_ptr + row * tl.num_programs(1) + tl.program_id(1), tl.max(y.to(tl.float32), axis=0))


@triton.jit
def _quantize_chunks_kernel(v_ptr, amax_ptr, q_ptr, s_ptr, I, stride_q, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                            FROM_X: tl.constexpr):
    # grid: (rows, chunks): the chunk quantized at its row's scale, from relu2's out, or (FROM_X)
    # from x, relu2 made again
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    if FROM_X:
        v = _relu2_chunk(v_ptr, row, cols, mask, I, v_ptr.dtype.element_ty).to(tl.float32)
    else:
        v = tl.load(v_ptr + row * I + cols, mask=mask, other=0.0).to(tl.float32)
    store_chunk_quantized(q_ptr + row * stride_q + cols, v, mask, amax_ptr, s_ptr, row, CHUNKS)


def relu2_ref(x: torch.Tensor, out: torch.Tensor | None = None, rows: Fp8Rows | None = None,
              rows_only: bool = False) -> torch.Tensor:
    y = torch.relu(x.float()).square().to(x.dtype)
    out = y if out is None else out.copy_(y)
    write_rows_ref(rows, out)
    return out


@with_reference(relu2_ref)
def relu2(x: torch.Tensor, out: torch.Tensor | None = None, rows: Fp8Rows | None = None,
          rows_only: bool = False) -> torch.Tensor:
    """relu(x)**2 computed in fp32. x: any shape, contiguous; out: like x (may be x). rows: x
    [M, I] written quantized per row too (``Fp8Rows`` [M, I]), as ``quantize_rows(out)`` would
    make it, for an FP8 product that takes them (``kernels.linear.takes_rows``): a program a
    chunk of a row, in two launches. rows_only: only the rows are wanted (the product reads
    nothing else), so out may be left unwritten: the kernels leave it, the second launch making
    relu2 again from x (where out is x, x is left as it was); the reference writes it."""
    out = torch.empty_like(x) if out is None else out
    if not (x.is_contiguous() and out.is_contiguous() and out.shape == x.shape):
        raise ValueError("relu2: x and out must be contiguous and of one shape")
    if rows is not None:
        if x.dim() != 2:
            raise ValueError(f"relu2: rows asked of a {x.dim()}-D x (they need [M, I])")
        rows.check("relu2: rows", *x.shape)
        M, I = x.shape
        chunks = triton.cdiv(I, RELU2_CHUNK)
        amax = torch.empty(M, chunks, dtype=torch.float32, device=x.device)
        _relu2_chunks_kernel[(M, chunks)](x, out, amax, I, BLOCK=RELU2_CHUNK, WRITE_OUT=not rows_only, num_warps=4)
        _quantize_chunks_kernel[(M, chunks)](x if rows_only else out, amax, rows.values, rows.scale, I,
                                             rows.values.stride(0), BLOCK=RELU2_CHUNK,
                                             CHUNKS=triton.next_power_of_2(chunks), FROM_X=rows_only, num_warps=4)
        return out
    n = x.numel()
    _relu2_kernel[(triton.cdiv(n, RELU2_BLOCK),)](x, out, n, BLOCK=RELU2_BLOCK, num_warps=4)
    return out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, I, stride_g, stride_u, stride_out, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    # grid: (rows, cdiv(I, BLOCK)): out = silu(g) * u, row by row
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    if USE_PDL:  # the inputs are the previous kernel's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    g = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    # silu(g) rounded as HF's act_fn(gate) before the product with up, then the product rounded
    s = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (s * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul_ref(x: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return gate_silu_ref(up, gate, out)


@with_reference(silu_mul_ref)
def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """silu(gate) * up of x = [gate | up]: x [T, 2I] (rows contiguous) -> out [T, I], in fp32,
    silu(gate) rounded to out's dtype before the product as HF's two ops. pdl: launch as a
    programmatic dependent of the previous kernel (``kernels.decode_linear``); it signals its
    own dependents right after its wait."""
    T, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"silu_mul: x [T, 2I], got {list(x.shape)}")
    I = two_i // 2
    return gate_silu.triton(x[:, I:], x[:, :I], out, pdl)


def gate_silu_ref(y: torch.Tensor, z: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False):
    h = F.silu(z.float()).to(y.dtype).float() * y.float()
    return h.to(y.dtype) if out is None else out.copy_(h)


@with_reference(gate_silu_ref)
def gate_silu(y: torch.Tensor, z: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """y * silu(z): y, z [T, I] (row-strided views allowed) -> out [T, I] in y's dtype, silu(z)
    rounded to it before the product (HF's two ops). pdl: as ``silu_mul``'s."""
    T, I = y.shape
    out = torch.empty(T, I, dtype=y.dtype, device=y.device) if out is None else out
    for name, t in (("y", y), ("z", z), ("out", out)):
        if t.shape != (T, I) or t.stride(1) != 1:
            raise ValueError(f"gate_silu: {name} must be [{T}, {I}] with contiguous rows, got {list(t.shape)}")
    if T:
        block = min(1024, triton.next_power_of_2(I))
        _silu_mul_kernel[(T, triton.cdiv(I, block))](z, y, out, I, z.stride(0), y.stride(0), out.stride(0),
                                                      BLOCK=block, USE_PDL=pdl, num_warps=4,
                                                      **({"launch_pdl": True} if pdl else {}))
    return out
