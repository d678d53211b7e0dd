"""Prefix caching, exact: snapshots of a sequence's whole state at block boundaries, restored so
that a repeated prefix is never prefilled twice.

A snapshot is a slot of the state pool the scheduler never hands to a request: the SSM and conv
states of every Mamba2 layer and the attention layers' keys and values of the prefix, copied
there from a request's slot right after the step whose prompt chunk ended on a block boundary
(``StatePool.copy_slot``: kernels between steps, no host sync). A later prompt that starts with
those tokens has the snapshot copied into its own slot before its first step and prefills only
the rest.

Exact, not close: a block is a whole number of SSD chunks (``chunk_size``), and a prefill resumed
at a chunk boundary runs the same computations as one that went through it (the scan's logical
chunks start at the sequence's start, the conv window is the last K - 1 inputs, the keys are the
keys), so a request restored from a snapshot gives the tokens and logits it gives without one.
A request keeps at least one prompt token to prefill (its first draw needs its logits).

Keys chain the blocks (a digest of the previous key and the block's tokens), and every hit
compares the prefix's tokens too. Capacity is a number of snapshot slots; the least recently
used snapshot goes first. A restore only reads its snapshot before the step it precedes, and a
snapshot slot is rewritten only after the step that fills it, both in stream order, so an
eviction can never change a request that restored from the evicted snapshot.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PrefixCache"]


@dataclass
class _Snapshot:
    slot: int
    tokens: np.ndarray  # the prefix it holds


@dataclass
class PrefixCache:
    """slots: the pool's slots this cache owns; block: tokens a block (a multiple of the SSD chunk)."""

    slots: list[int]
    block: int
    _entries: OrderedDict = field(default_factory=OrderedDict)  # key -> _Snapshot, least recent first
    stats: dict = field(default_factory=lambda: {"lookups": 0, "hits": 0, "tokens_restored": 0, "snapshots": 0,
                                                 "evictions": 0})

    def __post_init__(self):
        if self.block < 1 or not self.slots:
            raise ValueError(f"PrefixCache: a block of at least one token and at least one slot, got {self.block}, "
                             f"{self.slots}")
        self._free = list(reversed(self.slots))

    def _keys(self, tokens: np.ndarray, upto: int):
        """(end, key) of every block boundary of ``tokens`` up to ``upto`` tokens, in order."""
        key = b""
        for end in range(self.block, upto + 1, self.block):
            key = hashlib.blake2b(key + tokens[end - self.block : end].astype(np.int64).tobytes(),
                                  digest_size=16).digest()
            yield end, key

    def lookup(self, prompt: np.ndarray) -> tuple[int, int] | None:
        """(snapshot slot, tokens) of the longest cached prefix of ``prompt`` that leaves at least
        one token to prefill, or None; a hit becomes the most recently used."""
        self.stats["lookups"] += 1
        best = None
        for end, key in self._keys(prompt, len(prompt) - 1):
            snap = self._entries.get(key)  # a longer prefix may be cached where a shorter one was evicted
            if snap is not None and np.array_equal(snap.tokens, prompt[:end]):
                best = (key, snap, end)
        if best is None:
            return None
        key, snap, end = best
        self._entries.move_to_end(key)
        self.stats["hits"] += 1
        self.stats["tokens_restored"] += end
        return snap.slot, end

    def claim(self, prompt: np.ndarray, end: int) -> int | None:
        """A slot to snapshot ``prompt[:end]`` into (``end`` a block boundary), the least recently
        used snapshot's if none is free; None where that prefix is cached already."""
        if end % self.block or not 0 < end <= len(prompt):
            raise ValueError(f"PrefixCache.claim: {end} is not a block boundary of a {len(prompt)}-token prompt")
        *_, (_, key) = self._keys(prompt, end)
        if key in self._entries:
            self._entries.move_to_end(key)
            return None
        if not self._free:
            _, evicted = self._entries.popitem(last=False)
            self._free.append(evicted.slot)
            self.stats["evictions"] += 1
        slot = self._free.pop()
        self._entries[key] = _Snapshot(slot, prompt[:end].copy())
        self.stats["snapshots"] += 1
        return slot

    def __len__(self) -> int:
        return len(self._entries)
