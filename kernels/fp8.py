"""FP8 (e4m3) weights: the stored form, quantizing and dequantizing, and a linear over them.

A quantized weight is its float8_e4m3fn values and fp32 scales, ``W = values * scale``, with one
of two scale layouts:

- per output column (``block == 0``): ``scale [..., N]``. A checkpoint's per-tensor scale
  (ModelOpt's FP8) is this with every entry equal, and projections concatenated along N (q, k, v)
  keep their own scales side by side;
- per ``block x block`` tile (``block > 0``, 128 in the checkpoints people ship):
  ``scale [..., ceil(N / block), ceil(K / block)]``, the community FP8 format's
  ``weight_scale_inv`` (multiplied, despite its name).

Where the products run, by what bounds them (``kernels.linear`` picks):

- a few rows read weights: the skinny decode projections (``kernels.decode_linear``), the grouped
  MoE GEMMs (``kernels.moe``) and the few-row product (``kernels.few_rows``) stream the FP8
  values and widen them in registers, so the bytes halve and the activations stay in their
  dtype (W8A16);
- wider products on CUDA with bf16/fp16 activations and column scales run here on FP8 tensor
  cores (``fp8_linear``: ``torch._scaled_mm``): the activations are quantized per token
  (dynamic) or with the checkpoint's static ``input_scale``, the output scaled per row and
  column (W8A8);
- anything else (fp32 activations, block scales in a wide product) dequantizes the weight into a
  temporary and runs the plain product: exact, not fast.

The reference (``fp8_linear_ref``, the CPU path) is the dequantized weight's product in fp32,
what HF computes on the dequantized checkpoint.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import with_reference

__all__ = ["FP8_MAX", "Fp8Rows", "Fp8Weight", "quantize_fp8", "fp8_linear", "fp8_linear_ref", "quantize_rows",
           "quantize_rows_ref", "runs_w8a8", "takes_rows", "walks_rows", "write_rows_ref"]

# the largest finite float8_e4m3fn
FP8_MAX = 448.0


class Fp8Weight(NamedTuple):
    """values: [..., N, K] float8_e4m3fn; scale: fp32, [..., N] (block 0) or
    [..., ceil(N / block), ceil(K / block)]; input_scale: the checkpoint's static activation scale
    (an fp32 scalar tensor) or None (activations quantized per token where they are at all)."""

    values: torch.Tensor
    scale: torch.Tensor
    block: int = 0
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        """Bytes a full read of the weight moves (values and scales)."""
        return self.values.numel() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """values * scale in fp32, rounded once to ``dtype``."""
        return (self.values.float() * self.expanded_scale()).to(dtype)

    def expanded_scale(self) -> torch.Tensor:
        """The scale of every element, broadcastable to ``values``: [..., N, 1] or [..., N, K]."""
        if not self.block:
            return self.scale.unsqueeze(-1)
        return _blocks_to_elements(self.scale, self.block, *self.values.shape[-2:])

    def expert(self, e: int) -> "Fp8Weight":
        """Expert e of a stacked [E, N, K] weight."""
        return Fp8Weight(self.values[e], self.scale[e], self.block, self.input_scale)

    @staticmethod
    def cat(parts: list["Fp8Weight"]) -> "Fp8Weight":
        """Weights stacked along N (q, k and v into one projection), each keeping its scales. Block
        scales need every part but the last to end on a block boundary; static input scales are
        merged to their largest (no activation then saturates where its own part's would not)."""
        block = parts[0].block
        if any(p.block != block for p in parts):
            raise ValueError("Fp8Weight.cat: parts with different scale layouts")
        if block and any(p.shape[-2] % block for p in parts[:-1]):
            raise ValueError(f"Fp8Weight.cat: block scales need parts of whole {block}-row blocks, got "
                             f"{[p.shape[-2] for p in parts]}")
        dim = -1 if not block else -2
        statics = [p.input_scale for p in parts if p.input_scale is not None]
        if statics and len(statics) != len(parts):
            raise ValueError("Fp8Weight.cat: some parts have a static input scale and some do not")
        input_scale = torch.stack(statics).amax() if statics else None
        return Fp8Weight(torch.cat([p.values for p in parts], dim=-2), torch.cat([p.scale for p in parts], dim=dim),
                         block, input_scale)

    def to(self, device) -> "Fp8Weight":
        return Fp8Weight(self.values.to(device), self.scale.to(device), self.block,
                         None if self.input_scale is None else self.input_scale.to(device))


class Fp8Rows(NamedTuple):
    """Activation rows quantized per row (W8A8's left side): values [M, K] float8_e4m3fn and
    scale [M, 1] fp32, the row being values * scale; as ``quantize_rows`` makes them, or the
    kernel that made the rows (``kernels.norm.rms_norm``'s ``rows``), to the bit the same."""

    values: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def empty(M: int, K: int, device) -> "Fp8Rows":
        return Fp8Rows(torch.empty(M, K, dtype=torch.float8_e4m3fn, device=device),
                       torch.empty(M, 1, dtype=torch.float32, device=device))

    def check(self, name: str, M: int, K: int) -> None:
        """A ValueError naming ``name`` unless these are rows of an [M, K] input as the kernels read
        them: float8_e4m3fn values [M, K] (the last dimension contiguous), fp32 scales [M, 1]."""
        v, s = self
        if (v.dtype != torch.float8_e4m3fn or tuple(v.shape) != (M, K) or v.stride(1) != 1
                or s.dtype != torch.float32 or tuple(s.shape) != (M, 1) or s.stride(0) != 1):
            raise ValueError(f"{name} must be float8_e4m3fn values [{M}, {K}] (the last dimension contiguous) and "
                             f"float32 scales [{M}, 1]; got {v.dtype} {list(v.shape)} (strides {list(v.stride())}) "
                             f"and {s.dtype} {list(s.shape)}")


def _blocks_to_elements(scale: torch.Tensor, block: int, N: int, K: int) -> torch.Tensor:
    """Block scales [..., nb, kb] as one scale per element, [..., N, K]."""
    s = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return s[..., :N, :K]


def _over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / FP8_MAX, correctly rounded on every device: torch on CUDA divides by a Python
    number as a product with its reciprocal, which may differ in the last bit (a divisor made
    where amax is, without a copy from the host, divides)."""
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_fp8(w: torch.Tensor, block: int = 0) -> Fp8Weight:
    """Quantize w [..., N, K] to FP8: a scale per output column (block 0), or per block x block
    tile, each its slice's absolute maximum over FP8_MAX (1 where the slice is all zeros)."""
    w32 = w.float()
    if not block:
        scale = _over_fp8_max(w32.abs().amax(dim=-1))
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return Fp8Weight((w32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale)
    *lead, N, K = w32.shape
    nb, kb = -(-N // block), -(-K // block)
    padded = F.pad(w32, (0, kb * block - K, 0, nb * block - N))
    tiles = padded.reshape(*lead, nb, block, kb, block)
    scale = _over_fp8_max(tiles.abs().amax(dim=(-3, -1)))
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    full = _blocks_to_elements(scale, block, N, K)
    return Fp8Weight((w32 / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale, block)


# the smallest row scale: an all-zero row quantizes to zeros, not NaNs
_MIN_SCALE = 1e-12

# The norms that write their output quantized per row beside it (``Fp8Rows``) hold a whole row
# in registers, a program a row, up to this many rows: one wave of programs, no row waiting on
# another. Past it (a prefill chunk) the block norm walks its row again in tiles to quantize
# what it wrote (from L1/L2), and the gated norm splits into its kernel without rows and a
# quantizing launch (``kernels.norm``): smaller programs, more of them resident on an SM. Timed
# (H100, docs/experiments.md): walking took 4-6% off the 8B's and 9B-v2's FP8 prefill, and
# walking at 4-64 rows added 4-11% to their decode steps (a program a row cannot fill the SMs).
WHOLE_ROW_MAX_ROWS = 256


def walks_rows(M: int) -> bool:
    """Whether a norm writing M rows quantized goes past holding each row in registers
    (``WHOLE_ROW_MAX_ROWS``)."""
    return M > WHOLE_ROW_MAX_ROWS


@triton.jit
def _quantize_rows_kernel(x_ptr, s_in_ptr, q_ptr, s_ptr, end_ptr, K, stride_x, stride_q,
                          STATIC: tl.constexpr, HAS_END: tl.constexpr, ONE_TILE: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program a row: its absolute maximum (unless STATIC), then the row scaled and rounded.
    # ONE_TILE: the row fits BLOCK_K columns, read once and held in registers; else it is read
    # twice (the second pass from L2). HAS_END: rows at and past end_ptr's value are left alone.
    row = tl.program_id(0)
    if HAS_END:
        rows_in_use = tl.load(end_ptr)
    else:
        rows_in_use = row + 1
    if row < rows_in_use:
        x_row = x_ptr + row.to(tl.int64) * stride_x
        q_row = q_ptr + row.to(tl.int64) * stride_q
        ks = tl.arange(0, BLOCK_K)
        if ONE_TILE:
            v = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            if STATIC:
                scale = tl.load(s_in_ptr)
            else:
                scale = row_scale(v)
            tl.store(s_ptr + row, scale)
            store_quantized(q_row + ks, v, scale, ks < K)
        else:
            if STATIC:
                scale = tl.load(s_in_ptr)
            else:
                amax = tl.zeros([BLOCK_K], tl.float32)
                for k in range(0, K, BLOCK_K):
                    v = tl.load(x_row + k + ks, mask=k + ks < K, other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.abs(v))
                scale = row_scale(amax)
            tl.store(s_ptr + row, scale)
            for k in range(0, K, BLOCK_K):
                v = tl.load(x_row + k + ks, mask=k + ks < K, other=0.0).to(tl.float32)
                store_quantized(q_row + k + ks, v, scale, k + ks < K)


@triton.jit
def row_scale(v):
    """A row's dynamic FP8 scale from its values v [K] in fp32 (zeros past its end): its
    absolute maximum over 448 (correctly rounded, as torch divides), at least 1e-12."""
    return tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=0), 448.0), 1e-12)


@triton.jit
def store_quantized(q_ptrs, v, scale, mask):
    """v / scale (correctly rounded, as torch divides), saturated at +-448, stored as FP8."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def store_chunk_quantized(q_ptrs, v, mask, amax_ptr, s_ptr, row, CHUNKS: tl.constexpr):
    """A chunk v of a row (the program's along grid axis 1; fp32) quantized at the row's scale,
    made from every chunk's absolute maximum (``amax_ptr`` [rows, chunks] fp32, from a launch
    before): the maximum of the maxima is the row's, so the scale is ``row_scale``'s of the whole
    row. The row's first chunk stores it. CHUNKS: the chunks a row, rounded up to a power of two."""
    n = tl.num_programs(1)
    c = tl.arange(0, CHUNKS)
    scale = row_scale(tl.load(amax_ptr + row * n + c, mask=c < n, other=0.0))
    if tl.program_id(1) == 0:
        tl.store(s_ptr + row, scale)
    store_quantized(q_ptrs, v, scale, mask)


def quantize_rows_ref(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                      row_end: torch.Tensor | None = None) -> Fp8Rows:
    x32 = x.float()
    if input_scale is None:
        scale = _over_fp8_max(x32.abs().amax(dim=1, keepdim=True)).clamp(min=_MIN_SCALE)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return Fp8Rows((x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale)


def write_rows_ref(rows: Fp8Rows | None, x: torch.Tensor) -> None:
    """The references of the kernels that write their output quantized beside it: x [M, K]
    quantized per row into ``rows`` as ``quantize_rows_ref`` makes it (None: nothing asked)."""
    if rows is not None:
        for dst, src in zip(rows, quantize_rows_ref(x)):
            dst.copy_(src)


@with_reference(quantize_rows_ref)
def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                  row_end: torch.Tensor | None = None) -> Fp8Rows:
    """x [M, K] (rows contiguous) as FP8 values [M, K] and fp32 row scales [M, 1]: each row's
    absolute maximum over FP8_MAX (per token, dynamic), or the static ``input_scale`` (an fp32
    scalar tensor) for every row, values saturated there. One kernel, one pass over x where a
    row fits a tile (else two, the second from L2). ``row_end``: an int32 device scalar, the rows
    in use (a sorted MoE layout's end of its last run, ``kernels.moe``): the kernel leaves the
    rows past it unwritten (the reference quantizes them all)."""
    M, K = x.shape
    if x.stride(1) != 1:
        raise ValueError("quantize_rows: x's rows must be contiguous")
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        block = min(4096, triton.next_power_of_2(K))
        _quantize_rows_kernel[(M,)](x, input_scale if input_scale is not None else scale, q, scale,
                                    row_end if row_end is not None else scale, K, x.stride(0), q.stride(0),
                                    STATIC=input_scale is not None, HAS_END=row_end is not None,
                                    ONE_TILE=K <= block, BLOCK_K=block, num_warps=8 if block >= 2048 else 4)
    return Fp8Rows(q, scale)


def fp8_linear_ref(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                   rows: Fp8Rows | None = None) -> torch.Tensor:
    """x @ dequantize(w).T + bias in fp32, rounded to x's dtype (``rows``, which only spare the
    kernel a launch, unread)."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w.dequantize(), b).to(x.dtype)


def _scaled_mm_fits(x_dtype: torch.dtype, w: Fp8Weight) -> bool:
    N, K = w.shape
    return not w.block and x_dtype in (torch.bfloat16, torch.float16) and N % 16 == 0 and K % 16 == 0


def runs_w8a8(x_dtype: torch.dtype, w: Fp8Weight) -> bool:
    """Whether ``fp8_linear`` multiplies x of ``x_dtype`` by w on the FP8 tensor cores (W8A8: w
    scaled per column, bf16/fp16 activations quantized per token or with w's static
    ``input_scale``), where its output is not the dequantized product."""
    return _scaled_mm_fits(x_dtype, w)


def takes_rows(x_dtype: torch.dtype, w: Fp8Weight) -> bool:
    """Whether ``fp8_linear`` over x of ``x_dtype`` on CUDA quantizes x per row (dynamic scales:
    then it takes them made already, its ``rows``)."""
    return _scaled_mm_fits(x_dtype, w) and w.input_scale is None


@with_reference(fp8_linear_ref)
def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
               rows: Fp8Rows | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ dequantize(w [N, K]).T + bias [N] -> [M, N] in x's dtype.

    Column-scaled weights with bf16/fp16 activations run on FP8 tensor cores (activations
    quantized per token, or with ``w.input_scale``); otherwise the weight is dequantized into a
    temporary first. ``rows``: x quantized per row already (``quantize_rows(x)``, made by x's
    producer), used where the product quantizes per token (``takes_rows``), else unread.
    Capturable: no host sync.
    """
    if not _scaled_mm_fits(x.dtype, w):
        return F.linear(x, w.dequantize(x.dtype), bias)
    if rows is not None:
        rows.check("fp8_linear: rows", *x.shape)
    q, q_scale = rows if rows is not None and w.input_scale is None else quantize_rows(x, w.input_scale)
    y = torch._scaled_mm(q, w.values.t(), scale_a=q_scale, scale_b=w.scale.view(1, -1).float(),
                         out_dtype=x.dtype)
    return y if bias is None else y.add_(bias)
