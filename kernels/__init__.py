"""Triton kernels for Mamba2 layers, one module per op, each with a plain fp32 torch reference.

Each public op runs its Triton kernel on CUDA tensors and its torch reference on CPU tensors.
Ops take preallocated ``out=`` buffers, never sync with the host, and skip rows whose slot
index is ``PAD_SLOT_ID`` (see ``varlen``).
"""

from .varlen import PAD_SLOT_ID, PrefillMetadata, fill_prefill_metadata, max_chunks_for

__all__ = ["PAD_SLOT_ID", "PrefillMetadata", "fill_prefill_metadata", "max_chunks_for"]
