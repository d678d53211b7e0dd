"""What each slot's request has seen, on the device, for the logits processors: how often each
token was drawn, which tokens its prompt holds, and its bias entries (``kernels.logits_processors``).

Kept per slot (plus a last row that takes what padding rows write) and updated inside the step's
sampling graph, so nothing crosses to the host: a request's first prompt chunk clears its slot's
rows and writes its bias entries there, every chunk marks its prompt tokens, and every draw counts
its token. The sampling stage does this bookkeeping only in its processed variant, which the
host picks for every step that holds a chunk or a row of a request with processors: their rows
are then always current. Other requests' rows may hold what an earlier request left there: a
step's rows without processors read the last row instead, whose bias entries are only ever
padding (unused) and whose penalties their neutral parameters cancel.

Memory: a slot costs ``vocab * 5`` bytes (int32 counts and a bool per token) plus its bias
table: 655 KB at a 131,072-token vocabulary.
"""

from __future__ import annotations

import torch

from ..kernels.logits_processors import MAX_BIASED, add_bias, penalize

__all__ = ["SlotTokensSeen"]


class SlotTokensSeen:
    def __init__(self, num_slots: int, vocab_size: int, device):
        rows = num_slots + 1
        self.trash = num_slots
        self.counts = torch.zeros(rows, vocab_size, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
        self.bias_ids = torch.zeros(rows, MAX_BIASED, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(rows, MAX_BIASED, dtype=torch.float32, device=device)
        self.bias_until = torch.zeros(rows, MAX_BIASED, dtype=torch.int64, device=device)

    @staticmethod
    def bytes_per_slot(vocab_size: int) -> int:
        return vocab_size * 5 + MAX_BIASED * (8 + 4 + 8)

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots as row indices, int64; negative ones (no slot) the trash row."""
        return torch.where(slots >= 0, slots, self.trash).long()

    def admit(self, slots, bias_ids, bias_values, bias_until) -> None:
        """Start the requests whose first prompt chunk is in this step: slots [S] int32 (-1: none),
        their bias entries [S, MAX_BIASED] (ids int32, values float32, until int32)."""
        rows = self._rows(slots)
        self.counts.index_fill_(0, rows, 0)
        self.prompt.index_fill_(0, rows, False)
        self.bias_ids.index_copy_(0, rows, bias_ids.long())
        self.bias_values.index_copy_(0, rows, bias_values)
        self.bias_until.index_copy_(0, rows, bias_until.long())

    def copy(self, src: int, dsts: list[int]) -> None:
        """Give slots ``dsts`` what slot ``src`` has seen (a forked prompt): a copy kernel a table
        and destination, no host sync."""
        for t in (self.counts, self.prompt, self.bias_ids, self.bias_values, self.bias_until):
            for d in dsts:
                t[d].copy_(t[src])

    def see_prompt(self, token_slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Mark prompt tokens: token_slots [T] (-1: padding), tokens [T] int64."""
        self.prompt.index_put_((self._rows(token_slots), tokens), torch.ones_like(tokens, dtype=torch.bool))

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row's drawn token in its slot: slots [R] (-1: kept by none), tokens [R]."""
        self.counts.index_put_((self._rows(slots), tokens), torch.ones_like(tokens, dtype=torch.int32),
                               accumulate=True)

    def apply(self, logits, slots, presence, frequency, repetition, position) -> torch.Tensor:
        """Penalties, then bias, on ``logits`` [R, V] in place, row r reading slot ``slots[r]``
        (-1: the last row, for a row without processors)."""
        rows = self._rows(slots)
        penalize(logits, self.counts, self.prompt, rows, presence, frequency, repetition)
        return add_bias(logits, self.bias_ids[rows], self.bias_values[rows], self.bias_until[rows], position)
