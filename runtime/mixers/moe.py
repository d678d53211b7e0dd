"""NemotronH's mixture of relu2 experts with a shared expert, over the routed pairs only
(``kernels.moe``): route, the routed experts, the shared expert beside them, combine.

With ``moe_latent_size`` (the larger Nemotron 3 models) the routed experts work in a smaller
latent space: the input is projected down before them and their sum back up after; the router
and the shared expert see the full-width input, as in HF's NemotronHMoE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.decode_linear import norm_linear
from ...kernels.moe import moe_experts, moe_route
from ..config import ModelConfig
from .base import Mixer, Norm, StepContext
from .mlp import relu2_mlp

__all__ = ["MoEMixer"]


class MoEMixer(Mixer):
    fuses_decode = True

    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor]):
        self.layer = idx
        p = f"layers.{idx}.mixer."
        self.gate = w[p + "gate.weight"].float()
        self.bias = w[p + "gate.e_score_correction_bias"].float()
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
                          norm_topk=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)

    def forward(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        shared = relu2_mlp(h, *self.shared) if self.shared is not None else None
        return self._experts(h, shared, ctx)

    def fused_decode(self, residual: torch.Tensor, norm: Norm, ctx: StepContext) -> None:
        h = norm(residual, out=torch.empty(residual.shape, dtype=self.up.dtype, device=residual.device))
        shared = None
        if self.shared is not None:
            up, down, up_bias, down_bias = self.shared
            pdl, tile_k = ctx.options.pdl, ctx.options.tile_k
            a = torch.empty(h.shape[0], up.shape[0], dtype=h.dtype, device=h.device)
            norm_linear(h, None, norm.eps, up, bias=up_bias, relu2=True, out=a, pdl=pdl, tile_k=tile_k)
            shared = norm_linear(a, None, norm.eps, down, bias=down_bias, out=torch.empty_like(h), pdl=pdl,
                                 tile_k=tile_k)
        self._experts(h, shared, ctx, residual=residual)

    def _experts(self, h: torch.Tensor, shared: torch.Tensor | None, ctx: StepContext,
                 residual: torch.Tensor | None = None):
        """The routed experts' weighted sum plus ``shared``: returned, or added into ``residual``."""
        idx, w = moe_route(h, self.gate, self.bias, **self.route)
        if ctx.observe is not None:
            ctx.observe(self.layer, idx)
        if self.latent is None:
            return moe_experts(h, idx, w, self.up, self.down, shared=shared, residual=residual)
        down_w, down_b, up_w, up_b = self.latent
        routed = F.linear(moe_experts(F.linear(h, down_w, down_b), idx, w, self.up, self.down), up_w, up_b)
        out = routed if shared is None else routed + shared
        return out if residual is None else residual.add_(out)
