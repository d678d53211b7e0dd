"""The whole model: embedding, pre-norm residual blocks of any layer kind, final norm, LM head.

``forward`` takes packed step inputs and the state pool and returns logits only for
``inputs.logit_rows``. Every block is ``residual += mixer(norm(residual))``; the add is fused into
the next norm (``rms_norm(..., residual=...)``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..kernels.norm import rms_norm
from .config import ModelConfig
from .layers import AttentionLayer, MambaLayer, MLPLayer, MoELayer
from .presets import preset_config
from .step_inputs import StepInputs
from .weights import load_weights, random_weights

__all__ = ["Model"]

_LAYER_CLASSES = {"mamba": MambaLayer, "attention": AttentionLayer, "mlp": MLPLayer, "moe": MoELayer}


class Model:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.dtype = weights["embeddings.weight"].dtype
        self.device = weights["embeddings.weight"].device
        self.embed = weights["embeddings.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.norms = [weights[f"layers.{i}.norm.weight"] for i in range(cfg.num_layers)]
        self.norm_f = weights["norm_f.weight"]
        self.layers = [_LAYER_CLASSES[kind](cfg, i, weights) for i, kind in enumerate(cfg.layer_types)]
        self.residual_dtype = torch.float32 if cfg.residual_in_fp32 else self.dtype
        # HF's Mamba2 norm rounds before its weight, NemotronH's after (only bf16 tells them apart)
        self.round_norm_first = cfg.architecture == "mamba2"

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype=torch.bfloat16, device="cpu") -> "Model":
        """Load an HF checkpoint directory (config.json + safetensors)."""
        cfg = ModelConfig.from_pretrained(path)
        return cls(cfg, load_weights(path, cfg, dtype=dtype, device=device))

    @classmethod
    def from_preset(cls, name: str, *, dtype=torch.bfloat16, device="cpu", seed: int = 0) -> "Model":
        """A built-in model shape with random weights made on ``device``."""
        cfg = preset_config(name)
        return cls(cfg, random_weights(cfg, dtype=dtype, device=device, seed=seed))

    def forward(self, inputs: StepInputs, state, aux_stream=None) -> torch.Tensor:
        """Logits [R, vocab] in fp32 for the rows ``inputs.logit_rows`` of the packed tokens.

        With ``aux_stream``, Mamba2 and attention layers run their prefill branch on it,
        overlapped with the decode branch on the current stream.
        """
        x = F.embedding(inputs.input_ids, self.embed)
        residual = x.to(self.residual_dtype)
        h = rms_norm(x, self.norms[0], self.cfg.norm_eps, round_first=self.round_norm_first)
        for i, layer in enumerate(self.layers):
            out = layer.forward(h, inputs, state, aux_stream)
            norm_w = self.norms[i + 1] if i + 1 < len(self.layers) else self.norm_f
            # residual <- residual + out; h <- norm(residual)
            h = torch.empty_like(out)
            rms_norm(out, norm_w, self.cfg.norm_eps, residual=residual, out=h, round_first=self.round_norm_first)
        rows = h.index_select(0, inputs.logit_rows)
        return F.linear(rows, self.lm_head).float()
