"""The dense MLP: ``down(act(up(x)))`` with NemotronH's relu2, or SwiGLU (Granite, Bamba,
Falcon-H1: silu(gate) * up, over an up projection holding the gate's rows, then the up's).
Fused, a small decode step is block norm + up_proj (+ relu2 or SwiGLU in its epilogue); down_proj
+ residual add. The MoE's shared expert is this MLP too.
"""

from __future__ import annotations

import torch

from ...kernels.activation import relu2, silu_mul
from ...kernels.decode_linear import norm_linear
from ...kernels.fp8 import Fp8Rows
from ...kernels.linear import linear, takes_rows
from ..config import ModelConfig
from .base import Mixer, Norm, StepContext, norm_args

__all__ = ["MLPMixer", "mlp", "mlp_fused"]


# where the down projection's FP8 product would quantize relu2's rows, relu2 writes them so;
# ACT_ROWS_ONLY: and only them (the product reads nothing else), leaving h the up projection's
# (a bf16 write less; not timed alone, docs/experiments.md)
ACT_ROWS = True
ACT_ROWS_ONLY = True


def mlp(x, up, down, up_bias=None, down_bias=None, act="relu2", rows=None):
    """down(act(up(x))) layer by layer; rows: x quantized per row (``kernels.linear``'s)."""
    h = linear(x, up, up_bias, rows)
    if act != "relu2":
        return linear(silu_mul(h), down, down_bias)
    h_rows = Fp8Rows.empty(*h.shape, h.device) if ACT_ROWS and takes_rows(h.shape[0], h.dtype, h.device, down) else None
    return linear(relu2(h, out=h, rows=h_rows, rows_only=ACT_ROWS_ONLY and h_rows is not None), down, down_bias,
                  h_rows)


def mlp_fused(x, norm: Norm | None, up, down, up_bias, down_bias, act, ctx: StepContext, *,
              residual: torch.Tensor | None = None, first_pdl: bool = True) -> torch.Tensor:
    """down(act(up(norm(x)))) as skinny kernels (``kernels.decode_linear``): added into
    ``residual`` in place when given, else returned. ``norm``: the block norm to apply first, or
    None for x already normed. ``first_pdl``: the first kernel is a programmatic dependent (not
    on another stream, where what it follows is the other stream's)."""
    opts = ctx.options
    h = norm_linear(x, weight=up, bias=up_bias, relu2=act == "relu2", swiglu=act == "swiglu",
                    pdl=opts.pdl and first_pdl, tile_k=opts.tile_k, **norm_args(norm))
    # a residual is the previous block's, two or more kernels back
    return norm_linear(h, None, 0.0, down, bias=down_bias, residual=residual, pdl=opts.pdl, tile_k=opts.tile_k,
                       early=residual is not None)


class MLPMixer(Mixer):
    fuses_decode = True
    norm_reader = "up"

    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor]):
        p = f"layers.{idx}.mixer."
        self.up, self.down = w[p + "up_proj.weight"], w[p + "down_proj.weight"]
        self.up_bias, self.down_bias = w.get(p + "up_proj.bias"), w.get(p + "down_proj.bias")
        self.act = cfg.mlp_activation

    def takes_rows(self, tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        return takes_rows(tokens, dtype, device, self.up)

    def forward(self, h: torch.Tensor, ctx: StepContext, rows=None) -> torch.Tensor:
        return mlp(h, self.up, self.down, self.up_bias, self.down_bias, self.act, rows)

    def fused_decode(self, residual: torch.Tensor, norm: Norm, ctx: StepContext) -> None:
        mlp_fused(residual, norm, self.up, self.down, self.up_bias, self.down_bias, self.act, ctx, residual=residual)
