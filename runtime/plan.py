"""A step plan: what one forward pass runs, as numpy arrays (no per-request objects).

The scheduler writes one per step; the step buffers turn it into padded device inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["StepPlan"]


def _i32(values=()) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


# the fields that name state slots: those whose every entry names one, those where -1 names none
_SLOTS = ("prefill_slots", "decode_slots")
_SLOTS_OR_NONE = ("snapshot_slots", "final_slots", "sample_slots", "processor_slots")


@dataclass
class StepPlan:
    """prefill_tokens: [sum(prefill_lens)] the prefill chunks' token ids, packed
    prefill_lens:    [n_prefill] tokens of each prefill chunk
    prefill_slots:   [n_prefill] state slot of each
    prefill_context: [n_prefill] tokens already in the slot before the chunk (0 for a new prompt)
    snapshot_slots:  [n_prefill] or empty: a slot each chunk's conv and SSM states are also
                     written to after its first ``snapshot_tokens`` tokens (1 to its length; the
                     SSD chunk grid is cut there); -1 for none (a prefix cache's snapshots, a
                     verify sequence's checkpoint in its own slot)
    snapshot_tokens: [n_prefill] or empty
    final_slots:     [n_prefill] or empty (each its own slot): where each chunk's conv and SSM
                     states after its last token go, -1 for nowhere (a verify sequence's drafts)
    prefill_logits:  [n_prefill] or empty (1 each): the logit rows of each prefill sequence, its
                     last tokens' (a verify sequence's: its last certain token and its drafts)
    replay_lens:     [n_prefill] or empty (0 each): in a verify step, the rows each sequence's
                     Mamba2 layers replay from its slot's record before its tokens (the drafts
                     the step before kept; ``runtime.replay``)
    decode_tokens:   [n_decode] the token each decode row feeds in; -1 takes the token the
                     previous step sampled for its slot, already on the device
    decode_slots:    [n_decode] state slot of each decode row
    decode_context:  [n_decode] tokens in the slot before the decode token

    Sampling, one entry per logit row (each prefill sequence's, then each decode row); empty
    arrays mean greedy rows whose tokens are not kept:
    temperature, top_k, top_p: the row's sampling parameters
    seed, position:  the request's seed and the index of the token drawn within the request
    sample_slots:    the slot whose next decode input the drawn token becomes, or -1 (a prompt
                     chunk that does not end its prompt)

    Logits processors (``kernels.logits_processors``); empty arrays: the step runs none. Set for
    a step that holds any chunk or row of a request with processors, at neutral values for the rest:
    presence, frequency, repetition: per logit row, the row's penalties
    processor_slots: per logit row, the slot whose counts and bias entries the row reads: -1 for a
                     row of a request without processors (its slot's entries may be another's)
    bias_ids, bias_values, bias_until: [n_prefill, MAX_BIASED] the bias entries of each prefill
                     sequence, read where it starts its prompt (context 0)
    logprobs:        whether the step computes the log-probabilities of its draws
    """

    prefill_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prefill_lens: np.ndarray = field(default_factory=_i32)
    prefill_slots: np.ndarray = field(default_factory=_i32)
    prefill_context: np.ndarray = field(default_factory=_i32)
    snapshot_slots: np.ndarray = field(default_factory=_i32)
    snapshot_tokens: np.ndarray = field(default_factory=_i32)
    final_slots: np.ndarray = field(default_factory=_i32)
    prefill_logits: np.ndarray = field(default_factory=_i32)
    replay_lens: np.ndarray = field(default_factory=_i32)
    decode_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    decode_slots: np.ndarray = field(default_factory=_i32)
    decode_context: np.ndarray = field(default_factory=_i32)
    temperature: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    top_k: np.ndarray = field(default_factory=_i32)
    top_p: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    seed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    position: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sample_slots: np.ndarray = field(default_factory=_i32)
    presence: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    frequency: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    repetition: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    processor_slots: np.ndarray = field(default_factory=_i32)
    bias_ids: np.ndarray = field(default_factory=_i32)
    bias_values: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    bias_until: np.ndarray = field(default_factory=_i32)
    logprobs: bool = False

    @property
    def num_prefill(self) -> int:
        return len(self.prefill_lens)

    @property
    def num_prefill_tokens(self) -> int:
        return int(self.prefill_lens.sum()) if len(self.prefill_lens) else 0

    @property
    def num_decode(self) -> int:
        return len(self.decode_slots)

    @property
    def num_prefill_rows(self) -> int:
        """Logit rows of the prefill sequences: one each, or ``prefill_logits``."""
        return int(self.prefill_logits.sum()) if len(self.prefill_logits) else self.num_prefill

    @property
    def num_drafts(self) -> int:
        """The most drafts a prefill sequence carries (logit rows past its first)."""
        return int(self.prefill_logits.max()) - 1 if len(self.prefill_logits) else 0

    @property
    def num_rows(self) -> int:
        """Logit rows: the prefill sequences', one per decode row."""
        return self.num_prefill_rows + self.num_decode

    @property
    def sampled(self) -> bool:
        return len(self.temperature) == self.num_rows > 0

    @property
    def processed(self) -> bool:
        return self.sampled and len(self.repetition) == self.num_rows

    def check_slots(self, num_slots: int) -> None:
        """A ValueError naming the field unless every slot the plan names is one of the pool's
        ``num_slots`` (or -1 where the field allows none) and no two of its sequences and rows
        share one: the kernels would write past the pool, or race on one state."""
        for name in _SLOTS + _SLOTS_OR_NONE:
            slots, low = getattr(self, name), 0 if name in _SLOTS else -1
            if len(slots) and (slots.min() < low or slots.max() >= num_slots):
                outside = slots[(slots < low) | (slots >= num_slots)][0]
                raise ValueError(f"plan: {name} names slot {outside}, outside the pool's {num_slots} slots"
                                 + (" (-1: none)" if low else ""))
        owned = self.prefill_slots.tolist() + self.decode_slots.tolist()
        if len(set(owned)) < len(owned):
            twice = next(s for i, s in enumerate(owned) if s in owned[:i])
            raise ValueError(f"plan: slot {twice} holds two of the step's sequences or decode rows")

    @classmethod
    def make(cls, prefill=(), decode=()) -> "StepPlan":
        """From lists: prefill = [(token_ids, slot, context)], decode = [(token_id, slot, context)]."""
        prefill, decode = list(prefill), list(decode)
        tokens = [t for ids, _, _ in prefill for t in ids]
        return cls(
            prefill_tokens=np.asarray(tokens, dtype=np.int64),
            prefill_lens=_i32([len(ids) for ids, _, _ in prefill]),
            prefill_slots=_i32([s for _, s, _ in prefill]),
            prefill_context=_i32([c for _, _, c in prefill]),
            decode_tokens=np.asarray([t for t, _, _ in decode], dtype=np.int64),
            decode_slots=_i32([s for _, s, _ in decode]),
            decode_context=_i32([c for _, _, c in decode]),
        )
