"""Prefix caching, exact: snapshots of a sequence's whole state at block boundaries, restored so
that a repeated prefix is never prefilled twice.

A snapshot is a slot of the state pool the scheduler never hands to a request: the SSM and conv
states of every Mamba2 layer at the boundary, which the step whose prompt chunk passes it writes
there (the SSD scan's state chain and the conv's window kernel, inside the captured step; the
plan's ``snapshot_slots``), and the attention layers' keys and values of the prefix, copied from
the request's slot after that step (``StatePool.copy_slot``: kernels between steps, no host
sync). A later prompt that starts with those tokens has the snapshot copied into its own slot
before its first step and prefills only the rest.

Exact, not close: a block is a whole number of SSD chunks (``chunk_size``), and a prefill resumed
at a chunk boundary runs the same computations as one that went through it (the scan's logical
chunks start at the sequence's start, the conv window is the last K - 1 inputs, the keys are the
keys), so a request restored from a snapshot gives the tokens and logits it gives without one.
A request keeps at least one prompt token to prefill (its first draw needs its logits).

Which boundaries are worth a slot: a recurrent state, unlike a KV cache, holds one prefix only,
and a snapshot costs a whole slot, so a prompt is snapshotted at two boundaries at most (the
admission of Marconi, Pan et al. 2024): its last one, which the next turn of a conversation
resends, and its branch point, the deepest boundary some earlier prompt reached with the same
tokens (a shared system prompt, a tool preamble), known from the keys of recent prompts' blocks
(``seen``: no state, 16 bytes a block). The first prompt of a shared prefix is not snapshotted
inside it; the second is, at the branch, and the third on restore from there.

Which snapshot goes when a slot is needed (after Marconi's eviction): each scores its recency
(its rank from the least to the most recently used, 0 to 1), plus ``flop_weight`` times its
tokens over the longest held (every snapshot holds one slot's bytes, and the prefill it saves
grows with its tokens), plus ``share_weight`` where it is shared (taken at a branch point, or
restored by two prompts: a conversation's end is restored once, by its next turn, which then
snapshots its own); the lowest goes. Before any of them goes a superseded one (``supersede``):
a conversation's end that its next turn restored and snapshots past. While the cache thrashes
(``thrash_guard``: a prompt wanted back a snapshot evicted lately, within the last lookups as
many as the cache has slots), recency counts the other way: the most recently used goes first.
More live conversations than slots, taken in turn, would otherwise each be evicted just before
its next turn (LRU's cyclic worst case); so a stable part of them keeps its snapshots. With both
weights 0, no superseding and no guard, that is LRU. ``tools.prefix_replay`` sets the policies
side by side on workloads replayed through the cache alone (docs/experiments.md).

Keys chain the blocks (a digest of the previous key and the block's tokens), and every hit
compares the prefix's tokens too. A restore only reads its snapshot before the step it precedes, and a
snapshot slot is rewritten only by a step after it, both in stream order, so an eviction can
never change a request that restored from the evicted snapshot. A snapshot claimed for the next
step is not evicted before that step is launched (``settle``): two sequences of one step would
write one slot at once.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

__all__ = ["Admission", "Boundary", "PrefixCache"]


class Boundary(NamedTuple):
    """A block boundary of a prompt: the tokens before it, their chained key, and whether an
    earlier prompt shared them (its branch point)."""

    end: int
    key: bytes
    branch: bool = False


@dataclass(frozen=True)
class Admission:
    """What the cache says of a new prompt: the snapshot to restore, (slot, tokens) or None,
    and the boundaries past it that its prefill should snapshot at, in order."""

    restore: tuple[int, int] | None
    snapshot_at: tuple[Boundary, ...]


@dataclass
class _Snapshot:
    slot: int
    tokens: np.ndarray  # the prefix it holds
    shared: bool  # taken at a branch point, or restored by two prompts
    restores: int = 0
    superseded: bool = False  # restored by a prompt that snapshots past it, and not shared


@dataclass
class PrefixCache:
    """slots: the pool's slots this cache owns; block: tokens a block (a multiple of the SSD
    chunk); seen: how many recent prompts' block keys to remember for finding branch points;
    flop_weight, share_weight: what a snapshot's length and its being shared weigh against its
    recency in eviction; supersede: a superseded snapshot goes first; thrash_guard: while
    evicted snapshots are wanted back, the most recently used goes first (all four off: LRU);
    slot_bytes: a snapshot's bytes (``stats["bytes"]``: what those held use)."""

    slots: list[int]
    block: int
    seen: int = 1 << 16
    flop_weight: float = 1.0
    share_weight: float = 1.0
    supersede: bool = True
    thrash_guard: bool = True
    slot_bytes: int = 0
    _entries: OrderedDict = field(default_factory=OrderedDict)  # key -> _Snapshot, least recent first
    _seen: OrderedDict = field(default_factory=OrderedDict)  # key -> None, least recent first
    _unwritten: set = field(default_factory=set)  # keys claimed since settle(): their step writes them
    _ghosts: OrderedDict = field(default_factory=OrderedDict)  # evicted snapshots' keys, least recent first
    _last_regret: int = -(1 << 30)  # the lookup that last wanted an evicted snapshot back
    stats: dict = field(default_factory=lambda: {"lookups": 0, "hits": 0, "tokens_restored": 0, "snapshots": 0,
                                                 "evictions": 0, "bytes": 0})

    def __post_init__(self):
        if self.block < 1 or not self.slots:
            raise ValueError(f"PrefixCache: a block of at least one token and at least one slot, got {self.block}, "
                             f"{self.slots}")
        self._free = list(reversed(self.slots))

    def boundaries(self, tokens: np.ndarray) -> list[Boundary]:
        """Every block boundary of ``tokens``, in order."""
        out, key = [], b""
        for end in range(self.block, len(tokens) + 1, self.block):
            key = hashlib.blake2b(key + tokens[end - self.block : end].astype(np.int64).tobytes(),
                                  digest_size=16).digest()
            out.append(Boundary(end, key))
        return out

    def admit(self, prompt: np.ndarray) -> Admission:
        """The longest cached prefix of ``prompt`` that leaves at least one token to prefill (a
        hit becomes the most recently used), and where its prefill should snapshot: its branch
        point and its last boundary, where deeper than that and not cached already."""
        self.stats["lookups"] += 1
        bounds = self.boundaries(prompt)
        hit, branch = None, None  # the deepest (boundary, snapshot) held, the deepest boundary seen
        for b in bounds:
            held = self._entries.get(b.key)  # a longer prefix may be cached where a shorter one was evicted
            if b.end < len(prompt) and held is not None and np.array_equal(held.tokens, prompt[: b.end]):
                hit = (b, held)
            if b.key in self._seen:
                branch = b._replace(branch=True)
        self._remember(bounds)
        start = 0 if hit is None else hit[0].end
        if any(b.key in self._ghosts for b in bounds if start < b.end < len(prompt)):
            self._last_regret = self.stats["lookups"]
        last = bounds[-1] if bounds and (branch is None or bounds[-1].end != branch.end) else None
        wanted = {b for b in (branch, last) if b is not None and b.end > start and b.key not in self._entries}
        if hit is None:
            return Admission(None, tuple(sorted(wanted)))
        at, snap = hit
        self._entries.move_to_end(at.key)
        snap.restores += 1
        snap.shared |= snap.restores > 1
        snap.superseded = self.supersede and bool(wanted) and not snap.shared
        self.stats["hits"] += 1
        self.stats["tokens_restored"] += start
        return Admission((snap.slot, start), tuple(sorted(wanted)))

    def _remember(self, bounds: list[Boundary]):
        for b in bounds:
            self._seen[b.key] = None
            self._seen.move_to_end(b.key)
        while len(self._seen) > self.seen:
            self._seen.popitem(last=False)

    def claim(self, prompt: np.ndarray, at: Boundary) -> int | None:
        """A slot to snapshot ``prompt[:at.end]`` into in the next step, a free one or an
        evicted snapshot's; None where that prefix is cached already, or where every snapshot
        held was claimed for that same step."""
        if at.end % self.block or not 0 < at.end <= len(prompt):
            raise ValueError(f"PrefixCache.claim: {at.end} is not a block boundary of a {len(prompt)}-token prompt")
        if at.key in self._entries:
            self._entries.move_to_end(at.key)
            return None
        if not self._free:
            victim = self._victim()
            if victim is None:
                return None
            self._free.append(self._entries.pop(victim).slot)
            self.stats["evictions"] += 1
            self._ghosts[victim] = None
            while len(self._ghosts) > len(self.slots):
                self._ghosts.popitem(last=False)
        slot = self._free.pop()
        self._ghosts.pop(at.key, None)  # held again
        self._unwritten.add(at.key)
        self._entries[at.key] = _Snapshot(slot, prompt[: at.end].copy(), at.branch)
        self.stats["snapshots"] += 1
        self.stats["bytes"] = len(self._entries) * self.slot_bytes
        return slot

    def settle(self) -> None:
        """The snapshots claimed so far have their step launched: later claims may evict them."""
        self._unwritten.clear()

    def _victim(self) -> bytes | None:
        """The key of the snapshot that goes (the module doc): a superseded one, else the lowest
        score; the least recently used of equals; None where all were claimed since ``settle``."""
        n = len(self._entries)
        longest = max(len(s.tokens) for s in self._entries.values())
        thrashing = self.thrash_guard and self.stats["lookups"] - self._last_regret <= len(self.slots)
        scores = [((not s.superseded, (1 - i / max(1, n - 1) if thrashing else i / max(1, n - 1))
                    + self.flop_weight * len(s.tokens) / longest + self.share_weight * s.shared), key)
                  for i, (key, s) in enumerate(self._entries.items()) if key not in self._unwritten]
        return min(scores, key=lambda t: t[0])[1] if scores else None

    def __len__(self) -> int:
        return len(self._entries)
