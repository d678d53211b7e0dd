"""A family's scalar multipliers (Granite's and Falcon-H1's muP ones) folded into the weights once at
load, so that no step spends a kernel on them.

- ``residual_multiplier`` (Granite): every block's output is scaled before its residual add, so
  each mixer's last projection is scaled (out_proj, o_proj, down_proj; a MoE's routed experts'
  down projections, or its latent up projection, and its shared expert's).
- ``logits_scaling`` (Granite; Falcon-H1's ``lm_head_multiplier`` is its inverse): the logits
  are divided by it, so the final norm's weight is.
- Falcon-H1's: the Mamba2 input (``ssm_in_multiplier``) and its in_proj's column groups z, x, B,
  C and dt (``ssm_multipliers``, HF's ``mup_vector``) scale in_proj's rows, its output
  (``ssm_out_multiplier``) out_proj; attention's input scales q, k and v, ``key_multiplier`` k
  and its output o_proj; ``mlp_multipliers`` the MLP's gate rows and its down projection. An
  input multiplier scales a projection's weight, not its bias.
- ``embedding_multiplier`` cannot fold where the LM head shares the embeddings: the model scales
  the gathered rows (``kernels.embedding``).

An FP8 weight's scales are scaled instead (exact). A folded bf16 weight is rounded once: that
moves a product by about as much as HF's own rounding of the scaled output.
"""

from __future__ import annotations

import re

import torch

from ..kernels.fp8 import Fp8Weight
from .config import ModelConfig

__all__ = ["fold_multipliers"]

_TENSOR = re.compile(r"layers\.(\d+)\.mixer\.(.+)")
# the tensors that produce a block's output: scaled by the residual multiplier
_BLOCK_OUTPUT = {"out_proj.weight", "out_proj.bias", "o_proj.weight", "o_proj.bias", "down_proj.weight",
                 "down_proj.bias", "shared_experts.down_proj.weight", "shared_experts.down_proj.bias",
                 "fc2_latent_proj.weight", "fc2_latent_proj.bias", "experts.down_proj"}


def _in_proj_rows(cfg: ModelConfig, bias: bool) -> torch.Tensor:
    """in_proj's row factors: z, x, B, C and dt each by one of ``ssm_multipliers`` (the input's
    multiplier on top, for the weight)."""
    gn = cfg.n_groups * cfg.ssm_state_size
    sizes = (cfg.mamba_inner, cfg.mamba_inner, gn, gn, cfg.mamba_num_heads)
    rows = torch.cat([torch.full((n,), m, dtype=torch.float64) for n, m in zip(sizes, cfg.ssm_multipliers)])
    return rows if bias else rows * cfg.ssm_in_multiplier


def _factor(cfg: ModelConfig, kind: str, tensor: str):
    """What ``tensor`` of a ``kind`` block is multiplied by: a number, or a factor per row."""
    f = cfg.residual_multiplier if tensor in _BLOCK_OUTPUT else 1.0
    if cfg.moe_latent_size and tensor == "experts.down_proj":  # the sum is scaled at fc2_latent_proj
        f = 1.0
    name, _, part = tensor.rpartition(".")
    weight = part == "weight"
    if kind in ("mamba", "parallel"):
        if name == "in_proj" and (cfg.ssm_in_multiplier != 1.0 or any(m != 1.0 for m in cfg.ssm_multipliers)):
            return _in_proj_rows(cfg, bias=not weight) * f
        if name == "out_proj":
            f *= cfg.ssm_out_multiplier
    if kind in ("attention", "parallel"):
        if name in ("q_proj", "k_proj", "v_proj") and weight:
            f *= cfg.attention_in_multiplier
        if name == "k_proj":
            f *= cfg.key_multiplier
        if name == "o_proj":
            f *= cfg.attention_out_multiplier
    if kind == "mlp":
        gate, down = cfg.mlp_multipliers
        if name == "up_proj" and gate != 1.0:  # SwiGLU's gate rows, the first half
            rows = torch.ones(2 * cfg.intermediate_size, dtype=torch.float64)
            rows[: cfg.intermediate_size] = gate
            return rows * f
        if name == "down_proj":
            f *= down
    return f


def _scaled(w, factor):
    """w times ``factor`` (a number, or one per row of its last two dims' first)."""
    rows = isinstance(factor, torch.Tensor)
    if isinstance(w, Fp8Weight):
        if rows and w.block:
            blocks = factor.view(-1, w.block) if factor.numel() % w.block == 0 else None
            if blocks is None or not bool((blocks == blocks[:, :1]).all()):
                raise ValueError("a multiplier that differs within a scale block of an FP8 weight cannot fold exactly")
            factor = blocks[:, 0]
        f = factor.to(w.scale.device, torch.float32) if rows else factor
        scale = w.scale * (f[:, None] if rows and w.block else f)
        return w._replace(scale=scale)
    if rows:
        factor = factor.to(w.device, torch.float32)
        factor = factor[:, None] if w.dim() > 1 else factor
    return (w.float() * factor).to(w.dtype)


def fold_multipliers(cfg: ModelConfig, weights: dict, *, in_place: bool = False) -> dict:
    """The weights with ``cfg``'s multipliers folded in (see the module doc): a new dict, whose
    tensors it does not scale are the same; ``in_place``: ``weights`` itself, each scaled tensor
    taking its original's place as it is made (the original let go there, not kept to the end)."""
    out = weights if in_place else dict(weights)
    for name in list(weights):  # the names only: no reference to a replaced tensor outlives its turn
        match = _TENSOR.fullmatch(name)
        if match is None:
            continue
        factor = _factor(cfg, cfg.layer_types[int(match[1])], match[2])
        if isinstance(factor, torch.Tensor) or factor != 1.0:
            try:
                out[name] = _scaled(weights[name], factor)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
    if cfg.logits_scaling != 1.0:
        out["norm_f.weight"] = _scaled(weights["norm_f.weight"], 1.0 / cfg.logits_scaling)
    return out
