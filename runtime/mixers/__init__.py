"""Mixers, one module per kind, under one block contract (``base``): Mamba2, attention, MLP, MoE,
and the parallel block (Mamba2 and attention side by side)."""

from .attention import AttentionMixer
from .base import Block, Mixer, Norm, StepContext
from .mamba2 import Mamba2Mixer
from .mlp import MLPMixer
from .moe import MoEMixer
from .parallel import ParallelMixer

# the config's layer kinds to their mixers
MIXERS: dict[str, type[Mixer]] = {"mamba": Mamba2Mixer, "attention": AttentionMixer, "mlp": MLPMixer, "moe": MoEMixer,
                                  "parallel": ParallelMixer}

__all__ = ["MIXERS", "AttentionMixer", "Block", "Mamba2Mixer", "MLPMixer", "Mixer", "MoEMixer", "Norm",
           "ParallelMixer", "StepContext"]
