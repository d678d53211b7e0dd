import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mambastep.kernels import PAD_SLOT_ID, PrefillMetadata, fill_prefill_metadata


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    chunk=st.sampled_from([1, 4, 8, 16]),
    extra_tokens=st.integers(0, 20),
    extra_seqs=st.integers(0, 3),
)
def test_chunks_cover_each_sequence_exactly(lens, chunk, extra_tokens, extra_seqs):
    total = sum(lens)
    meta = PrefillMetadata.empty_host(total + extra_tokens, len(lens) + extra_seqs, chunk)
    # poison: every entry must be rewritten
    for arr in meta.arrays().values():
        arr[:] = 12345
    fill_prefill_metadata(meta, lens, np.arange(len(lens)), np.ones(len(lens)))
    cu = meta.cu_seqlens
    for s, n in enumerate(lens):
        c0, c1 = meta.seq_chunk_start[s], meta.seq_chunk_start[s + 1]
        assert (meta.chunk_seq[c0:c1] == s).all()
        starts, ends = meta.chunk_start[c0:c1], meta.chunk_end[c0:c1]
        assert starts[0] == cu[s] and ends[-1] == cu[s + 1] == cu[s] + n
        assert (starts[1:] == ends[:-1]).all()
        assert ((ends - starts) <= chunk).all() and ((ends - starts) > 0).all()
        assert (meta.seq_idx[cu[s] : cu[s + 1]] == s).all()
    used = meta.seq_chunk_start[len(lens)]
    assert (meta.chunk_seq[used:] == -1).all()
    assert (meta.seq_idx[total:] == -1).all()
    assert (meta.slot_idx[len(lens):] == PAD_SLOT_ID).all()
    assert (meta.has_initial_state[len(lens):] == 0).all()
    assert (meta.context_lens == 0).all()
    assert (meta.cu_seqlens[len(lens):] == total).all()


def test_rejects_overflow_and_empty():
    meta = PrefillMetadata.empty_host(8, 2, 4)
    with pytest.raises(ValueError, match="max_tokens"):
        fill_prefill_metadata(meta, [5, 4], [0, 1], [0, 0])
    with pytest.raises(ValueError, match="max_seqs"):
        fill_prefill_metadata(meta, [1, 1, 1], [0, 1, 2], [0, 0, 0])
    with pytest.raises(ValueError, match="at least one token"):
        fill_prefill_metadata(meta, [3, 0], [0, 1], [0, 0])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), lens=st.lists(st.integers(1, 40), min_size=1, max_size=6), chunk=st.sampled_from([1, 4, 8, 16]))
def test_a_snapshot_cuts_the_chunk_grid_at_its_row(data, lens, chunk):
    """Chunks of a sequence with a snapshot inside run on the grid from its start up to the
    snapshot's row and on the grid from that row after it, as two prefills would; the others'
    are as without snapshots."""
    snap_tokens = [data.draw(st.integers(1, n)) for n in lens]
    live = [data.draw(st.booleans()) for _ in lens]
    snap_slots = [10 + i if on else -1 for i, on in enumerate(live)]
    meta = PrefillMetadata.empty_host(sum(lens), len(lens) + 1, chunk)
    for arr in meta.arrays().values():
        arr[:] = 12345
    fill_prefill_metadata(meta, lens, np.arange(len(lens)), np.ones(len(lens)), snapshots=(snap_slots, snap_tokens))
    cu = meta.cu_seqlens
    for s, n in enumerate(lens):
        c0, c1 = meta.seq_chunk_start[s], meta.seq_chunk_start[s + 1]
        assert (meta.chunk_seq[c0:c1] == s).all()
        starts, ends = meta.chunk_start[c0:c1] - cu[s], meta.chunk_end[c0:c1] - cu[s]
        at = snap_tokens[s] if live[s] and snap_tokens[s] < n else n
        want = list(range(0, at, chunk)) + list(range(at, n, chunk))
        assert starts.tolist() == want
        assert ends.tolist() == want[1:] + [n]
        assert meta.snapshot_slot[s] == snap_slots[s] if live[s] else meta.snapshot_slot[s] == PAD_SLOT_ID
        if live[s]:
            assert meta.snapshot_row[s] == cu[s] + snap_tokens[s]
    assert meta.final_slot[: len(lens)].tolist() == list(range(len(lens)))
    assert meta.final_slot[len(lens)] == PAD_SLOT_ID
    assert (meta.chunk_seq[meta.seq_chunk_start[len(lens)] :] == -1).all()
