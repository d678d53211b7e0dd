"""A verify step's Mamba2 layout (``runtime.replay``), written into poisoned host arrays."""

import numpy as np
import pytest

from mambastep.graphs import Bucket
from mambastep.runtime.plan import StepPlan
from mambastep.runtime.step_buffers import StepBuffers

i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731


def verify_plan(replay) -> StepPlan:
    """Slot 3: its last token and 2 drafts; slot 1: its last token alone (no drafts); slot 0: its
    last token and 1 draft; each after ``replay`` kept drafts of the step before."""
    return StepPlan(prefill_tokens=np.arange(1, 7), prefill_lens=i32([3, 1, 2]), prefill_slots=i32([3, 1, 0]),
                    prefill_context=i32([10, 20, 30]), snapshot_slots=i32([3, -1, 0]), snapshot_tokens=i32([1, 0, 1]),
                    final_slots=i32([-1, 1, -1]), prefill_logits=i32([3, 1, 2]), replay_lens=i32(replay))


def test_the_layout_puts_each_sequence_s_replayed_rows_before_its_own():
    buffers = StepBuffers(max_decode=4, max_prefill_tokens=16, max_prefill_seqs=4, chunk_size=4, max_drafts=2,
                          record_stride=3)
    bucket = Bucket(0, 8, 2)
    layout = buffers._replay(buffers.arena.np, bucket)
    for a in (layout.src, layout.own, layout.record, *layout.meta.arrays().values()):
        a[:] = 12345  # poison: every entry is written
    buffers.fill(verify_plan([2, 1, 0]), bucket)
    # layout rows: slot 3's record rows 9, 10 then packed rows 0-2; slot 1's record row 3, then
    # packed row 3; slot 0's packed rows 4, 5; then padding (8 + 4 x 2 = 16 rows)
    assert layout.src.tolist() == [-10, -11, 0, 1, 2, -4, 3, 4, 5] + [0] * 7
    assert layout.own.tolist() == [2, 3, 4, 6, 7, 8, 9, 10]
    # the drafts' rows are kept: slot 3's two at its record rows 9, 10, slot 0's one at 0
    assert layout.record.tolist() == [-1, 9, 10, -1, -1, 0, -1, -1]
    meta = layout.meta
    assert meta.cu_seqlens.tolist() == [0, 5, 7, 9, 9] and meta.seq_idx.tolist() == [0] * 5 + [1, 1, 2, 2] + [-1] * 7
    # checkpoints past the replayed rows and the last token: slot 3 after 3 rows, slot 0 after 1
    assert meta.snapshot_slot.tolist() == [3, -1, 0, -1] and meta.snapshot_row.tolist() == [3, 0, 8, 0]
    assert meta.final_slot.tolist() == [-1, 1, -1, -1]
    # the model's own metadata is the sequences' own tokens
    assert buffers.arena.np["cu_seqlens"][:5].tolist() == [0, 3, 4, 6, 6]


def test_a_replay_past_the_record_or_outside_a_verify_bucket_is_refused():
    buffers = StepBuffers(max_decode=4, max_prefill_tokens=16, max_prefill_seqs=4, chunk_size=4, max_drafts=2,
                          record_stride=2)
    with pytest.raises(ValueError, match="replays 3 or keeps 2 rows; the record holds 2 a slot"):
        buffers.fill(verify_plan([3, 0, 0]), Bucket(0, 8, 2))
    plan = StepPlan.make([([1, 2], 0, 5)])
    plan.replay_lens = i32([1])
    with pytest.raises(ValueError, match="outside a verify bucket"):
        buffers.fill(plan, Bucket(0, 8))
