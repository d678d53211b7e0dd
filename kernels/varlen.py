"""Metadata for packed variable-length prefill tokens, shared by the conv and SSD kernels.

Prefill tokens of several sequences are packed into one static buffer of ``max_tokens`` rows;
the metadata arrays here have static sizes too (``max_tokens``, ``max_seqs``, ``max_chunks``) so
kernel launch shapes never depend on the step's lengths. Unused entries are inert:

- sequences past the live ones have length 0 (``cu_seqlens`` repeats the total) and
  ``slot_idx == PAD_SLOT_ID``;
- tokens past the last sequence have ``seq_idx == -1``;
- chunks past the live ones have ``chunk_seq == -1``.

Kernels skip anything marked so: they neither read nor write a state slot for it (the skip
sentinel, never a reserved pad slot), and write zeros to its output rows.

SSD chunks are *logical* chunks aligned to each sequence's start: a sequence of length L owns
``ceil(L / chunk_size)`` consecutive chunks, the last one possibly short, so no chunk ever holds
tokens of two sequences. A sequence with a snapshot inside it is chunked as two: from its start
to the snapshot's row, and from there to its end, so the scan passes the state at that row from
one chunk to the next (the snapshot is that state), and everything after the row is computed as
a prefill resumed there would compute it. A sequence need not start on a multiple of
``chunk_size`` in the packed buffer. The number of chunks is bounded by
``max_tokens / chunk_size + 2 * max_seqs``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

__all__ = ["PAD_SLOT_ID", "PrefillMetadata", "max_chunks_for", "fill_prefill_metadata"]

# Slot index of a padded row or an unused sequence: kernels skip it.
PAD_SLOT_ID = -1


def max_chunks_for(max_tokens: int, max_seqs: int, chunk_size: int) -> int:
    """Upper bound on logical chunks for ``max_seqs`` sequences totalling ``max_tokens``, each
    cut at most once by a snapshot."""
    return -(-max_tokens // chunk_size) + 2 * max_seqs


@dataclass
class PrefillMetadata:
    """Per-step prefill metadata: numpy arrays on the host, tensors (int32) on the device.

    cu_seqlens:        [max_seqs + 1] packed token offset of each sequence; unused ones repeat the total
    seq_idx:           [max_tokens]   sequence of each packed token, -1 past the last sequence
    slot_idx:          [max_seqs]     state slot of each sequence, PAD_SLOT_ID when unused
    has_initial_state: [max_seqs]     1 when the sequence continues from the state in its slot
    context_lens:      [max_seqs]     tokens already in the slot before this step's (KV offset)
    chunk_seq:         [max_chunks]   sequence of each logical chunk, -1 when unused
    chunk_start:       [max_chunks]   first packed token of each chunk
    chunk_end:         [max_chunks]   one past the last packed token of each chunk
    seq_chunk_start:   [max_seqs + 1] first chunk of each sequence (cumulative over chunks)
    final_slot:        [max_seqs]     slot the sequence's conv and SSM states after its last token
                                      go to: its own (``slot_idx``), or PAD_SLOT_ID for none (a
                                      speculative step's, whose drafts may be rejected)
    snapshot_slot:     [max_seqs]     slot to snapshot the sequence's conv and SSM states into at
                                      ``snapshot_row``, PAD_SLOT_ID when none (a prefix cache's;
                                      a speculative step's own slot)
    snapshot_row:      [max_seqs]     packed row the snapshot's tokens end before: past the
                                      sequence's first token, at most its end (a chunk starts there)
    chunk_size:        SSD chunk size the chunks were cut with (static)
    """

    cu_seqlens: torch.Tensor | np.ndarray
    seq_idx: torch.Tensor | np.ndarray
    slot_idx: torch.Tensor | np.ndarray
    has_initial_state: torch.Tensor | np.ndarray
    context_lens: torch.Tensor | np.ndarray
    chunk_seq: torch.Tensor | np.ndarray
    chunk_start: torch.Tensor | np.ndarray
    chunk_end: torch.Tensor | np.ndarray
    seq_chunk_start: torch.Tensor | np.ndarray
    final_slot: torch.Tensor | np.ndarray
    snapshot_slot: torch.Tensor | np.ndarray
    snapshot_row: torch.Tensor | np.ndarray
    chunk_size: int

    @property
    def max_tokens(self) -> int:
        return self.seq_idx.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.slot_idx.shape[0]

    @property
    def max_chunks(self) -> int:
        return self.chunk_seq.shape[0]

    def arrays(self) -> dict[str, torch.Tensor | np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "chunk_size"}

    @classmethod
    def empty_host(cls, max_tokens: int, max_seqs: int, chunk_size: int) -> "PrefillMetadata":
        """Zeroed int32 numpy arrays of the static sizes."""
        n_chunks = max_chunks_for(max_tokens, max_seqs, chunk_size)
        z = lambda n: np.zeros(n, dtype=np.int32)  # noqa: E731
        return cls(
            cu_seqlens=z(max_seqs + 1), seq_idx=z(max_tokens), slot_idx=z(max_seqs),
            has_initial_state=z(max_seqs), context_lens=z(max_seqs), chunk_seq=z(n_chunks), chunk_start=z(n_chunks),
            chunk_end=z(n_chunks), seq_chunk_start=z(max_seqs + 1), final_slot=z(max_seqs), snapshot_slot=z(max_seqs),
            snapshot_row=z(max_seqs), chunk_size=chunk_size,
        )

    def to(self, device: torch.device | str) -> "PrefillMetadata":
        """Device copy of host metadata (tests and eager use; the runtime copies one arena)."""
        moved = {k: torch.as_tensor(v).to(device) for k, v in self.arrays().items()}
        return PrefillMetadata(**moved, chunk_size=self.chunk_size)

    @classmethod
    def build(
        cls,
        seq_lens,
        slots,
        has_initial_state=None,
        context_lens=None,
        snapshots=None,
        final_slots=None,
        *,
        chunk_size: int,
        max_tokens: int | None = None,
        max_seqs: int | None = None,
        device: torch.device | str = "cpu",
    ) -> "PrefillMetadata":
        """Metadata for sequences of ``seq_lens`` packed from token 0, on ``device``."""
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        max_tokens = int(seq_lens.sum()) if max_tokens is None else max_tokens
        max_seqs = len(seq_lens) if max_seqs is None else max_seqs
        meta = cls.empty_host(max(max_tokens, 1), max(max_seqs, 1), chunk_size)
        if has_initial_state is None:
            has_initial_state = np.zeros(len(seq_lens), dtype=np.int32)
        fill_prefill_metadata(meta, seq_lens, slots, has_initial_state, context_lens, snapshots, final_slots)
        return meta.to(device)


def fill_prefill_metadata(meta: PrefillMetadata, seq_lens, slots, has_initial_state, context_lens=None,
                          snapshots=None, final_slots=None) -> None:
    """Write the metadata of the given sequences into host arrays ``meta`` in place.

    seq_lens, slots, has_initial_state, context_lens: [n] with n <= max_seqs and
    sum(seq_lens) <= max_tokens; context_lens defaults to zeros. snapshots: None, or a pair of
    [n] arrays (slot, tokens): sequence i's states after its first tokens[i] tokens (1 to its
    length) are also written to slot[i] where that is >= 0. final_slots: [n], where each
    sequence's states after its last token go (-1: nowhere); default its own slot. Every entry
    is rewritten, so nothing from an earlier step survives.
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    n = len(seq_lens)
    c = meta.chunk_size
    if n > meta.max_seqs:
        raise ValueError(f"{n} prefill sequences exceed max_seqs={meta.max_seqs}")
    if (seq_lens <= 0).any():
        raise ValueError("prefill sequences must have at least one token")
    total = int(seq_lens.sum())
    if total > meta.max_tokens:
        raise ValueError(f"{total} prefill tokens exceed max_tokens={meta.max_tokens}")

    cu = meta.cu_seqlens
    cu[0] = 0
    np.cumsum(seq_lens, out=cu[1 : n + 1])
    cu[n + 1 :] = total

    meta.seq_idx[:total] = np.repeat(np.arange(n, dtype=np.int32), seq_lens)
    meta.seq_idx[total:] = -1

    meta.slot_idx[:n] = slots
    meta.slot_idx[n:] = PAD_SLOT_ID
    meta.final_slot[:n] = slots if final_slots is None else final_slots
    meta.final_slot[n:] = PAD_SLOT_ID
    meta.has_initial_state[:n] = has_initial_state
    meta.has_initial_state[n:] = 0
    meta.context_lens[:n] = 0 if context_lens is None else context_lens
    meta.context_lens[n:] = 0

    meta.snapshot_slot[:] = PAD_SLOT_ID
    meta.snapshot_row[:] = 0
    # the chunk grid's segments: each sequence, cut in two at a snapshot strictly inside it
    seg_seq, seg_start, seg_end = np.arange(n), cu[:n].astype(np.int64), cu[1 : n + 1].astype(np.int64)
    if snapshots is not None:
        snap_slots, snap_tokens = (np.asarray(a, dtype=np.int64) for a in snapshots)
        live = snap_slots >= 0
        bad = live & ((snap_tokens <= 0) | (snap_tokens > seq_lens))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"prefill sequence {i}: a snapshot after {snap_tokens[i]} of its {seq_lens[i]} tokens")
        meta.snapshot_slot[:n] = np.where(live, snap_slots, PAD_SLOT_ID)
        meta.snapshot_row[:n] = np.where(live, cu[:n] + snap_tokens, 0)
        cut = np.flatnonzero(live & (snap_tokens < seq_lens))
        if len(cut):
            rows = seg_start[cut] + snap_tokens[cut]
            seg_seq = np.concatenate([seg_seq, cut])
            seg_start = np.concatenate([seg_start, rows])
            seg_end = np.concatenate([seg_end, seg_end[cut]])
            seg_end[cut] = rows
            order = np.argsort(seg_start, kind="stable")
            seg_seq, seg_start, seg_end = seg_seq[order], seg_start[order], seg_end[order]

    chunks_per_seg = -(-(seg_end - seg_start) // c)
    n_chunks = int(chunks_per_seg.sum())
    first = np.cumsum(chunks_per_seg) - chunks_per_seg  # each segment's first chunk
    seg = np.repeat(np.arange(len(seg_seq)), chunks_per_seg)
    start = seg_start[seg] + (np.arange(n_chunks) - first[seg]) * c
    chunk_seq = seg_seq[seg]
    meta.chunk_seq[:n_chunks] = chunk_seq
    meta.chunk_seq[n_chunks:] = -1
    meta.chunk_start[:n_chunks] = start
    meta.chunk_start[n_chunks:] = total
    meta.chunk_end[:n_chunks] = np.minimum(start + c, seg_end[seg])
    meta.chunk_end[n_chunks:] = total
    scs = meta.seq_chunk_start
    scs[0] = 0
    np.cumsum(np.bincount(chunk_seq, minlength=n)[:n], out=scs[1 : n + 1])
    scs[n + 1 :] = n_chunks
