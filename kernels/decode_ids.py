"""Decode inputs that the previous step drew on the device: one small gather, no host trip."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fill_decode_ids", "fill_decode_ids_triton", "fill_decode_ids_ref"]


@triton.jit
def _fill_decode_ids_kernel(ids_ptr, slots_ptr, slot_tokens_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    slots = tl.load(slots_ptr + offs, mask=mask, other=0)
    take = mask & (ids < 0) & (slots >= 0)
    drawn = tl.load(slot_tokens_ptr + slots, mask=take, other=0)
    tl.store(ids_ptr + offs, tl.where(take, drawn, tl.maximum(ids, 0)), mask=mask)


def fill_decode_ids_triton(ids, slots, slot_tokens):
    n = ids.shape[0]
    if n:
        _fill_decode_ids_kernel[(triton.cdiv(n, 256),)](ids, slots, slot_tokens, n, BLOCK=256, num_warps=1)
    return ids


def fill_decode_ids_ref(ids, slots, slot_tokens):
    drawn = slot_tokens[slots.clamp(min=0).long()]
    take = (ids < 0) & (slots >= 0)
    return ids.copy_(torch.where(take, drawn, ids.clamp(min=0)))


def fill_decode_ids(ids: torch.Tensor, slots: torch.Tensor, slot_tokens: torch.Tensor) -> torch.Tensor:
    """In place: ids[b] = slot_tokens[slots[b]] where ids[b] is -1 (drawn last step, on the device).

    ids: [B] int64, -1 = take the slot's drawn token; slots: [B] int32, PAD_SLOT_ID rows get 0;
    slot_tokens: [S] int64, the token last drawn for each slot.
    """
    return (fill_decode_ids_triton if ids.is_cuda else fill_decode_ids_ref)(ids, slots, slot_tokens)
