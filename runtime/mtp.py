"""Nemotron 3's multi-token prediction (MTP) layers, as the model of a drafter.

An MTP depth (``mtp.layers.{j}`` in the checkpoint, ``runtime.weights.mtp_weight_shapes``)
predicts the token after next. At position i it reads the target's hidden state there (the
final norm's output, which the target's logits come from) and the embedding of token i + 1,
fused as ``eh_proj([enorm(embedding), hnorm(hidden)])``; then its blocks run as a model's do
(Nemotron 3 Super's: attention, then MoE), with a KV cache of their own, and the last block's
``final_layernorm`` gives h', whose logits come from the target's LM head.

Drafting k tokens after a target step: the positions the target ran since the last draft go in
as one prefill chunk (tokens shifted by one, the target's hidden states beside them), whose last
row drafts the first token; each further draft is a decode row fed the token just drafted and
the h' of the row before (one depth reused, as vLLM and TensorRT-LLM draft with it).

``MTPModel`` is a ``Model`` whose first stage is that fusion, so a step runner runs and captures
it as it does any model. Hidden states come in through two device buffers it owns: a prefill
row's from ``hidden_in`` (packed as the step's tokens are; the drafter fills it before the
step), a decode row's from ``slot_hidden``, where every step leaves each logit row's h' by the
slot its draw feeds (``StepInputs.row_slots``), as the runner's ``slot_tokens`` keeps the draw.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.embedding import embed_rows
from .mixers import Norm, StepContext
from .model import Model
from .state_pool import StatePool
from .step_inputs import StepInputs

__all__ = ["MTPModel"]


class MTPModel(Model):
    def __init__(self, target: Model, weights: dict[str, torch.Tensor], *, num_slots: int, max_tokens: int):
        """target: the model whose MTP layers these are (its embeddings, LM head, config);
        weights: the layers' tensors by checkpoint name (``load_weights(..., mtp=True)``);
        num_slots: the state slots the drafter's pool has; max_tokens: the most prefill tokens a
        step of it takes (``hidden_in``'s rows)."""
        cfg = target.cfg
        if not cfg.mtp_depths:
            raise ValueError("num_nextn_predict_layers: the checkpoint has no multi-token prediction layers")
        if cfg.mtp_depths > 1:
            raise ValueError(f"num_nextn_predict_layers: {cfg.mtp_depths} MTP depths; mambastep drafts with a "
                             "checkpoint's one depth")
        recurrent = sorted({k for k in cfg.mtp_layer_types if k in ("mamba", "parallel")})
        if recurrent:
            raise ValueError(f"mtp_layers_block_type: {recurrent} MTP layers; mambastep drafts with attention, MLP "
                             "and MoE ones (a Mamba2 state would need rolling back per draft)")
        last = len(cfg.mtp_layer_types) - 1
        inner = {name.removeprefix("mtp."): t for name, t in weights.items()}
        inner["embeddings.weight"] = target.embed
        inner["norm_f.weight"] = inner.pop(f"layers.{last}.final_layernorm.weight")
        if not cfg.tie_word_embeddings:
            inner["lm_head.weight"] = target.lm_head
        super().__init__(cfg.mtp_config(), inner, fold_norms=False)
        self.embed_scale = target.embed_scale
        self.enorm = Norm(inner["layers.0.enorm.weight"], cfg.norm_eps, self.final_norm.round_first)
        self.hnorm = Norm(inner["layers.0.hnorm.weight"], cfg.norm_eps, self.final_norm.round_first)
        self.eh_proj = inner["layers.0.eh_proj.weight"]
        D = cfg.hidden_size
        self.hidden_in = torch.zeros(max_tokens, D, dtype=self.dtype, device=self.device)
        # h' by slot, the next decode row's hidden state; the extra last row takes those of rows
        # that feed no slot
        self.slot_hidden = torch.zeros(num_slots + 1, D, dtype=self.dtype, device=self.device)

    def takes_fused(self, inputs: StepInputs) -> bool:
        return False  # h' of every logit row is kept, which the fused decode's last kernel never forms

    def forward(self, inputs: StepInputs, pool: StatePool, aux_stream=None,
                drawn: torch.Tensor | None = None, observe=None, side_stream=None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [R, vocab] fp32 of ``inputs.logit_rows``, as ``Model.forward`` (``hidden``: where
        every row's h' goes); h' of the logit rows goes to ``slot_hidden`` by ``inputs.row_slots``."""
        ctx = StepContext(inputs, pool, aux_stream, self.options, observe, side_stream)
        ids, trash = inputs.input_ids, self.slot_hidden.shape[0] - 1
        T, D = ids.shape[0], self.embed.shape[1]
        tokens = torch.empty(T, D, dtype=self.dtype, device=ids.device)
        embed_rows(ids, self.embed, tokens, slots=None if drawn is None else inputs.decode_slots, drawn=drawn,
                   scale=self.embed_scale)
        decode = torch.where(inputs.decode_slots >= 0, inputs.decode_slots, trash).long()
        before = torch.cat([self.hidden_in[: inputs.num_prefill_tokens], self.slot_hidden.index_select(0, decode)])
        fused = torch.cat([self.enorm(tokens), self.hnorm(before)], dim=1)
        residual = F.linear(fused, self.eh_proj).to(self.residual_dtype)
        out = torch.empty(T, D, dtype=self.dtype, device=ids.device) if hidden is None else hidden[:T]
        logits = self._layered(residual, ctx, hidden=out)
        where = torch.where(inputs.row_slots >= 0, inputs.row_slots, trash).long()
        self.slot_hidden.index_copy_(0, where, out.index_select(0, inputs.logit_rows))
        return logits
