"""Config, weights, blocks and mixers, state pool, step buffers, scheduler, step runner and the
Engine, over the graph runner (``graphs``) and the kernels (``kernels``)."""

from .config import ConfigError, ModelConfig
from .decode_options import DecodeOptions
from .engine import Engine
from .model import Model
from .request import RequestOutput, SamplingParams
from .weights import WeightError

__all__ = ["ConfigError", "DecodeOptions", "Engine", "Model", "ModelConfig", "RequestOutput", "SamplingParams",
           "WeightError"]
