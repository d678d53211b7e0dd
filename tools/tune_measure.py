"""Step costs over candidate buckets, measured on the model and device at hand, for
`mambastep tune`; cached as JSON keyed by the model's shape, the dtype, the device and the code,
so that tuning for another workload needs no GPU.

On CUDA each candidate is captured alone (its graph pool and capture time) and its step timed as
a replay; every candidate's step is also timed eagerly, the cost of a step above every chosen
bucket. Without CUDA the same code times eager steps (pool and capture 0), so it is testable on
a CPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from ..graphs import Bucket, BucketSet
from ..graphs.tuning import StepCosts
from ..runtime.model import Model
from ..runtime.plan import StepPlan
from ..runtime.state_pool import StatePool
from ..runtime.step_runner import StepRunner
from .bench_steps import step_ms

__all__ = ["Candidates", "cache_key", "load", "measure", "save"]

CONTEXT = 64  # tokens already in each decode row's slot while timing
_PACKAGE = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Candidates:
    """The bucket sizes to measure; the defaults' sizes are among them, so they can be priced."""

    decode: tuple[int, ...]
    mixed_decode: tuple[int, ...]
    prefill: tuple[int, ...]

    @classmethod
    def around(cls, base: BucketSet, max_decode: int | None = None, max_prefill: int | None = None) -> "Candidates":
        """Every decode size to 16 and every 8th above, up to ``max_decode``; the base set's mixed
        sizes with the midpoints between them; its prefill sizes (each prefill size multiplies
        the mixed choice's work, so they stay few)."""
        top = max_decode or base.max_decode
        decode = set(range(1, min(16, top) + 1)) | set(range(24, top + 1, 8)) | {s for s in base.decode if s <= top}
        mixed = {0} | {s for s in base.mixed_decode if s <= top}
        inner = sorted(mixed)
        mixed |= {(a + b) // 2 for a, b in zip(inner[1:], inner[2:])}
        prefill = {p for p in base.prefill if p <= (max_prefill or base.max_prefill_tokens)} or {base.prefill[0]}
        return cls(tuple(sorted(decode)), tuple(sorted(mixed)), tuple(sorted(prefill)))


def code_version() -> str:
    """A digest of the sources a step runs (the optimiser aside): measurements of other code are
    not reused."""
    h = hashlib.sha1()
    for path in sorted(p for d in ("kernels", "graphs", "runtime") for p in (_PACKAGE / d).rglob("*.py")):
        if path != _PACKAGE / "graphs" / "tuning.py":
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_key(model: Model) -> dict:
    cfg = json.dumps(dataclasses.asdict(model.cfg), sort_keys=True, default=str)
    device = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu"
    return {"model": hashlib.sha1(cfg.encode()).hexdigest()[:16], "dtype": str(model.dtype).replace("torch.", ""),
            "device": device, "code": code_version()}


def _plan(bucket: Bucket, slot: int, vocab: int) -> StepPlan:
    """A step that fills ``bucket`` exactly, its token ids inside the vocabulary (a tiny preset's
    has 512 tokens, a prefill candidate thousands)."""
    token = lambda i: 1 + i % (vocab - 1)  # noqa: E731
    decode = [(token(i), i, CONTEXT) for i in range(bucket.decode)]
    prefill = [([token(i) for i in range(bucket.prefill)], slot, 0)] if bucket.prefill else []
    return StepPlan.make(prefill, decode)


def measure(model: Model, candidates: Candidates, rounds: int | None = None, progress: bool = True) -> dict:
    """The candidates' costs (a ``StepCosts`` as a dict) and capture times, under ``cache_key``."""
    cuda = model.device.type == "cuda"
    rounds = rounds or (20 if cuda else 3)
    top_d = max(max(candidates.decode), max(candidates.mixed_decode))
    pool = StatePool(model.cfg, top_d + 1, max_context=CONTEXT + max(candidates.prefill) + 2, dtype=model.dtype,
                     device=model.device)
    every = BucketSet(candidates.decode, candidates.mixed_decode, candidates.prefill, max_prefill_seqs=1)
    eager = StepRunner(model, pool, every, overlap=False)
    slot = top_d

    def one(bucket: Bucket):
        """(graph ms, eager ms, pool MiB, capture s) of a step that fills ``bucket`` exactly."""
        plan = _plan(bucket, slot, model.cfg.vocab_size)
        e = step_ms(eager, plan, rounds=rounds, warmup=1)
        if not cuda:
            return e, e, 0.0, 0.0
        alone = StepRunner(model, pool, BucketSet((max(bucket.decode, 1),), (bucket.decode,),
                                                  (max(bucket.prefill, 1),), max_prefill_seqs=1))
        report = alone.capture([bucket], progress=False)
        g = step_ms(alone, plan, rounds=rounds, warmup=1)
        del alone
        return g, e, report.pool_bytes / 2**20, report.seconds

    grid = [Bucket(d) for d in candidates.decode] + [Bucket(d, p) for d in candidates.mixed_decode
                                                     for p in candidates.prefill]
    results = {}
    for bucket in tqdm(grid, desc="measuring buckets", disable=not progress, file=sys.stderr):
        results[bucket] = one(bucket)
    dec = [results[Bucket(d)] for d in candidates.decode]
    mix = [[results[Bucket(d, p)] for p in candidates.prefill] for d in candidates.mixed_decode]
    costs = StepCosts(
        decode=candidates.decode, decode_graph_ms=tuple(r[0] for r in dec), decode_eager_ms=tuple(r[1] for r in dec),
        decode_pool_mib=tuple(r[2] for r in dec), mixed_decode=candidates.mixed_decode, prefill=candidates.prefill,
        mixed_graph_ms=tuple(tuple(r[0] for r in row) for row in mix),
        mixed_eager_ms=tuple(tuple(r[1] for r in row) for row in mix),
        mixed_pool_mib=tuple(tuple(r[2] for r in row) for row in mix))
    return {"key": cache_key(model), "date": datetime.date.today().isoformat(), "costs": dataclasses.asdict(costs),
            "capture_s": {"decode": [r[3] for r in dec], "mixed": [[r[3] for r in row] for row in mix]}}


def save(measured: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(measured, indent=1))


def load(path: str | Path, key: dict) -> tuple[StepCosts, dict] | None:
    """The cached costs at ``path`` if they were measured under ``key``, else None."""
    try:
        measured = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(measured, dict) or measured.get("key") != key:
        return None
    c = measured["costs"]
    costs = StepCosts(**{k: tuple(tuple(x) if isinstance(x, list) else x for x in v) for k, v in c.items()})
    return costs, measured
