"""Causal GQA attention (NemotronH: no rotary embedding) over packed ``[prefill | decode]`` tokens.

Keys and values live in the state pool's per-slot KV cache; prefill rows write their keys at
positions ``context_lens + j`` and attend to everything before them in the slot (so chunked
prefill sees its earlier chunks), decode rows write one key at ``kv_len - 1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.attention import decode_attention, prefill_attention
from ...kernels.decode_linear import norm_linear
from ..config import ModelConfig
from ..step_inputs import StepInputs
from .branches import run_branches

__all__ = ["AttentionLayer"]


class AttentionLayer:
    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor]):
        p = f"layers.{idx}.mixer."
        self.idx = idx
        self.eps = cfg.norm_eps
        self.H, self.KVH, self.Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_head_dim
        self.scale = self.Dh**-0.5
        # one GEMM for q, k and v
        self.qkv = torch.cat([w[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")])
        self.qkv_bias = None
        if cfg.attention_bias:
            self.qkv_bias = torch.cat([w[p + n + ".bias"] for n in ("q_proj", "k_proj", "v_proj")])
        self.o_proj, self.o_bias = w[p + "o_proj.weight"], w.get(p + "o_proj.bias")

    def project(self, x: torch.Tensor):
        return self._split(F.linear(x, self.qkv, self.qkv_bias))

    def _split(self, qkv: torch.Tensor):
        """q, k, v views of the packed projection, and the attention output buffer."""
        T = qkv.shape[0]
        q_end, k_end = self.H * self.Dh, (self.H + self.KVH) * self.Dh
        q = qkv[:, :q_end].view(T, self.H, self.Dh)
        k = qkv[:, q_end:k_end].view(T, self.KVH, self.Dh)
        v = qkv[:, k_end:].view(T, self.KVH, self.Dh)
        out = torch.empty(T, self.H, self.Dh, dtype=qkv.dtype, device=qkv.device)
        return (q, k, v), out

    def prefill_branch(self, qkv, out, inputs: StepInputs, k_cache, v_cache) -> None:
        tp = inputs.num_prefill_tokens
        q, k, v = (t[:tp] for t in qkv)
        prefill_attention(q, k, v, k_cache, v_cache, inputs.prefill, scale=self.scale, out=out[:tp])

    def decode_branch(self, qkv, out, inputs: StepInputs, k_cache, v_cache) -> None:
        tp = inputs.num_prefill_tokens
        rows = slice(tp, tp + inputs.num_decode)
        q, k, v = (t[rows] for t in qkv)
        decode_attention(q, k, v, k_cache, v_cache, inputs.decode_slots, inputs.decode_kv_lens,
                         scale=self.scale, out=out[rows])

    def finish(self, out) -> torch.Tensor:
        return F.linear(out.view(out.shape[0], -1), self.o_proj, self.o_bias)

    def decode_fused(self, residual: torch.Tensor, norm_w: torch.Tensor, round_first: bool,
                     inputs: StepInputs, state, pdl: bool = False) -> None:
        """``residual += attention(norm(residual))`` for a small decode-only step: block norm +
        qkv projection (one kernel); the decode attention kernels; o_proj + residual add."""
        qkv = torch.empty(residual.shape[0], self.qkv.shape[0], dtype=self.qkv.dtype, device=residual.device)
        norm_linear(residual, norm_w, self.eps, self.qkv, bias=self.qkv_bias, round_first=round_first, out=qkv,
                    pdl=pdl)
        qkv, out = self._split(qkv)
        self.decode_branch(qkv, out, inputs, state.k[self.idx], state.v[self.idx])
        norm_linear(out.view(out.shape[0], -1), None, self.eps, self.o_proj, bias=self.o_bias, residual=residual,
                    pdl=pdl)

    def forward(self, x: torch.Tensor, inputs: StepInputs, state, aux_stream=None) -> torch.Tensor:
        qkv, out = self.project(x)
        args = (qkv, out, inputs, state.k[self.idx], state.v[self.idx])
        run_branches(
            (lambda: self.prefill_branch(*args)) if inputs.num_prefill_tokens else None,
            (lambda: self.decode_branch(*args)) if inputs.num_decode else None,
            aux_stream,
        )
        return self.finish(out)
