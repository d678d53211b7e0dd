"""Mixers, one module per kind, under one block contract (``base``): Mamba2, attention, MLP, MoE."""

from .attention import AttentionMixer
from .base import Block, Mixer, Norm, StepContext
from .mamba2 import Mamba2Mixer
from .mlp import MLPMixer
from .moe import MoEMixer

# the config's layer kinds to their mixers
MIXERS: dict[str, type[Mixer]] = {"mamba": Mamba2Mixer, "attention": AttentionMixer, "mlp": MLPMixer, "moe": MoEMixer}

__all__ = ["MIXERS", "AttentionMixer", "Block", "Mamba2Mixer", "MLPMixer", "Mixer", "MoEMixer", "Norm", "StepContext"]
