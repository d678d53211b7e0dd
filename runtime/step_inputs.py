"""The inputs of one forward pass: packed tokens and the metadata every layer shares.

Tokens are packed as ``[prefill tokens | decode tokens]``: rows ``[0, Tp)`` belong to prefill
sequences described by ``prefill`` (Tp = ``prefill.max_tokens``, static), rows ``[Tp, Tp + B)``
are one decode token each (B = ``decode_slots.shape[0]``, static). Padding rows carry
``PAD_SLOT_ID`` and are inert. All tensors live on the model's device; the runtime's step
buffers hand out views of its preallocated arena, tests build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.varlen import PrefillMetadata
from .replay import Replay

__all__ = ["StepInputs"]


@dataclass
class StepInputs:
    """input_ids:      [Tp + B] int64 token ids
    prefill:        PrefillMetadata of the Tp prefill rows, or None for a decode-only step
    decode_slots:   [B] int32 state slot of each decode row, PAD_SLOT_ID for padding
    decode_kv_lens: [B] int32 context length of each decode row including its new token
    logit_rows:     [R] int64 packed rows whose logits are computed (last prompt tokens, decodes)
    replay:         a speculative step's (a verify bucket), the layout its Mamba2 layers scan:
                    each sequence's kept drafts replayed from the record, then its own tokens
                    (``runtime.replay``); None in every other step
    row_slots:      [R] int32 the slot whose next decode input each logit row's draw becomes,
                    PAD_SLOT_ID for none (the plan's ``sample_slots``); None where tests build
                    inputs without it
    route_as:       [Tp + B] int32 the row whose experts each packed row takes (itself; a padding
                    row, the first live one), so padding adds no expert to a MoE layer's reads;
                    None: every row routes as itself
    """

    input_ids: torch.Tensor
    prefill: PrefillMetadata | None
    decode_slots: torch.Tensor
    decode_kv_lens: torch.Tensor
    logit_rows: torch.Tensor
    replay: Replay | None = None
    row_slots: torch.Tensor | None = None
    route_as: torch.Tensor | None = None

    @property
    def num_prefill_tokens(self) -> int:
        return 0 if self.prefill is None else self.prefill.max_tokens

    @property
    def num_decode(self) -> int:
        return self.decode_slots.shape[0]
