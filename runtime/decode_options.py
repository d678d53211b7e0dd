"""How small decode-only steps run: one frozen value, fixed when the model is built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.decode_linear import MAX_ROWS, ONE_TILE_MAX_K, pdl_supported
from .config import ModelConfig

__all__ = ["DecodeOptions", "one_tile"]

# the largest fused decode batch where the projections stream K (``DecodeOptions.max_rows``; a
# module constant, so that ``bench ab`` variants can set it)
STREAMED_MAX_ROWS = 2


def one_tile(cfg: ModelConfig) -> bool:
    """Whether every fused decode projection holds its whole K in registers (Mamba2-130M), as
    opposed to streaming K over several waves of programs (Nemotron-H-8B)."""
    widest = cfg.hidden_size
    if cfg.has("mamba"):
        widest = max(widest, cfg.mamba_inner)
    if cfg.has("mlp"):
        widest = max(widest, cfg.intermediate_size)
    if cfg.has("attention"):
        widest = max(widest, cfg.num_attention_heads * cfg.attention_head_dim)
    if cfg.has("moe"):  # the shared expert's down projection
        widest = max(widest, cfg.moe_shared_expert_intermediate_size * cfg.n_shared_experts)
    return widest <= ONE_TILE_MAX_K


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """fused:    run small decode-only steps as each block's fused kernels (norm in the first
              projection, residual add in the last), where every mixer offers them (None: on
              CUDA; True on the CPU runs the fused ops' references, which checks the wiring)
    pdl:      chain those kernels by programmatic dependent launch (None: where the device and
              Triton support it)
    max_rows: the largest decode batch that takes the fused path (None: 4 where every
              projection's K fits one register tile, where the fused step beats the layered one
              up to 4 rows and loses at 8; else ``STREAMED_MAX_ROWS``, 2, where it wins at 1
              and 2 and ties at 4:
              Nemotron-H-8B on an H100 at 2 rows 5.89 ms against 6.36 layer by layer, at 4
              rows 6.61 against 6.56)
    tile_k:   stream K through every fused projection in tiles of this many columns, the way the
              large models' projections run (None: the kernels' own tile table)

    ``resolve`` turns the Nones into the model's values; ``max_rows`` 0 means no fused path.
    """

    fused: bool | None = None
    pdl: bool | None = None
    max_rows: int | None = None
    tile_k: int | None = None

    def __post_init__(self):
        if self.max_rows is not None and not 0 <= self.max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows: expected 0..{MAX_ROWS}, got {self.max_rows}")
        if self.tile_k is not None and (self.tile_k < 16 or self.tile_k & (self.tile_k - 1)):
            raise ValueError(f"tile_k: expected a power of two >= 16, got {self.tile_k}")

    def resolve(self, cfg: ModelConfig, device: torch.device, mixers_fuse: bool) -> "DecodeOptions":
        """The options a model of ``cfg`` on ``device`` runs with; ``mixers_fuse``: whether
        every one of its mixers offers a fused decode."""
        rows = self.max_rows
        if rows is None:
            rows = 4 if one_tile(cfg) and self.tile_k is None else STREAMED_MAX_ROWS
        fused = device.type == "cuda" if self.fused is None else self.fused
        if not (fused and mixers_fuse):
            rows = 0
        pdl = pdl_supported(device) if self.pdl is None else self.pdl and pdl_supported(device)
        return DecodeOptions(fused=rows > 0, pdl=pdl, max_rows=rows, tile_k=self.tile_k)
