"""A family's scalar multipliers (Granite's muP ones) folded into the weights once at load, so
that no step spends a kernel on them.

- ``residual_multiplier``: every block's output is scaled before its residual add, so each
  mixer's last projection is scaled (out_proj, o_proj, down_proj; a MoE's routed experts' down
  projections, or its latent up projection, and its shared expert's). An FP8 weight's scales are
  scaled instead: exact.
- ``logits_scaling``: the logits are divided by it, so the final norm's weight is.
- ``embedding_multiplier`` cannot fold where the LM head shares the embeddings: the model scales
  the gathered rows (``kernels.embedding``).

A folded weight is rounded once to its dtype: in bf16 that moves a product by about as much as
HF's own rounding of the scaled output.
"""

from __future__ import annotations

import re

import torch

from ..kernels.fp8 import Fp8Weight
from .config import ModelConfig

__all__ = ["fold_multipliers"]

# the tensors that produce a block's output: scaled by the residual multiplier
_BLOCK_OUTPUT = re.compile(r"layers\.\d+\.mixer\.(out_proj|o_proj|down_proj|shared_experts\.down_proj|"
                           r"fc2_latent_proj)\.(weight|bias)|layers\.\d+\.mixer\.experts\.down_proj")


def _scaled(w, factor: float):
    if isinstance(w, Fp8Weight):
        return w._replace(scale=w.scale * factor)
    return (w.float() * factor).to(w.dtype)


def fold_multipliers(cfg: ModelConfig, weights: dict) -> dict:
    """The weights with ``cfg``'s residual multiplier and logits scaling folded in (a new dict;
    the tensors it does not touch are the same). With a latent MoE the routed experts' sum is
    scaled at its up projection, not at each expert."""
    out = dict(weights)
    if cfg.residual_multiplier != 1.0:
        for name, w in weights.items():
            if not _BLOCK_OUTPUT.fullmatch(name):
                continue
            if cfg.moe_latent_size and name.endswith("experts.down_proj"):
                continue
            out[name] = _scaled(w, cfg.residual_multiplier)
    if cfg.logits_scaling != 1.0:
        out["norm_f.weight"] = _scaled(weights["norm_f.weight"], 1.0 / cfg.logits_scaling)
    return out
