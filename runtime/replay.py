"""A verify step's Mamba2 layout: each sequence's replayed rows, then its own tokens' rows.

A verify step leaves a slot's conv and SSM states at the sequence's last certain token and
drops the states after its drafts (``runtime.speculative``). The drafts it keeps are replayed by
the request's next verify step, but only through the Mamba2 recurrence, as ReplaySSM does: each
Mamba2 layer keeps the rows its in_proj wrote for a verify sequence's drafts (xBC before the
conv, and dt) in the slot's record (``StatePool.record``), and the next verify step's Mamba2
layers scan the kept ones, from the record, before the sequence's own tokens. Every other layer
sees the sequence's own tokens only: the attention layers' keys and values at the kept drafts'
positions were written by the step that verified them, from the same tokens. So a verify
sequence is its last token drawn and its new drafts, 1 + k tokens, however many the step before
kept; a MoE layer reads no kept draft's experts again.

The layout packs, per prefill sequence, its replayed rows and then its own, from row 0, then
padding: at most ``Tp + S k`` rows for a verify bucket of Tp tokens, S sequences and k drafts
(``layout_rows``). Its metadata is the conv's and the scan's over those rows, with each
sequence's snapshot (its checkpoint) moved past the rows it replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.varlen import PrefillMetadata, fill_prefill_metadata
from .plan import StepPlan

__all__ = ["Replay", "fill_replay", "layout_rows"]


@dataclass
class Replay:
    """meta:   PrefillMetadata of the layout's rows (``layout_rows``)
    src:    [layout rows] where each row's xBC and dt come from: a packed prefill row (>= 0), or
            record row r as -1 - r (``kernels.replay.gather_rows``); padding rows read row 0
    own:    [Tp] the layout row of each packed prefill row (padding: a padding row, which the
            scan leaves zero)
    record: [Tp] the record row each packed prefill row is kept in (a verify sequence's
            drafts: slot * stride + j for its j-th), or -1
    """

    meta: PrefillMetadata
    src: torch.Tensor | np.ndarray
    own: torch.Tensor | np.ndarray
    record: torch.Tensor | np.ndarray


def layout_rows(tokens: int, seqs: int, drafts: int) -> int:
    """The layout's rows for a bucket of ``tokens`` prefill tokens in up to ``seqs`` sequences
    of up to ``drafts`` drafts: each sequence may replay as many rows as it had drafts."""
    return tokens + seqs * drafts


def fill_replay(views: Replay, plan: StepPlan, stride: int) -> None:
    """Write ``plan``'s layout into host arrays ``views`` (every entry, so nothing of an earlier
    step survives). ``stride``: record rows a slot (``StatePool.drafts``); a sequence replays and
    keeps at most that many."""
    n, lens, slots = plan.num_prefill, plan.prefill_lens.astype(np.int64), plan.prefill_slots.astype(np.int64)
    replay = plan.replay_lens.astype(np.int64) if len(plan.replay_lens) else np.zeros(n, np.int64)
    drafts = plan.prefill_logits.astype(np.int64) - 1 if len(plan.prefill_logits) else np.zeros(n, np.int64)
    if n and (replay.max() > stride or drafts.max() > stride):
        raise ValueError(f"a verify sequence replays {replay.max()} or keeps {drafts.max()} rows; the record holds "
                         f"{stride} a slot")
    ext = lens + replay
    snapshots = None
    if len(plan.snapshot_slots):  # a verify sequence's checkpoint: after its replayed rows too
        snapshots = (plan.snapshot_slots, np.where(plan.snapshot_slots >= 0, plan.snapshot_tokens + replay, 0))
    fill_prefill_metadata(views.meta, ext, plan.prefill_slots, plan.prefill_context > 0, plan.prefill_context,
                          snapshots, plan.final_slots if len(plan.final_slots) else None)
    starts, ext_starts = np.cumsum(lens) - lens, np.cumsum(ext) - ext
    total, ext_total = int(lens.sum()), int(ext.sum())
    # layout rows: sequence i's j-th row replays record row slot * stride + j while j < replay[i],
    # then reads packed row starts[i] + j - replay[i]
    j = np.arange(ext_total) - np.repeat(ext_starts, ext)
    rep = np.repeat(replay, ext)
    views.src[:ext_total] = np.where(j < rep, -1 - (np.repeat(slots * stride, ext) + j),
                                     np.repeat(starts, ext) + j - rep)
    views.src[ext_total:] = 0
    views.own[:total] = np.arange(total) + np.repeat(np.cumsum(replay), lens)
    views.own[total:] = np.arange(total, len(views.own)) + int(replay.sum())
    # the drafts of a sequence are its last rows; the next verify step replays the kept ones
    views.record[:] = -1
    k = np.arange(total) - np.repeat(starts + lens - drafts, lens)
    keep = k >= 0
    views.record[:total][keep] = (np.repeat(slots * stride, lens) + k)[keep]
