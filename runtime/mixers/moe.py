"""A mixture of experts with a shared expert, over the routed pairs only (``kernels.moe``):
route, the routed experts, the shared expert beside them, combine. NemotronH's: relu2 experts, a
sigmoid router with a score-correction bias; Granite's: SwiGLU experts, a softmax over the top-k
router logits, its shared MLP as the shared expert (``cfg.mlp_activation``, ``cfg.moe_scoring``).

In a step of up to ``SHARED_BESIDE_MAX_TOKENS`` tokens with an expert stream (``StepContext``),
the shared expert runs on that stream, forked after the block norm and joined at the combine, so
its weight read overlaps the routing's short, latency-bound kernels and the grouped GEMMs. In
longer steps (both sides compute-bound: beside each other they only contend) and without one
(the CPU, an unforked runner) it runs first, in turn.

With ``moe_latent_size`` (the larger Nemotron 3 models) the routed experts work in a smaller
latent space: the input is projected down before them and their sum back up after; the router
and the shared expert see the full-width input, as in HF's NemotronHMoE.
"""

from __future__ import annotations

import torch

from ...kernels.linear import linear, takes_rows
from ...kernels.moe import moe_experts, quantizes_rows, takes_w8a8
from ...kernels.moe_route import block_counts_buffer, moe_route, router_terms
from ..config import ModelConfig
from .base import Mixer, Norm, StepContext
from .mlp import mlp, mlp_fused

__all__ = ["MoEMixer", "SHARED_BESIDE_MAX_TOKENS"]

# Nemotron-3-Nano's shape on an H200, forked against in turn: decode at 1 row 2.27 against 2.54
# ms, 8 rows 6.46 / 6.71, 32 rows 12.95 / 13.17, 64 rows a tie; 256 rows 25.9 / 25.4 and a
# 2048-token prefill 45.1 / 44.6 lose (docs/experiments.md)
SHARED_BESIDE_MAX_TOKENS = 64


class MoEMixer(Mixer):
    fuses_decode = True
    # FP8 experts' products past a few pairs with their activations quantized per row too
    # (``moe_experts``' w8a8, where ``takes_w8a8``), as the dense FP8 products past a few rows
    # already are, and as FP8 checkpoints are made to run (ModelOpt calibrates an input scale per
    # product for it). Timed on the H200: Nano FP8 decode at 64 rows 11.0 against 12.4 ms, at 256
    # 18.6 against 21.8 (docs/experiments.md). An instance may set its own (False: W8A16, the
    # FP8 values widened to the activations' dtype)
    w8a8 = True

    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor]):
        self.layer = idx
        p = f"layers.{idx}.mixer."
        self.gate = w[p + "gate.weight"].float()
        self.gate_terms = router_terms(self.gate)  # the logits of bf16 rows as bf16 products
        self.bias = w[p + "gate.e_score_correction_bias"].float() if cfg.moe_scoring == "sigmoid" else None
        self.act = cfg.mlp_activation
        self.up, self.down = w[p + "experts.up_proj"], w[p + "experts.down_proj"]  # [E, I, L], [E, L, I]
        self.shared = None
        if cfg.n_shared_experts:
            s = p + "shared_experts."
            self.shared = (w[s + "up_proj.weight"], w[s + "down_proj.weight"],
                           w.get(s + "up_proj.bias"), w.get(s + "down_proj.bias"))
        self.latent = None
        if cfg.moe_latent_size:
            self.latent = tuple(w.get(p + name) for name in ("fc1_latent_proj.weight", "fc1_latent_proj.bias",
                                                            "fc2_latent_proj.weight", "fc2_latent_proj.bias"))
        self.route = dict(top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                          norm_topk=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor, scoring=cfg.moe_scoring)

    def takes_rows(self, tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Any of h's readers quantizes it per row: the routed experts (or, with a latent space,
        the projection down into it) and the shared expert's up projection; one quantization
        serves them all."""
        if self.latent is None:
            routed = device.type == "cuda" and quantizes_rows(self.w8a8 and takes_w8a8(dtype, self.up, self.down),
                                                              tokens, self.route["top_k"])
        else:
            routed = takes_rows(tokens, dtype, device, self.latent[0])
        return routed or (self.shared is not None and takes_rows(tokens, dtype, device, self.shared[0]))

    def forward(self, h: torch.Tensor, ctx: StepContext, rows=None) -> torch.Tensor:
        return self._moe(h, ctx, lambda: mlp(h, *self.shared, act=self.act, rows=rows), rows=rows)

    def fused_decode(self, residual: torch.Tensor, norm: Norm, ctx: StepContext) -> None:
        h = norm(residual, out=torch.empty(residual.shape, dtype=norm.weight.dtype, device=residual.device),
                 pdl=ctx.options.pdl)
        self._moe(h, ctx, lambda: self._shared_fused(h, ctx), residual=residual)

    def _moe(self, h: torch.Tensor, ctx: StepContext, shared_expert, residual: torch.Tensor | None = None,
             rows=None):
        """The routed experts' weighted sum plus ``shared_expert()``'s output (the shared expert
        over h): returned, or added into ``residual``. rows: h quantized per row, or None."""
        shared = ready = None
        if self.shared is not None:
            side = ctx.side_stream if h.shape[0] <= SHARED_BESIDE_MAX_TOKENS else None
            if side is None:
                shared = shared_expert()
            else:
                # Its buffers come from the expert stream's pool and go back to it once freed
                # here, after the join; that stream uses them again only after its next fork.
                side.wait_stream(torch.cuda.current_stream(h.device))
                with torch.cuda.stream(side):
                    shared = shared_expert()
                ready = torch.cuda.Event()
                ready.record(side)
        pdl = ctx.options.pdl
        w8a8 = self.w8a8 and takes_w8a8(h.dtype, self.up, self.down)
        counts = block_counts_buffer(h.shape[0], self.gate.shape[0], h.device)
        idx, w = moe_route(h, self.gate, self.bias, **self.route, gate_terms=self.gate_terms, block_counts=counts,
                           pdl=pdl, route_as=ctx.inputs.route_as)
        if ctx.observe is not None:
            ctx.observe(self.layer, idx)
        if self.latent is None:
            return moe_experts(h, idx, w, self.up, self.down, shared=shared, residual=residual, shared_ready=ready,
                               block_counts=counts, pdl=pdl, act=self.act, w8a8=w8a8, x_rows=rows)
        down_w, down_b, up_w, up_b = self.latent
        routed = linear(moe_experts(linear(h, down_w, down_b, rows), idx, w, self.up, self.down, block_counts=counts,
                                    act=self.act, w8a8=w8a8), up_w, up_b)
        if ready is not None:
            torch.cuda.current_stream(h.device).wait_event(ready)
        out = routed if shared is None else routed + shared
        return out if residual is None else residual.add_(out)

    def _shared_fused(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The shared expert as skinny kernels. The first is no programmatic dependent: on the
        expert stream, what it follows is the other stream's."""
        return mlp_fused(h, None, *self.shared, self.act, ctx, first_pdl=False)
