"""Model layers over packed step inputs: Mamba2 mixer, attention, MLP, MoE."""

from .attention import AttentionLayer
from .mamba import MambaLayer
from .mlp import MLPLayer, MoELayer

__all__ = ["AttentionLayer", "MambaLayer", "MLPLayer", "MoELayer"]
