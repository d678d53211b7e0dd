"""NemotronH's relu2 MLP. Fused, a small decode step is block norm + up_proj + relu2; down_proj +
residual add."""

from __future__ import annotations

import torch

from ...kernels.activation import relu2
from ...kernels.decode_linear import norm_linear
from ...kernels.linear import linear
from ..config import ModelConfig
from .base import Mixer, Norm, StepContext

__all__ = ["MLPMixer", "relu2_mlp"]


def relu2_mlp(x, up, down, up_bias=None, down_bias=None):
    """down(relu(up(x))^2)."""
    h = linear(x, up, up_bias)
    return linear(relu2(h, out=h), down, down_bias)


class MLPMixer(Mixer):
    fuses_decode = True
    norm_reader = "up"

    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor]):
        p = f"layers.{idx}.mixer."
        self.up, self.down = w[p + "up_proj.weight"], w[p + "down_proj.weight"]
        self.up_bias, self.down_bias = w.get(p + "up_proj.bias"), w.get(p + "down_proj.bias")

    def forward(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return relu2_mlp(h, self.up, self.down, self.up_bias, self.down_bias)

    def fused_decode(self, residual: torch.Tensor, norm: Norm, ctx: StepContext) -> None:
        opts = ctx.options
        h = torch.empty(residual.shape[0], self.up.shape[0], dtype=norm.weight.dtype, device=residual.device)
        norm_linear(residual, norm.weight, norm.eps, self.up, bias=self.up_bias, round_first=norm.round_first,
                    relu2=True, out=h, pdl=opts.pdl, tile_k=opts.tile_k, unit_norm=norm.unit)
        # the residual is the previous block's, two kernels back
        norm_linear(h, None, norm.eps, self.down, bias=self.down_bias, residual=residual, pdl=opts.pdl,
                    tile_k=opts.tile_k, early=True)
