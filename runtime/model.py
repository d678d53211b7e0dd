"""The whole model: embedding, pre-norm residual blocks of any layer kind, final norm, LM head.

``forward`` takes packed step inputs and the state pool and returns logits only for
``inputs.logit_rows``. Every block is ``residual += mixer(norm(residual))``. Layer by layer, the
add is fused into the next norm (``rms_norm(..., residual=...)``). Small decode-only steps on a GPU
take the fused decode path instead when every layer offers one (``decode_fused``: Mamba2,
attention and MLP layers do, MoE layers do not): each block's norm rides in the prologue of its
first projection and the residual add in the epilogue of its last (``kernels.decode_linear``),
chained by programmatic dependent launch where that pays.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..kernels.decode_ids import fill_decode_ids
from ..kernels.decode_linear import ONE_TILE_MAX_K, norm_linear, pdl_supported
from ..kernels.embedding import embed_rows
from ..kernels.norm import rms_norm
from .config import ModelConfig
from .layers import AttentionLayer, MambaLayer, MLPLayer, MoELayer
from .presets import preset_config
from .step_inputs import StepInputs
from .weights import load_weights, random_weights

__all__ = ["Model", "fused_max_rows", "one_tile"]


def one_tile(cfg: ModelConfig) -> bool:
    """Whether every fused decode projection holds its whole K in registers (Mamba2-130M), as
    opposed to streaming K over several waves of programs (Nemotron-H-8B)."""
    widest = cfg.hidden_size
    if "mamba" in cfg.layer_types:
        widest = max(widest, cfg.mamba_inner)
    if "mlp" in cfg.layer_types:
        widest = max(widest, cfg.intermediate_size)
    if "attention" in cfg.layer_types:
        widest = max(widest, cfg.num_attention_heads * cfg.attention_head_dim)
    return widest <= ONE_TILE_MAX_K


def fused_max_rows(cfg: ModelConfig) -> int:
    """The largest decode batch that takes the fused path (when the model has one). Where its
    skinny projections hold the whole K in registers (Mamba2-130M) the fused step beats the
    layer-by-layer one up to 4 rows and loses at 8; where they stream K (Nemotron-H-8B) it wins
    at 1 row and ties at 2 (docs/BENCHMARKS.md)."""
    return 4 if one_tile(cfg) else 1


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
        # The fused decode path: on by default where it runs compiled (a switch for measurement)
        self.fused_decode = self.device.type == "cuda" and all(hasattr(l, "decode_fused") for l in self.layers)
        self.fused_max_rows = fused_max_rows(cfg)
        # Programmatic dependent launch between the fused kernels (kernels.decode_linear says when
        # each signals its dependents; docs/BENCHMARKS.md has the step with and without). A
        # switch, for measurement.
        self.pdl = pdl_supported(self.device)

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

    def forward(self, inputs: StepInputs, state, aux_stream=None, drawn: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [R, vocab] in fp32 for the rows ``inputs.logit_rows`` of the packed tokens.

        With ``aux_stream``, Mamba2 and attention layers run their prefill branch on it,
        overlapped with the decode branch on the current stream. ``drawn`` [slots]: the token
        each slot drew last step, which a decode row whose id is -1 takes as its input.
        """
        if self.fused_decode and inputs.prefill is None and 0 < inputs.num_decode <= self.fused_max_rows:
            return self._decode_fused(inputs, state, drawn)
        if drawn is not None:
            fill_decode_ids(inputs.input_ids[inputs.num_prefill_tokens :], inputs.decode_slots, drawn)
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

    def _decode_fused(self, inputs: StepInputs, state, drawn: torch.Tensor | None) -> torch.Tensor:
        ids = inputs.input_ids
        residual = torch.empty(ids.shape[0], self.embed.shape[1], dtype=self.residual_dtype, device=ids.device)
        # the first kernel after the step's copy: it also resolves the -1 ids from ``drawn``
        embed_rows(ids, self.embed, residual, pdl=self.pdl, slots=None if drawn is None else inputs.decode_slots,
                   drawn=drawn)
        for layer, norm_w in zip(self.layers, self.norms):
            layer.decode_fused(residual, norm_w, self.round_norm_first, inputs, state, self.pdl)
        rows = inputs.logit_rows
        if rows.shape[0] == 1:
            logits = torch.empty(1, self.lm_head.shape[0], dtype=torch.float32, device=residual.device)
            return norm_linear(residual, self.norm_f, self.cfg.norm_eps, self.lm_head, rows=rows,
                               round_first=self.round_norm_first, out=logits, pdl=self.pdl)
        # the vocabulary-wide projection re-used by several rows: cuBLAS
        h = rms_norm(residual.index_select(0, rows), self.norm_f, self.cfg.norm_eps, round_first=self.round_norm_first,
                     out=torch.empty(rows.shape[0], residual.shape[1], dtype=self.dtype, device=residual.device))
        return F.linear(h, self.lm_head).float()
