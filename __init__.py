"""mambastep: a CUDA-graph-centric decode runtime for Mamba2 and hybrid Mamba2/attention models.

    from mambastep import Engine, SamplingParams
"""

# The checkout's root is the package. pytest imports this file as a test package's __init__
# too, by the checkout's directory name; where that name is no Python name (a download unpacked
# as mambastep-main) it imports the file on its own, with no parent to import from.
if __package__:
    from .runtime import DecodeOptions, Engine, Model, ModelConfig, RequestOutput, SamplingParams

__all__ = ["DecodeOptions", "Engine", "Model", "ModelConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
