"""Falcon-H1's parallel block: a Mamba2 mixer and an attention mixer side by side on one normed
input, their outputs summed (``mixer(h) = mamba(h) + attention(h)``; the muP multipliers on
either side are folded into their weights, ``runtime.multipliers``). Each keeps its own state in
the block's slots: the Mamba2 conv and SSM states and the attention KV cache.

Where the four projections are plain tensors (not FP8), the block runs them as two (``joint``):
in_proj and attention's QKV read the same input, so they are one projection of their rows
stacked, ``[proj | qkv] = h @ [in_proj; qkv].T``; and the block's output is
``out_proj @ g + o_proj @ a``, one projection of their columns side by side over ``[g | a]``,
where the gate (or gated norm) writes g and attention a, into one buffer. Fused, the block norm
rides in the first one's prologue (Mamba2's conv update in its epilogue, and attention's rotary
embedding with ``attention.ROPE_IN_PROJECTION``) and the residual add in the second one's
epilogue: four kernels fewer a block. On Falcon-H1-7B (H100, docs/experiments.md) that made a
step of 8 decode rows and a 256-token chunk 3.8% faster, and tied the decode steps: at one row
the kernels that went had run beside the Mamba2 chain, and QKV's bytes joined its critical
path. FP8 weights (their scales per output row) run the four apart, each mixer's own, as does
any block built while ``JOINT`` is off.

The middle is independent, so in a decode-only step with a side stream (``StepContext``'s
``side_stream``; the CUDA graphs capture the fork and the join) attention runs there beside the
Mamba2 mixer: at one row both are short chains of latency-bound kernels. Steps with prefill
tokens run the two in turn, each with its own prefill / decode fork (``Mixer.run``).
"""

from __future__ import annotations

import torch

from ...kernels.decode_linear import norm_linear
from ...kernels.linear import linear
from ..config import ModelConfig
from .attention import AttentionMixer
from .base import Mixer, Norm, StepContext, norm_args
from .mamba2 import Mamba2Mixer

__all__ = ["ParallelMixer"]

# plain weights' four projections run as two (see the module doc); read when a block is built
JOINT = True


class ParallelMixer(Mixer):
    fuses_decode = True

    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor]):
        self.mamba = m = Mamba2Mixer(cfg, idx, w)
        self.attention = a = AttentionMixer(cfg, idx, w)
        self.split = m.in_proj.shape[0]  # the joint input projection's columns: in_proj's, then qkv's
        self.joint = JOINT and all(isinstance(t, torch.Tensor) for t in (m.in_proj, a.qkv, m.out_proj, a.o_proj))
        if self.joint:  # the mixers' own projections go: the block runs these
            self.in_w, self.in_b = torch.cat([m.in_proj, a.qkv]), _joint_bias(m.in_proj_bias, a.qkv_bias, m, a)
            self.out_w, self.out_b = torch.cat([m.out_proj, a.o_proj], dim=1), _summed(m.out_proj_bias, a.o_bias)
            m.in_proj = m.in_proj_bias = a.qkv = a.qkv_bias = m.out_proj = m.out_proj_bias = a.o_proj = a.o_bias = None
            self.norm_reader = "in_w"  # the one projection that reads the block norm's output

    def _side(self, ctx: StepContext) -> torch.cuda.Stream | None:
        return ctx.side_stream if ctx.inputs.prefill is None else None

    def takes_rows(self, tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Either branch's first projection quantizes h per row: the one quantization serves both."""
        return not self.joint and (self.mamba.takes_rows(tokens, dtype, device)
                                   or self.attention.takes_rows(tokens, dtype, device))

    def forward(self, h: torch.Tensor, ctx: StepContext, rows=None) -> torch.Tensor:
        if not self.joint:
            return self._forward_apart(h, ctx, rows)
        both = linear(h, self.in_w, self.in_b)
        joined, gated, attended = self._outputs(both)
        work = self.mamba.buffers(both[:, : self.split])
        self._middle(ctx, lambda: self.attention.run(self.attention.prepare(both[:, self.split :], ctx, attended), ctx),
                     lambda: self.mamba.run(work, ctx))
        proj, _, y = work
        self.mamba.gate(y.view(y.shape[0], -1), proj, out=gated)
        return linear(joined, self.out_w, self.out_b)

    def fused_decode(self, residual: torch.Tensor, norm: Norm, ctx: StepContext) -> None:
        if not self.joint:
            return self._fused_apart(residual, norm, ctx)
        opts = ctx.options
        rope = self.attention.rope_tail(ctx, self.split)
        both = norm_linear(residual, weight=self.in_w, bias=self.in_b, conv=self.mamba.conv_tail(ctx), rope=rope,
                           pdl=opts.pdl, tile_k=opts.tile_k, **norm_args(norm))
        proj = both[:, : self.split]
        joined, gated, attended = self._outputs(both)
        side = self._side(ctx)
        self._middle(ctx, lambda: self.attention.attend(both[:, self.split :], ctx, attended, first_pdl=side is None,
                                                        rotated=rope is not None),
                     lambda: self.mamba.gated_update(proj, ctx, out=gated))
        # after the join, a programmatic dependent of the Mamba2 branch's last kernel whose wait also
        # covers attention's stream (``kernels.moe``'s combine does the same); the residual is the
        # previous block's
        norm_linear(joined, None, 0.0, self.out_w, bias=self.out_b, residual=residual, pdl=opts.pdl,
                    tile_k=opts.tile_k, early=True)

    def _outputs(self, both: torch.Tensor):
        """The joint output projection's input [T, inner + H * Dh], and its two parts' views: the
        gate's columns [T, inner] and attention's [T, H, Dh]."""
        m, a = self.mamba, self.attention
        joined = torch.empty(both.shape[0], m.inner + a.H * a.Dh, dtype=both.dtype, device=both.device)
        return joined, joined[:, : m.inner], joined[:, m.inner :].view(-1, a.H, a.Dh)

    def _middle(self, ctx: StepContext, attention, mamba) -> None:
        """Call both branches: attention beside the Mamba2 mixer on the side stream (joined
        after), or in turn."""
        side = self._side(ctx)
        if side is None:
            mamba()
            attention()
            return
        self._beside(side, attention)
        mamba()
        torch.cuda.current_stream().wait_stream(side)

    def _forward_apart(self, h: torch.Tensor, ctx: StepContext, rows=None) -> torch.Tensor:
        side = self._side(ctx)
        if side is None:
            return self.mamba.forward(h, ctx, rows).add_(self.attention.forward(h, ctx, rows))
        attended = self._beside(side, lambda: self.attention.forward(h, ctx, rows))
        out = self.mamba.forward(h, ctx, rows)
        torch.cuda.current_stream(h.device).wait_stream(side)
        return out.add_(attended)

    def _fused_apart(self, residual: torch.Tensor, norm: Norm, ctx: StepContext) -> None:
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


def _joint_bias(in_bias, qkv_bias, m: Mamba2Mixer, a: AttentionMixer):
    """The joint input projection's bias: the two stacked (zeros for one without), or None."""
    if in_bias is None and qkv_bias is None:
        return None
    parts = [b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
             for b, w in ((in_bias, m.in_proj), (qkv_bias, a.qkv))]
    return torch.cat(parts)


def _summed(a, b):
    """The joint output projection's bias: the two added, either alone, or None."""
    if a is None or b is None:
        return b if a is None else a
    return a + b
