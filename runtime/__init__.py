"""Config, weights, model layers, state pool, step buffers, scheduler, sampling and the Engine."""

from .config import ConfigError, ModelConfig
from .engine import Engine, RequestOutput
from .model import Model
from .sampling import SamplingParams
from .weights import WeightError

__all__ = ["ConfigError", "Engine", "Model", "ModelConfig", "RequestOutput", "SamplingParams", "WeightError"]
