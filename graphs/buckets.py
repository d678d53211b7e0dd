"""Static step shapes: which ones get a CUDA graph, and which one a step uses.

A bucket ``(B, Tp)`` is B decode rows and Tp prefill tokens (Tp = 0: a decode-only step). A step
of ``d`` decode rows and ``t`` prefill tokens in ``s`` sequences runs in the smallest bucket that
holds it; above every bucket it runs eagerly, at its exact size. A verify bucket ``(0, Tp, k)``
runs a speculative step: every sequence in prefill form, each yielding the logits of up to its
last ``1 + k`` tokens (``runtime.speculative``).
"""

from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Bucket", "BucketSet", "largest_first"]


@dataclass(frozen=True, order=True)
class Bucket:
    """A static step shape: ``decode`` rows and ``prefill`` tokens (0 for a decode-only step);
    ``drafts``: the drafts a prefill sequence may carry, each a logit row more (a verify bucket)."""

    decode: int
    prefill: int = 0
    drafts: int = 0

    def fits(self, decode: int, prefill_tokens: int, prefill_seqs: int, max_prefill_seqs: int,
             drafts: int = 0) -> bool:
        """Whether a step of that many decode rows, prefill tokens and sequences, and at most
        ``drafts`` drafts a sequence, fits."""
        return (decode <= self.decode and prefill_tokens <= self.prefill
                and prefill_seqs <= (max_prefill_seqs if self.prefill else 0) and drafts <= self.drafts)


def largest_first(buckets) -> list[Bucket]:
    """Capture order: the largest step first, so it sizes the shared graph pool."""
    return sorted(buckets, key=lambda b: (b.decode + b.prefill, b.prefill), reverse=True)


def _sizes(name: str, values, allow_zero=False) -> tuple[int, ...]:
    values = tuple(sorted(set(int(v) for v in values)))
    low = 0 if allow_zero else 1
    if not values or values[0] < low:
        raise ValueError(f"{name}: expected sizes >= {low}, got {values}")
    return values


@dataclass(frozen=True)
class BucketSet:
    """decode:         batch sizes of decode-only graphs
    mixed_decode:   decode rows of mixed graphs (0: prefill only)
    prefill:        prefill-token sizes of mixed graphs
    max_prefill_seqs: prefill sequences a mixed step may hold (sizes its metadata)
    drafts:         the drafts of a speculative step's sequences (0: no verify graphs)
    verify:         prefill-token sizes of verify graphs below ``prefill``'s (which they take too)
    """

    decode: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
    mixed_decode: tuple[int, ...] = (0, 8, 16, 32, 64, 128, 256)
    prefill: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    max_prefill_seqs: int = 8
    drafts: int = 0
    # 4 and 8: a verify of one sequence (1 + k tokens) padded to 16 rows cost Nano (bf16, H100) up to
    # 1 ms a step more than its exact graph at k = 1 and 2 (5.2-5.7 against 4.1-5.0 ms), and steered
    # the speculation gate away from its best k
    verify: tuple[int, ...] = (4, 8, 16, 32, 64)

    def __post_init__(self):
        object.__setattr__(self, "decode", _sizes("decode", self.decode))
        object.__setattr__(self, "mixed_decode", _sizes("mixed_decode", self.mixed_decode, allow_zero=True))
        object.__setattr__(self, "prefill", _sizes("prefill", self.prefill))
        below = {t for t in _sizes("verify", self.verify) if t < self.prefill[-1]}
        object.__setattr__(self, "verify", tuple(sorted(below | set(self.prefill))))
        if self.max_prefill_seqs < 1:
            raise ValueError(f"max_prefill_seqs: must be at least 1, got {self.max_prefill_seqs}")
        if self.drafts < 0:
            raise ValueError(f"drafts: must be at least 0, got {self.drafts}")

    @classmethod
    def default(cls, cuda: bool) -> "BucketSet":
        """The built-in set: graph buckets on CUDA; on the CPU a few small eager sizes, since
        padding costs real time there."""
        if cuda:
            return cls()
        return cls(decode=(1, 2, 4, 8, 16), mixed_decode=(0, 4, 16), prefill=(32, 128, 512), max_prefill_seqs=4)

    @property
    def max_decode(self) -> int:
        return max(self.decode[-1], self.mixed_decode[-1])

    @property
    def max_prefill_tokens(self) -> int:
        return self.prefill[-1]

    def all(self) -> list[Bucket]:
        """Every graph bucket, largest first (the capture order: the first sizes the shared pool)."""
        buckets = [Bucket(b) for b in self.decode]
        buckets += [Bucket(b, t) for b in self.mixed_decode for t in self.prefill]
        if self.drafts:
            buckets += [Bucket(0, t, self.drafts) for t in self.verify]
        return largest_first(buckets)

    def choose(self, decode: int, prefill_tokens: int = 0, prefill_seqs: int = 0, drafts: int = 0) -> Bucket | None:
        """The smallest bucket that holds the step, or None when it is larger than every bucket."""
        if drafts:
            j = bisect_left(self.verify, prefill_tokens)
            if decode or drafts > self.drafts or prefill_seqs > self.max_prefill_seqs or j == len(self.verify):
                return None
            return Bucket(0, self.verify[j], self.drafts)
        if prefill_seqs == 0:
            i = bisect_left(self.decode, decode)
            return Bucket(self.decode[i]) if i < len(self.decode) else None
        if prefill_seqs > self.max_prefill_seqs:
            return None
        i = bisect_left(self.mixed_decode, decode)
        j = bisect_left(self.prefill, prefill_tokens)
        if i == len(self.mixed_decode) or j == len(self.prefill):
            return None
        return Bucket(self.mixed_decode[i], self.prefill[j])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "BucketSet":
        return cls(**json.loads(Path(path).read_text()))
