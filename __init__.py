"""mambastep: a CUDA-graph-centric decode runtime for Mamba2 and hybrid Mamba2/attention models.

    from mambastep import Engine, SamplingParams
"""

from .runtime import DecodeOptions, Engine, Model, ModelConfig, RequestOutput, SamplingParams

__all__ = ["DecodeOptions", "Engine", "Model", "ModelConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
