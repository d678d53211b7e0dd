"""Rotary position embedding of the packed ``[prefill | decode]`` tokens' queries and keys, in place.

Each token's position comes from the step's metadata, so nothing per token is uploaded: prefill
token t of sequence s sits at ``context_lens[s] + t - cu_seqlens[s]`` (after the chunks of its
prompt already in its slot), decode row b at ``kv_lens[b] - 1``. Tokens past the last sequence
and padding rows are left as they are (their attention writes zeros and reads no cache).

The rotation is HF's (GPT-NeoX's halves, ``rotate_half``) over the first ``2 * len(inv_freq)``
dims of every head, the rest passed through (partial rotary: Bamba rotates half of each head):
``x[:r/2] * cos - x[r/2:r] * sin`` and ``x[r/2:r] * cos + x[:r/2] * sin`` with angle
``position * inv_freq[i]`` in fp32, rounded once to the tensor's dtype (HF rounds cos and sin,
each product and the sum to bf16 in a bf16 model; equal in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import with_reference
from .varlen import PrefillMetadata

__all__ = ["rope", "rope_ref", "rope_inv_freq", "token_positions"]


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """HF's default inverse frequencies, ``1 / theta ** (2i / rotary_dim)`` in fp32: [rotary_dim / 2]."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)).to(device)


@triton.jit
def _rotate(ptr, row_stride, heads, pos, inv_freq, HALF, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    hs = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    ok = (hs < heads)[:, None] & (i < HALF)[None, :]
    angle = pos.to(tl.float32) * inv_freq[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle)
    lo = ptr + hs[:, None] * row_stride + i[None, :]
    a = tl.load(lo, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(lo + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(lo, (a * cos - b * sin).to(ptr.dtype.element_ty), mask=ok)
    tl.store(lo + HALF, (b * cos + a * sin).to(ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, inv_ptr, seq_ptr, cu_ptr, ctx_ptr, kv_lens_ptr, Tp, stride_qt, stride_qh,
                 stride_kt, stride_kh, H, KVH, HALF, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_KVH: tl.constexpr, HAS_PREFILL: tl.constexpr, USE_PDL: tl.constexpr):
    # grid: (Tp + B,): one token's heads
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_ptr + i, mask=i < HALF, other=0.0)
    if USE_PDL:  # q and k are the previous kernel's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    live = True
    if HAS_PREFILL and t < Tp:
        s = tl.load(seq_ptr + t)
        live = s >= 0
        s = tl.maximum(s, 0)
        pos = tl.load(ctx_ptr + s) + t - tl.load(cu_ptr + s)
    else:
        pos = tl.load(kv_lens_ptr + t - Tp) - 1
    if live:
        row = t.to(tl.int64)
        _rotate(q_ptr + row * stride_qt, stride_qh, H, pos, inv_freq, HALF, BLOCK_HALF, BLOCK_H)
        _rotate(k_ptr + row * stride_kt, stride_kh, KVH, pos, inv_freq, HALF, BLOCK_HALF, BLOCK_KVH)


def token_positions(prefill: PrefillMetadata | None, kv_lens: torch.Tensor) -> torch.Tensor:
    """Each packed token's position [Tp + B] (-1 past the last sequence), from the metadata, on the host."""
    parts = []
    if prefill is not None:
        seq = prefill.seq_idx.long().cpu()
        s = seq.clamp(min=0)
        pos = prefill.context_lens.long().cpu()[s] + torch.arange(seq.shape[0]) - prefill.cu_seqlens.long().cpu()[s]
        parts.append(torch.where(seq >= 0, pos, -1))
    parts.append(kv_lens.long().cpu() - 1)
    return torch.cat(parts)


def rope_ref(q, k, inv_freq, prefill: PrefillMetadata | None, kv_lens, pdl=False):
    half = inv_freq.shape[0]
    positions = token_positions(prefill, kv_lens)
    angle = positions.clamp(min=0).float()[:, None] * inv_freq.float().cpu()[None, :]
    cos, sin = angle.cos().to(q.device)[:, None, :], angle.sin().to(q.device)[:, None, :]
    live = (positions >= 0).to(q.device)[:, None, None]
    for x in (q, k):
        a, b = x[..., :half].float(), x[..., half : 2 * half].float()
        rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        x[..., : 2 * half] = torch.where(live, rotated, x[..., : 2 * half].float()).to(x.dtype)
    return q, k


@with_reference(rope_ref)
def rope(q, k, inv_freq, prefill: PrefillMetadata | None, kv_lens, pdl=False):
    """Rotate the queries and keys of every live packed token in place; returns (q, k).

    q: [Tp + B, H, Dh], k: [Tp + B, KVH, Dh] (strided views of one projection allowed, the head
    dim contiguous); inv_freq: [R / 2] fp32 (``rope_inv_freq``), R <= Dh the rotated dims;
    prefill: the step's PrefillMetadata of its Tp prefill rows, or None; kv_lens:
    [B] int32 each decode row's context including its new token. pdl: launch as a programmatic
    dependent of the previous kernel (``kernels.decode_linear``).
    """
    T, H, Dh = q.shape
    KVH = k.shape[1]
    half = inv_freq.shape[0]
    Tp = 0 if prefill is None else prefill.max_tokens
    if k.shape[0] != T or k.shape[2] != Dh or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"rope: q [T, H, Dh] and k [T, KVH, Dh] with contiguous heads, got {list(q.shape)}, "
                         f"{list(k.shape)}")
    if 2 * half > Dh or inv_freq.dtype != torch.float32 or kv_lens.shape[0] != T - Tp:
        raise ValueError(f"rope: inv_freq [R / 2] fp32 (R <= {Dh}) and kv_lens [{T - Tp}]; "
                         f"got {list(inv_freq.shape)} {inv_freq.dtype}, {list(kv_lens.shape)}")
    if T:
        meta = (prefill.seq_idx, prefill.cu_seqlens, prefill.context_lens) if prefill is not None else (kv_lens,) * 3
        _rope_kernel[(T,)](q, k, inv_freq, *meta, kv_lens, Tp, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           H, KVH, half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_H=triton.next_power_of_2(H),
                           BLOCK_KVH=triton.next_power_of_2(KVH), HAS_PREFILL=prefill is not None, USE_PDL=pdl,
                           num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return q, k
