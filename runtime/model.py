"""The whole model: embedding, blocks (norm, mixer) of any kind, final norm, LM head.

``forward`` takes packed step inputs and the state pool and returns logits only for
``inputs.logit_rows``. Each block is ``residual += mixer(norm(residual))`` (``mixers.base``), run
one of two ways, chosen by one rule fixed when the model is built (``takes_fused``):

- layer by layer, any step: each block's residual add is folded into the next block's norm
  (``rms_norm(..., residual=...)``);
- fused, small decode-only steps where every mixer offers it: each block's norm rides in the
  prologue of its first projection and the residual add in the epilogue of its last
  (``kernels.decode_linear``), chained by programmatic dependent launch where the options say.

Either way the first kernel gathers the embeddings into the residual stream, resolving a decode
row's -1 id to the token its slot drew last step (``kernels.embedding``).

``fold_norms``: a block norm whose output only one projection reads (Mamba2's in_proj,
attention's qkv, the MLP's up) has its weight folded into that projection's columns when the
model is built, and keeps a unit weight. By default where the fused decode streams K (the
Nemotron sizes): there the norm weight was a third input stream in every K tile, about 0.8 us a
projection at one row (docs/experiments.md). The folded weight is rounded once to the weights'
dtype; in bf16 that moves the products by about as much as HF's own rounding of the normed row.

Layer by layer, a block norm whose mixer's FP8 products would quantize its output per row
(``Mixer.takes_rows``: W8A8 with dynamic scales, past a few rows) writes it quantized too
(``NORM_ROWS``), so those products skip the quantizer's launch; the values are the quantizer's
to the bit.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch

from ..kernels.decode_linear import norm_linear
from ..kernels.embedding import embed_rows
from ..kernels.fp8 import Fp8Rows
from ..kernels.linear import linear
from .config import ModelConfig
from .decode_options import DecodeOptions, one_tile
from .mixers import MIXERS, Block, Norm, StepContext
from .multipliers import fold_multipliers
from .presets import preset_config
from .quantization import online_fp8
from .state_pool import StatePool
from .step_inputs import StepInputs
from .weights import load_weights, quantize_online, random_weights

# what ``quantization=`` takes: None (weights as stored), or "fp8" (FP8 at load where not stored so)
QUANTIZATIONS = (None, "fp8")
# block norms write their output quantized per row where the mixer's FP8 products take it (see
# the module doc); off, those products quantize it themselves (the same values, a launch more)
NORM_ROWS = True

__all__ = ["Model"]


class Model:
    # the checkpoint's multi-token prediction layers, by checkpoint name, where loaded with
    # ``mtp=True`` (``runtime.mtp``)
    mtp_weights: dict[str, torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], options: DecodeOptions | None = None,
                 fold_norms: bool | None = None, *, consume: bool = False):
        """weights: the checkpoint's tensors by name (``runtime.weights``; not modified, nor the dict
        unless ``consume``); options: how small decode steps run (default: ``DecodeOptions()``,
        resolved for the model and device); fold_norms: see the module doc (None: where the fused
        decode streams K); consume: the dict is the model's to take apart (``from_pretrained``,
        ``from_preset``): it is emptied, and each tensor the model replaces (a multiplier or a norm
        folded in) is let go as its replacement is made, so building the model needs its own
        memory and one tensor's more, where a dict held to the end kept the replaced tensors too
        (Falcon-H1-34B's in_proj and up_proj are 36 of its 63 GiB)."""
        self.cfg = cfg
        weights = fold_multipliers(cfg, weights, in_place=consume)
        self.embed = weights["embeddings.weight"]
        self.embed_scale = cfg.embedding_multiplier
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        round_first = cfg.architecture != "nemotron_h"
        self.blocks = []
        for i, kind in enumerate(cfg.layer_types):
            self.blocks.append(Block(Norm(weights[f"layers.{i}.norm.weight"], cfg.norm_eps, round_first),
                                     MIXERS[kind](cfg, i, weights)))
            if consume:  # the block holds what it took: a tensor it replaced (stacked, joined) goes now
                for name in [n for n in weights if n.startswith(f"layers.{i}.")]:
                    del weights[name]
        self.final_norm = Norm(weights["norm_f.weight"], cfg.norm_eps, round_first)
        if consume:
            weights.clear()  # a norm folded below frees its reader's original
        if fold_norms is None:
            fold_norms = not one_tile(cfg)
        if fold_norms:
            self.blocks = [_folded(block) for block in self.blocks]
        self.residual_dtype = torch.float32 if cfg.residual_in_fp32 else self.dtype
        self.options = self._resolve(options or DecodeOptions())

    def _resolve(self, options: DecodeOptions) -> DecodeOptions:
        fuse = all(block.mixer.fuses_decode for block in self.blocks)
        return options.resolve(self.cfg, self.device, fuse)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype=torch.bfloat16, device="cpu",
                        options: DecodeOptions | None = None, fold_norms: bool | None = None,
                        quantization: str | None = None, mtp: bool = False) -> "Model":
        """Load an HF checkpoint directory (config.json + safetensors). An FP8 checkpoint is read
        as stored; ``quantization="fp8"`` quantizes a full-precision one's linears at load time
        (``runtime.quantization.online_fp8``). ``mtp``: its multi-token prediction layers too
        (``mtp_weights``, in the checkpoint's precision)."""
        cfg = ModelConfig.from_pretrained(path)
        weights = load_weights(path, cfg, dtype=dtype, device=device)
        mtp_weights = _mtp_source(cfg, path, mtp) and load_weights(path, cfg, dtype=dtype, device=device, mtp=True)
        cfg, weights = _quantized(cfg, weights, quantization)
        return cls(cfg, weights, options, fold_norms, consume=True)._with_mtp(mtp_weights)

    @classmethod
    def from_preset(cls, name: str, *, dtype=torch.bfloat16, device="cpu", seed: int = 0,
                    options: DecodeOptions | None = None, fold_norms: bool | None = None,
                    quantization: str | None = None, mtp: bool = False) -> "Model":
        """A built-in model shape with random weights made on ``device`` (``quantization`` and
        ``mtp`` as in ``from_pretrained``)."""
        cfg = preset_config(name)
        mtp_weights = _mtp_source(cfg, name, mtp) and random_weights(cfg, dtype=dtype, device=device,
                                                                     seed=seed + 1, mtp=True)
        cfg, weights = _quantized(cfg, random_weights(cfg, dtype=dtype, device=device, seed=seed), quantization)
        return cls(cfg, weights, options, fold_norms, consume=True)._with_mtp(mtp_weights)

    def _with_mtp(self, weights: dict[str, torch.Tensor] | None) -> "Model":
        self.mtp_weights = weights or None
        return self

    def with_options(self, options: DecodeOptions) -> "Model":
        """The same weights run with other decode options (a variant to compare against)."""
        variant = copy.copy(self)
        variant.options = self._resolve(options)
        return variant

    def takes_fused(self, inputs: StepInputs) -> bool:
        """The one rule: a decode-only step of at most ``options.max_rows`` rows (0 when the
        model has no fused path) runs fused; every other step layer by layer."""
        return inputs.prefill is None and 0 < inputs.num_decode <= self.options.max_rows

    def forward(self, inputs: StepInputs, pool: StatePool, aux_stream=None,
                drawn: torch.Tensor | None = None, observe=None, side_stream=None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [R, vocab] in fp32 for the rows ``inputs.logit_rows`` of the packed tokens.

        With ``aux_stream``, mixers run their prefill branch on it, overlapped with the decode
        branch on the current stream; with ``side_stream``, MoE layers run their shared expert
        on it beside the routed ones, parallel blocks their attention (see StepContext).
        ``drawn`` [slots]: the token each slot drew last step, which a decode row whose id is -1
        takes as its input. ``observe``: see StepContext. ``hidden`` [>= T, D]: where every packed
        row's final hidden state (the final norm's output, which its logits come from) is written,
        for a drafter that reads them (``runtime.mtp``).
        """
        ctx = StepContext(inputs, pool, aux_stream, self.options, observe, side_stream)
        ids = inputs.input_ids
        residual = torch.empty(ids.shape[0], self.embed.shape[1], dtype=self.residual_dtype, device=ids.device)
        # in a fused step, the first kernel after the step's copy and the head of the PDL chain
        fused = self.takes_fused(inputs)
        embed_rows(ids, self.embed, residual, pdl=fused and self.options.pdl,
                   slots=None if drawn is None else inputs.decode_slots, drawn=drawn, scale=self.embed_scale)
        rows = None if hidden is None else hidden[: ids.shape[0]]
        if fused:
            return self._fused_decode(residual, ctx, rows)
        return self._layered(residual, ctx, rows)

    def _layered(self, residual: torch.Tensor, ctx: StepContext, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks layer by layer, then the logit rows; ``hidden`` [T, D]: where the final
        norm writes every row (the hidden states a drafter reads), else a buffer of its own."""
        rows = self._rows(self.blocks[0].mixer, residual)
        h = self.blocks[0].norm(residual, out=torch.empty(residual.shape, dtype=self.dtype, device=residual.device),
                                rows=rows)
        for i, block in enumerate(self.blocks):
            out = block.mixer.forward(h, ctx, rows)
            # residual <- residual + out; h <- the next block's norm(residual), or the final norm's
            if i + 1 < len(self.blocks):
                next_norm, rows = self.blocks[i + 1].norm, self._rows(self.blocks[i + 1].mixer, residual)
                h = torch.empty_like(out)
            else:
                next_norm, rows = self.final_norm, None
                h = hidden if hidden is not None else torch.empty_like(out)
            next_norm(out, residual=residual, out=h, rows=rows)
        h = h.index_select(0, ctx.inputs.logit_rows)
        return linear(h, self.lm_head).float()

    def _rows(self, mixer, residual: torch.Tensor) -> Fp8Rows | None:
        """Where the block norm before ``mixer`` writes its output quantized per row (see the
        module doc), or None."""
        T, D = residual.shape
        if NORM_ROWS and mixer.takes_rows(T, self.dtype, residual.device):
            return Fp8Rows.empty(T, D, residual.device)
        return None

    def _fused_decode(self, residual: torch.Tensor, ctx: StepContext,
                      hidden: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            block.mixer.fused_decode(residual, block.norm, ctx)
        rows, norm = ctx.inputs.logit_rows, self.final_norm
        if hidden is not None:  # the logits' own norm rides in their kernel: the rows' is one more
            norm(residual, out=hidden)
        logits = torch.empty(rows.shape[0], self.lm_head.shape[0], dtype=torch.float32, device=residual.device)
        return norm_linear(residual, norm.weight, norm.eps, self.lm_head, rows=rows, round_first=norm.round_first,
                           out=logits, pdl=self.options.pdl, tile_k=self.options.tile_k)


def _quantized(cfg: ModelConfig, weights: dict, quantization: str | None):
    """(config, weights) after the load-time quantization asked for, if any."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: expected one of {QUANTIZATIONS[1:]} or None, got {quantization!r}")
    if quantization is None or cfg.quantization is not None:  # a quantized checkpoint stays as stored
        return cfg, weights
    quant = online_fp8(cfg.layer_types)
    return replace(cfg, quantization=quant), quantize_online(weights, quant)


def _mtp_source(cfg: ModelConfig, source, mtp: bool) -> bool:
    """Whether to read ``source``'s MTP layers: asked for, and there (else an error naming it)."""
    if mtp and not cfg.mtp_layer_types:
        raise ValueError(f"{source}: no multi-token prediction layers (num_nextn_predict_layers is 0) to draft with")
    return mtp


def _folded(block: Block) -> Block:
    """The block with its norm's weight folded into its mixer's one reader, if it has one."""
    norm = block.norm
    if not block.mixer.absorb_norm(norm.weight):
        return block
    return Block(Norm(torch.ones_like(norm.weight), norm.eps, norm.round_first, unit=True), block.mixer)
