"""NemotronH's mixture of relu2 experts with a shared expert (no fused decode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .base import Mixer, StepContext
from .mlp import relu2_mlp

__all__ = ["MoEMixer"]


class MoEMixer(Mixer):
    """Sigmoid router with a score-correction bias and group-limited top-k, as HF's NemotronH.

    Every expert runs over every token and is weighted by the token's routing weight (zero when
    not chosen): no token gather, so no data-dependent shapes and no host sync, at E/k times the
    FLOPs of a grouped GEMM. Right for the small MoE models this runtime meets today.
    """

    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor]):
        p = f"layers.{idx}.mixer."
        self.gate = w[p + "gate.weight"].float()
        self.bias = w[p + "gate.e_score_correction_bias"].float()
        self.up, self.down = w[p + "experts.up_proj"], w[p + "experts.down_proj"]  # [E, I, D], [E, D, I]
        self.shared = None
        if cfg.n_shared_experts:
            self.shared = (w[p + "shared_experts.up_proj.weight"], w[p + "shared_experts.down_proj.weight"])
        self.E, self.k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        """Dense routing weights [T, E] (zero for experts a token does not use)."""
        scores = F.linear(x.float(), self.gate).sigmoid()
        choice = scores + self.bias
        T = x.shape[0]
        per_group = self.E // self.n_group
        group_scores = choice.view(T, self.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(self.topk_group, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        allowed = group_mask.repeat_interleave(per_group, dim=1).bool()
        top_idx = choice.masked_fill(~allowed, float("-inf")).topk(self.k, dim=-1)[1]
        top_w = scores.gather(1, top_idx)
        if self.norm_topk:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        top_w = top_w * self.scale
        return torch.zeros_like(scores).scatter_(1, top_idx, top_w)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        weights = self.routing(x)  # [T, E] fp32
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.E):
            h = relu2_mlp(x, self.up[e], self.down[e])
            out += h.float() * weights[:, e : e + 1]
        if self.shared is not None:
            out += relu2_mlp(x, *self.shared).float()
        return out.to(x.dtype)
