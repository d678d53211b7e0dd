"""Falcon-H1's parallel block: a Mamba2 mixer and an attention mixer side by side on one normed
input, their outputs summed (``mixer(h) = mamba(h) + attention(h)``; the muP multipliers on
either side are folded into their weights, ``runtime.multipliers``). Each keeps its own state in
the block's slots: the Mamba2 conv and SSM states and the attention KV cache.

The two are independent, so in a decode-only step with a side stream (``StepContext``'s
``side_stream``; the CUDA graphs capture the fork and the join) attention runs there beside
the Mamba2 mixer: at one row both are short chains of latency-bound kernels, and beside each other
their weight reads overlap. Attention writes its output to a buffer of its own and, after the
join, one add brings it into the sum. Steps with prefill tokens run the two in turn, each with its
own prefill / decode fork (``Mixer.forward``).

Fused (a small decode-only step): the block norm once, then each mixer's fused chain from the
normed rows (``fused``), Mamba2's adding into the residual stream, attention's into its buffer.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .attention import AttentionMixer
from .base import Mixer, Norm, StepContext
from .mamba2 import Mamba2Mixer

__all__ = ["ParallelMixer"]


class ParallelMixer(Mixer):
    fuses_decode = True

    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor]):
        self.mamba = Mamba2Mixer(cfg, idx, w)
        self.attention = AttentionMixer(cfg, idx, w)

    def _side(self, ctx: StepContext) -> torch.cuda.Stream | None:
        return ctx.side_stream if ctx.inputs.prefill is None else None

    def takes_rows(self, tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Either branch's first projection quantizes h per row: the one quantization serves both."""
        return self.mamba.takes_rows(tokens, dtype, device) or self.attention.takes_rows(tokens, dtype, device)

    def forward(self, h: torch.Tensor, ctx: StepContext, rows=None) -> torch.Tensor:
        side = self._side(ctx)
        if side is None:
            return self.mamba.forward(h, ctx, rows).add_(self.attention.forward(h, ctx, rows))
        attended = self._beside(side, lambda: self.attention.forward(h, ctx, rows))
        out = self.mamba.forward(h, ctx, rows)
        torch.cuda.current_stream(h.device).wait_stream(side)
        return out.add_(attended)

    def fused_decode(self, residual: torch.Tensor, norm: Norm, ctx: StepContext) -> None:
        opts = ctx.options
        h = norm(residual, out=torch.empty(residual.shape, dtype=norm.weight.dtype, device=residual.device),
                 pdl=opts.pdl)
        side = self._side(ctx)
        if side is None:  # in turn: both add into the residual stream
            self.mamba.fused(h, None, ctx, residual=residual)
            self.attention.fused(h, None, ctx, residual=residual)
            return
        attended = self._beside(side, lambda: self.attention.fused(h, None, ctx, first_pdl=False))
        self.mamba.fused(h, None, ctx, residual=residual)
        torch.cuda.current_stream(h.device).wait_stream(side)
        residual.add_(attended)

    @staticmethod
    def _beside(side: torch.cuda.Stream, branch):
        """Run ``branch`` on ``side`` after what the current stream has queued; the caller joins.
        Its buffers come from the side stream's pool and go back to it once freed here, after the
        join; that stream uses them again only after its next fork."""
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            return branch()

    def absorb_norm(self, weight: torch.Tensor) -> bool:
        return False  # two projections read the norm's output
