"""Every request's recurrent and attention state, in slots allocated once.

Per Mamba2 layer: a conv state [S, conv_dim, K-1] (stored as [S, K-1, conv_dim] memory, so a
decode row's channels are contiguous) and an SSM state [S, H, P, N]. Per attention layer: a KV
cache [S, max_context, KVH, Dh] for K and for V, in the activations' dtype, or FP8 where the
checkpoint asks for an FP8 KV cache (``kv_cache_dtype``; the attention layers then hold its
scales). A request owns one slot index across all layers. Padded rows never touch a slot
(kernels skip PAD_SLOT_ID), so no slot is reserved for padding.

With speculative decoding (``drafts`` k > 0), each Mamba2 layer also keeps a record of k rows a
slot, [S * k, conv_dim + H]: the in_proj columns (xBC before the conv, and dt) of a verify
step's drafts, slot s's j-th at row s * k + j, which the next verify step's Mamba2 layers replay
where the drafts were kept (``runtime.replay``). A record is scratch, never part of a slot's
state: nothing copies it.
"""

from __future__ import annotations

import torch

from ..kernels.attention import FP8_KV_DTYPE
from .config import ModelConfig

__all__ = ["StatePool", "free_device_bytes", "kv_cache_dtype"]


def free_device_bytes(device: torch.device) -> int:
    """Bytes a pool allocated now can have on a CUDA device: what the driver has free, plus what
    torch's caching allocator holds but no tensor uses (and hands out first). Loading leaves
    such memory behind: an FP8 model quantized at load frees its full-precision weights into
    the allocator, not the driver (sized by the driver's count alone, Nemotron-3-Nano in FP8 on
    an H100 took one slot fewer than in bf16: docs/experiments.md)."""
    return (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device))


def kv_cache_dtype(cfg: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for a model run in ``dtype``: FP8 where its checkpoint asks for an FP8
    KV cache (ModelOpt's ``kv_cache_quant_algo``), else ``dtype``."""
    quant = cfg.quantization
    return FP8_KV_DTYPE if quant is not None and quant.kv_cache == "fp8" else dtype


class StatePool:
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_context: int,
        *,
        dtype: torch.dtype,
        ssm_dtype: torch.dtype = torch.float32,
        device="cpu",
        drafts: int = 0,
    ):
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        if not (isinstance(drafts, int) and drafts >= 0):
            raise ValueError(f"drafts: expected an int >= 0, got {drafts!r}")
        self.cfg, self.num_slots, self.max_context, self.drafts = cfg, num_slots, max_context, drafts
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        self.record: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        S = num_slots
        for i in cfg.layers_of("mamba"):
            conv = torch.zeros(S, cfg.conv_kernel - 1, cfg.conv_dim, dtype=dtype, device=device)
            self.conv[i] = conv.transpose(1, 2)
            self.ssm[i] = torch.zeros(
                S, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, dtype=ssm_dtype, device=device
            )
            if drafts:
                self.record[i] = torch.zeros(S * drafts, cfg.conv_dim + cfg.mamba_num_heads, dtype=dtype,
                                             device=device)
        kv_dtype = kv_cache_dtype(cfg, dtype)
        for i in cfg.layers_of("attention"):
            shape = (S, max_context, cfg.num_key_value_heads, cfg.attention_head_dim)
            self.k[i] = torch.zeros(shape, dtype=kv_dtype, device=device)
            self.v[i] = torch.zeros(shape, dtype=kv_dtype, device=device)

    def copy_slot(self, src: int, dsts: list[int], tokens: int, recurrent: bool = True) -> None:
        """Copy slot ``src``'s state, its first ``tokens`` KV positions, into slots ``dsts``: one
        copy kernel a tensor and destination, no index on the device, no host sync.
        ``recurrent=False``: the keys and values only (a snapshot whose conv and SSM states the
        step's kernels wrote)."""
        for states in (self.conv, self.ssm) if recurrent else ():
            for t in states.values():
                for d in dsts:
                    t[d].copy_(t[src])
        for states in (self.k, self.v):
            for t in states.values():
                for d in dsts:
                    t[d, :tokens].copy_(t[src, :tokens])

    def tensors(self) -> list[torch.Tensor]:
        """Every state tensor of the pool (conv, SSM, keys, values): to poison, randomise or snapshot."""
        return [*self.conv.values(), *self.ssm.values(), *self.k.values(), *self.v.values()]

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, max_context: int, dtype: torch.dtype, ssm_dtype=torch.float32,
                       drafts: int = 0) -> int:
        es, ss = torch.finfo(dtype).bits // 8, torch.finfo(ssm_dtype).bits // 8
        kvs = torch.finfo(kv_cache_dtype(cfg, dtype)).bits // 8
        per_mamba = (cfg.conv_kernel - 1 + drafts) * cfg.conv_dim * es + drafts * cfg.mamba_num_heads * es
        per_mamba += cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.ssm_state_size * ss
        per_attn = 2 * max_context * cfg.num_key_value_heads * cfg.attention_head_dim * kvs
        return len(cfg.layers_of("mamba")) * per_mamba + len(cfg.layers_of("attention")) * per_attn
