"""Causal GQA attention over packed ``[prefill | decode]`` tokens: without positional embeddings
(NemotronH, Granite-4.0-H), or with HF's rotary embedding of the first ``rotary_dim`` dims of each
head (Bamba: half), applied to every token's query and key in place after the projection.

Keys and values live in the state pool's per-slot KV cache (FP8 over the layer's key and value
scales, ``kv_scale``, where the checkpoint asks for an FP8 KV cache); prefill rows write their
keys at positions ``context_lens + j`` and attend to everything before them in the slot (so
chunked prefill sees its earlier chunks), decode rows write one key at ``kv_len - 1``. Fused, a small
decode step is block norm + QKV projection; the rotation, where there is a rotary embedding (or
with ``ROPE_IN_PROJECTION`` in the projection's epilogue); the decode attention kernels; o_proj +
residual add.
"""

from __future__ import annotations

import torch

from ...kernels.attention import decode_attention, prefill_attention
from ...kernels.decode_linear import RopeTail, norm_linear
from ...kernels.fp8 import Fp8Weight
from ...kernels.linear import linear, takes_rows
from ...kernels.rope import rope, rope_inv_freq
from ..config import ModelConfig
from .base import Mixer, Norm, StepContext, norm_args

__all__ = ["AttentionMixer"]

# a fused decode step rotates the queries and keys in the QKV projection's epilogue
# (``kernels.decode_linear.RopeTail``), not in a rope launch after it. Off until timed on a GPU
# (built 2026-12-08 with no device time left; the A/B command is in docs/experiments.md)
ROPE_IN_PROJECTION = False


class AttentionMixer(Mixer):
    fuses_decode = True
    norm_reader = "qkv"

    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor]):
        p = f"layers.{idx}.mixer."
        self.idx = idx
        self.H, self.KVH, self.Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_head_dim
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else self.Dh**-0.5
        # one GEMM for q, k and v
        self.qkv = _concat([w[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")], p + "q/k/v_proj")
        self.qkv_bias = None
        if cfg.attention_bias:
            self.qkv_bias = torch.cat([w[p + n + ".bias"] for n in ("q_proj", "k_proj", "v_proj")])
        self.o_proj, self.o_bias = w[p + "o_proj.weight"], w.get(p + "o_proj.bias")
        # an FP8 KV cache's key and value scales (fp32 [2]), where the checkpoint asks for one
        self.kv_scale = w.get(p + "kv_scale")
        self.inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, self.qkv.device) if cfg.rotary_dim else None

    def takes_rows(self, tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        return takes_rows(tokens, dtype, device, self.qkv)

    def project(self, h: torch.Tensor, ctx: StepContext, rows=None):
        return self.prepare(linear(h, self.qkv, self.qkv_bias, rows), ctx)

    def prepare(self, qkv: torch.Tensor, ctx: StepContext, out: torch.Tensor | None = None, pdl: bool = False):
        """The work of the QKV projection's output ``qkv`` (a row-strided view allowed): its q, k
        and v rotated in place, and the output buffer ([T, H, Dh]: ``out``, a view whose head
        dim is contiguous allowed, or a new tensor)."""
        work = self._split(qkv, out)
        self._rotate(work, ctx, pdl)
        return work

    def _rotate(self, work, ctx: StepContext, pdl: bool = False) -> None:
        """The rotary embedding of every token's query and key, in place (none without one)."""
        if self.inv_freq is not None:
            (q, k, _), _ = work
            rope(q, k, self.inv_freq, ctx.inputs.prefill, ctx.inputs.decode_kv_lens, pdl=pdl)

    def _split(self, qkv: torch.Tensor, out: torch.Tensor | None = None):
        """q, k, v views of the packed projection, and the attention output buffer."""
        T = qkv.shape[0]
        q_end, k_end = self.H * self.Dh, (self.H + self.KVH) * self.Dh
        q = qkv[:, :q_end].view(T, self.H, self.Dh)
        k = qkv[:, q_end:k_end].view(T, self.KVH, self.Dh)
        v = qkv[:, k_end:].view(T, self.KVH, self.Dh)
        if out is None:
            out = torch.empty(T, self.H, self.Dh, dtype=qkv.dtype, device=qkv.device)
        return (q, k, v), out

    def prefill(self, work, ctx: StepContext, passed=None) -> None:
        (q, k, v), out = work
        tp = ctx.inputs.num_prefill_tokens
        prefill_attention(q[:tp], k[:tp], v[:tp], ctx.pool.k[self.idx], ctx.pool.v[self.idx], ctx.inputs.prefill,
                          scale=self.scale, out=out[:tp], kv_scale=self.kv_scale)

    def decode(self, work, ctx: StepContext, pdl: bool = False, first_pdl: bool = True) -> None:
        (q, k, v), out = work
        tp = ctx.inputs.num_prefill_tokens
        rows = slice(tp, tp + ctx.inputs.num_decode)
        decode_attention(q[rows], k[rows], v[rows], ctx.pool.k[self.idx], ctx.pool.v[self.idx],
                         ctx.inputs.decode_slots, ctx.inputs.decode_kv_lens, scale=self.scale, out=out[rows], pdl=pdl,
                         kv_scale=self.kv_scale, first_pdl=first_pdl)

    def finish(self, work) -> torch.Tensor:
        _, out = work
        return linear(out.view(out.shape[0], -1), self.o_proj, self.o_bias)

    def fused_decode(self, residual: torch.Tensor, norm: Norm, ctx: StepContext) -> None:
        self.fused(residual, norm, ctx, residual=residual)

    def fused(self, x: torch.Tensor, norm: Norm | None, ctx: StepContext, *, residual: torch.Tensor | None = None,
              out: torch.Tensor | None = None, first_pdl: bool = True) -> torch.Tensor:
        """The fused decode of ``norm(x)`` (x as it is without a norm): added into ``residual``
        in place, or written to ``out``; returns what it wrote. ``first_pdl``: as Mamba2Mixer's."""
        opts = ctx.options
        rope = self.rope_tail(ctx)
        qkv = norm_linear(x, weight=self.qkv, bias=self.qkv_bias, rope=rope, pdl=opts.pdl and first_pdl,
                          tile_k=opts.tile_k, **norm_args(norm))
        o = self.attend(qkv, ctx, rotated=rope is not None)
        # the residual is the previous block's, four or more kernels back
        return norm_linear(o.view(o.shape[0], -1), None, 0.0, self.o_proj, bias=self.o_bias, residual=residual,
                           out=out, pdl=opts.pdl, tile_k=opts.tile_k, early=residual is not None)

    def rope_tail(self, ctx: StepContext, lo: int = 0) -> RopeTail | None:
        """A fused decode step's rotation as the epilogue of the projection whose output columns
        from ``lo`` are this mixer's q, k and v; None without a rotary embedding (or with
        ``ROPE_IN_PROJECTION`` off)."""
        if self.inv_freq is None or not ROPE_IN_PROJECTION:
            return None
        return RopeTail(self.inv_freq, ctx.inputs.decode_kv_lens, lo, self.H, self.KVH, self.Dh)

    def attend(self, qkv: torch.Tensor, ctx: StepContext, out: torch.Tensor | None = None,
               first_pdl: bool = True, rotated: bool = False) -> torch.Tensor:
        """A fused decode step's attention from the projected ``qkv`` (``prepare``'s ``out``):
        the rotation (unless the projection did it, ``rotated``: ``rope_tail``) and the decode
        attention kernels, programmatic dependents where the options say; ``first_pdl``: as
        ``fused``'s, for the first of them. Returns the output [T, H, Dh]."""
        pdl = ctx.options.pdl
        work = self._split(qkv, out)
        rope = self.inv_freq is not None and not rotated
        if rope:
            self._rotate(work, ctx, pdl and first_pdl)
        self.decode(work, ctx, pdl=pdl, first_pdl=first_pdl or rope)
        return work[1]


def _concat(parts: list, name: str):
    """q, k and v stacked into one projection: all plain tensors, or all FP8 (each keeping its scales)."""
    fp8 = [isinstance(p, Fp8Weight) for p in parts]
    if all(fp8):
        return Fp8Weight.cat(parts)
    if any(fp8):
        raise ValueError(f"{name}: stored partly in FP8 and partly not; they run as one projection")
    return torch.cat(parts)
