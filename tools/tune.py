"""mambastep tune: choose graph buckets from the step shapes a workload actually produces.

Runs a synthetic workload (as ``mambastep run`` does) through an eager engine, records every
step's decode rows and prefill tokens, and picks, for a given number of graphs, the bucket sizes
that minimise the padded rows and tokens those steps would run (an exact dynamic program over the
observed sizes). Writes a BucketSet JSON that ``mambastep run --buckets`` and
``Engine(buckets=...)`` read, and prints the padding each choice costs against the defaults.
"""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
import torch
from tqdm import tqdm

from ..graphs import BucketSet
from ..runtime.engine import Engine
from ..runtime.presets import PRESETS
from ..runtime.request import SamplingParams
from .args import Parser, writable_path
from .run import workload


def optimal_sizes(counts: dict[int, int], k: int, cover: int | None = None) -> tuple[int, ...]:
    """At most ``k`` sizes minimising sum(count * (bucket(size) - size)) over the observed sizes,
    where bucket(size) is the smallest chosen size >= size; the largest observed size (or
    ``cover``, if larger) is always a bucket so every observed step fits."""
    sizes = sorted(s for s in counts if s > 0)
    if cover is not None and (not sizes or cover > sizes[-1]):
        sizes.append(cover)
    if not sizes:
        return (cover or 1,)
    n, w = len(sizes), np.array([counts.get(s, 0) for s in sizes], dtype=float)
    x = np.array(sizes, dtype=float)
    # cost(i, j): sizes[i..j] all padded up to sizes[j]
    cw, cwx = np.concatenate([[0], np.cumsum(w)]), np.concatenate([[0], np.cumsum(w * x)])

    def cost(i, j):
        return x[j] * (cw[j + 1] - cw[i]) - (cwx[j + 1] - cwx[i])

    k = min(k, n)
    best = np.full((k + 1, n), np.inf)
    back = np.zeros((k + 1, n), dtype=int)
    for j in range(n):
        best[1, j] = cost(0, j)
    for b in range(2, k + 1):
        for j in range(n):
            for i in range(1, j + 1):
                c = best[b - 1, i - 1] + cost(i, j)
                if c < best[b, j]:
                    best[b, j], back[b, j] = c, i - 1
    # walk back from the best count of buckets: each step's bucket closes the group that ends at j
    chosen, j = [], n - 1
    for b in range(int(np.argmin(best[1:, n - 1])) + 1, 0, -1):
        chosen.append(sizes[j])
        j = back[b, j]
    return tuple(sorted(chosen))


def padding(counts: dict[int, int], sizes: tuple[int, ...]) -> tuple[int, int]:
    """(padded units, steps that fit no bucket) if ``counts`` ran over buckets ``sizes``."""
    pad, miss = 0, 0
    for s, c in counts.items():
        fit = [b for b in sizes if b >= s]
        if fit:
            pad += (fit[0] - s) * c
        elif s:
            miss += c
    return pad, miss


def record(engine: Engine, jobs, concurrency: int, progress: bool = True) -> tuple[Counter, Counter, Counter]:
    """Run ``jobs`` at ``concurrency`` on a tracing engine; counts of decode-only batch sizes,
    and of mixed steps' decode rows and prefill tokens."""
    pending, live = list(reversed(jobs)), set()
    bar = tqdm(total=len(jobs), desc="recording steps", disable=not progress, file=sys.stderr)
    while pending or engine.has_unfinished():
        while pending and len(live) < concurrency:
            prompt, n_out = pending.pop()
            live.add(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)))
        for out in engine.step():
            if out.finished:
                live.discard(out.id)
                bar.update()
    bar.close()
    decode_only, mixed_decode, mixed_prefill = Counter(), Counter(), Counter()
    for s in engine.trace:
        if s.prefill_seqs:
            mixed_decode[s.decode] += 1
            mixed_prefill[s.prefill_tokens] += 1
        else:
            decode_only[s.decode] += 1
    return decode_only, mixed_decode, mixed_prefill


def main(argv=None) -> int:
    parser = Parser(prog="mambastep tune", description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model shape to record with (default: mamba2-130m on a GPU, tiny-hybrid on CPU)")
    parser.add_argument("--requests", type=int, default=64, help="requests in the recorded workload")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight while recording")
    parser.add_argument("--decode-graphs", type=int, default=12, help="decode-only buckets to choose")
    parser.add_argument("--mixed-decode", type=int, default=4, help="decode sizes of mixed buckets")
    parser.add_argument("--prefill", type=int, default=4, help="prefill-token sizes of mixed buckets")
    parser.add_argument("--max-prefill-seqs", type=int, default=None, help="prefill sequences per mixed step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", metavar="PATH", default="buckets.json", help="where to write the BucketSet")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for flag in ("requests", "concurrency", "decode_graphs", "mixed_decode", "prefill"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    if args.max_prefill_seqs is not None and args.max_prefill_seqs < 1:
        parser.error(f"--max-prefill-seqs: must be at least 1, got {args.max_prefill_seqs}")
    writable_path(parser, "--out", args.out)

    gpu = torch.cuda.is_available()
    base = BucketSet.default(gpu)
    seqs = args.max_prefill_seqs or base.max_prefill_seqs
    preset = args.preset or ("mamba2-130m" if gpu else "tiny-hybrid")
    if not args.quiet:
        print(f"recording {args.requests} requests of {preset} at concurrency {args.concurrency}, eagerly",
              file=sys.stderr)
    engine = Engine.from_preset(preset, dtype=torch.bfloat16 if gpu else torch.float32, use_graphs=False,
                                buckets=BucketSet(base.decode, base.mixed_decode, base.prefill, seqs),
                                progress=False, trace=True)
    jobs = workload(args.requests, engine.cfg.vocab_size, args.seed)
    decode_only, mixed_decode, mixed_prefill = record(engine, jobs, args.concurrency, progress=not args.quiet)

    tuned = BucketSet(
        decode=optimal_sizes(decode_only, args.decode_graphs, cover=args.concurrency),
        mixed_decode=(0,) + optimal_sizes(mixed_decode, args.mixed_decode, cover=args.concurrency),
        prefill=optimal_sizes(mixed_prefill, args.prefill, cover=base.max_prefill_tokens),
        max_prefill_seqs=seqs,
    )
    tuned.save(args.out)
    steps = sum(decode_only.values()) + sum(mixed_prefill.values())
    print(f"recorded {steps} steps of {preset} ({args.requests} requests, concurrency {args.concurrency})")
    print("| buckets | graphs | padded decode rows | padded prefill tokens | steps above every bucket |")
    print("| --- | --- | --- | --- | --- |")
    for name, b in (("default", base), ("tuned", tuned)):
        d_pad, d_miss = padding(decode_only, b.decode)
        m_pad, m_miss = padding(mixed_decode, b.mixed_decode)
        p_pad, p_miss = padding(mixed_prefill, b.prefill)
        print(f"| {name} | {len(b.all())} | {d_pad + m_pad} | {p_pad} | {d_miss + max(m_miss, p_miss)} |")
    print(f"wrote {args.out}: decode {tuned.decode}, mixed decode {tuned.mixed_decode}, prefill {tuned.prefill}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
