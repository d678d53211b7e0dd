"""mambastep: a CUDA-graph-centric decode runtime for Mamba2 and hybrid Mamba2/attention models."""

__version__ = "0.1.0"
