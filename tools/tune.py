"""mambastep tune: choose graph buckets from measured step times under a graph and a memory budget.

    mambastep tune --preset mamba2-130m --trace steps.jsonl --max-graphs 32 --out buckets.json
    mambastep run --preset mamba2-130m --buckets buckets.json

1. Measure (cached): the step time of candidate buckets on this model and device, as graph
   replays, the eager time of steps of those sizes, each graph's pool and capture time
   (`tools/tune_measure.py`). --measurements names the cache; a cache of another model, dtype,
   device or code version is measured anew.
2. Workload: a step-shape trace (`mambastep run --trace PATH`, or `Engine(trace=True)` and
   `write_trace` from your own loop), or a synthetic chat workload recorded eagerly.
3. Choose: the bucket set of least expected step time over the workload with at most
   --max-graphs graphs and at most --pool-mib of graph pool (as `graphs/tuning.py` models it:
   the largest decode-only graph's pool plus the largest mixed graph's), exactly.
4. Report the tuned set beside the defaults (expected mean step time, graphs, pool, steps run
   eagerly), and beside it two smaller tuned sets: the fewest graphs expected within 2% of the
   defaults' time, and the best set within half the defaults' pool. Write the tuned set's bucket
   file; --plot PNG draws step time against batch size with the chosen buckets marked (needs
   matplotlib); --validate runs the workload with every set of the report (once a set however
   many rows name it; --rounds times, the order reversed every other round) and prints measured
   step time, inter-token latency, output tokens/s and graph pool side by side; --json keeps it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from ..graphs import BucketSet
from ..graphs.tuning import Choice, StepCosts, choose, expected_ms
from ..runtime.config import ConfigError
from ..runtime.engine import Engine
from ..runtime.model import Model
from ..runtime.presets import PRESETS
from ..runtime.weights import WeightError
from . import tune_measure
from .args import Parser, add_quantization, device as device_arg, writable_path
from .run import serve, summarize, workload

__all__ = ["compare", "main", "read_trace", "validated_table", "workload_steps"]


def workload_steps(shapes) -> tuple[Counter, Counter]:
    """(decode-only steps by rows, mixed steps by (rows, prefill tokens)) of step shapes (objects
    or dicts with decode, prefill_tokens, prefill_seqs)."""
    decode, mixed = Counter(), Counter()
    for s in shapes:
        get = s.get if isinstance(s, dict) else lambda k, s=s: getattr(s, k)
        if get("prefill_seqs"):
            mixed[get("decode"), get("prefill_tokens")] += 1
        else:
            decode[get("decode")] += 1
    return decode, mixed


def read_trace(path: str | Path) -> list[dict]:
    """The steps of a JSONL trace; ValueError naming the line that is not one."""
    steps = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            s = json.loads(line)
            if not all(isinstance(s.get(k), int) and s[k] >= 0 for k in ("decode", "prefill_tokens", "prefill_seqs")):
                raise ValueError
        except (ValueError, AttributeError):
            raise ValueError(f"{path}:{n}: expected a JSON object with decode, prefill_tokens and prefill_seqs "
                             f"counts, got {line[:80]!r}") from None
        steps.append(s)
    if not steps:
        raise ValueError(f"{path}: no steps")
    return steps


def record(engine: Engine, jobs, concurrency: int, progress: bool) -> list:
    """Run ``jobs`` at ``concurrency`` through a tracing engine; the steps it ran."""
    serve(engine, [[job] for job in jobs], concurrency, {"temperature": 0.0}, progress)
    return engine.trace


def compare(costs: StepCosts, decode_steps: Counter, mixed_steps: Counter, base: Choice, max_graphs: int,
            pool_mib: float, max_prefill_seqs: int) -> list[tuple[str, Choice]]:
    """The sets of the report: the defaults, the tuned set within the budgets, the fewest graphs
    expected within 2% of the defaults' time, and the best set within half the defaults' pool."""
    tuned = choose(costs, decode_steps, mixed_steps, max_graphs, pool_mib, max_prefill_seqs)
    sets = [("default", base), (f"tuned, at most {max_graphs} graphs", tuned)]
    for g in range(2, tuned.graphs):
        fewer = choose(costs, decode_steps, mixed_steps, g, pool_mib, max_prefill_seqs)
        if fewer.total_ms <= 1.02 * base.total_ms:
            sets.append(("tuned, fewest graphs within 2%", fewer))
            break
    if base.pool_mib <= 0:
        return sets  # no graph pool to halve (eager steps on a CPU)
    try:
        half = choose(costs, decode_steps, mixed_steps, max_graphs, min(pool_mib, base.pool_mib / 2), max_prefill_seqs)
        sets.append(("tuned, half the defaults' pool", half))
    except ValueError:
        pass  # no set of a decode size and a mixed graph fits in half
    return sets


def _report(rows: list[tuple[str, Choice]]) -> str:
    lines = ["| buckets | graphs | graph pool, modelled (MiB) | expected mean step (ms) | steps run eagerly |",
             "| --- | --- | --- | --- | --- |"]
    for name, c in rows:
        lines.append(f"| {name} | {c.graphs} | {c.pool_mib:.0f} | {c.mean_ms:.3f} | {c.eager_steps} of {c.steps} |")
    return "\n".join(lines)


def _plot(path: str, costs: StepCosts, tuned: BucketSet, default: BucketSet) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(costs.decode, costs.decode_graph_ms, "o-", ms=3, label="decode step, CUDA graph")
    ax.plot(costs.decode, costs.decode_eager_ms, "s--", ms=3, label="decode step, eager")
    for s in tuned.decode:
        ax.axvline(s, color="tab:green", alpha=0.4, lw=1)
    ax.plot([], [], color="tab:green", alpha=0.4, label="tuned decode buckets")
    ax.plot(default.decode, [0] * len(default.decode), "k|", ms=12, label="default decode buckets")
    ax.set(xlabel="decode rows", ylabel="step time (ms)", title="measured step time and the chosen buckets")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _run(make_engine, buckets: BucketSet, jobs, concurrency: int, progress: bool) -> dict:
    """The workload once, on a fresh engine over ``buckets``: what it measured."""
    engine = make_engine(buckets)
    report = engine.capture_report
    t = serve(engine, [[job] for job in jobs], concurrency, {"temperature": 0.0}, progress)
    stats = summarize(t, len(jobs))
    return {"pool_mib": report.pool_bytes / 2**20 if report is not None else None,
            "capture_s": report.seconds if report is not None else None,
            "step_ms": 1e3 * t["wall"] / len(engine.trace), "itl_p50_ms": stats["itl_ms"]["p50"],
            "output_tokens_per_s": stats["output_tokens_per_s"]}


def _validate(make_engine, jobs, concurrency: int, sets: list[tuple[str, Choice]], rounds: int,
              progress: bool) -> list[dict]:
    """Run the workload with each distinct set, ``rounds`` times, the order reversed every other
    round (a drift over the run then shows as a spread, not as a difference between sets); per
    set of ``sets`` the rounds' means, and each round's tokens/s."""
    distinct = list(dict.fromkeys(c.buckets for _, c in sets))  # a row may repeat another's set
    runs: dict[BucketSet, list[dict]] = {b: [] for b in distinct}
    for r in range(rounds):
        for b in (distinct if r % 2 == 0 else distinct[::-1]):
            runs[b].append(_run(make_engine, b, jobs, concurrency, progress))
    return [{**{k: (sum(m[k] for m in ms) / len(ms) if ms[0][k] is not None else None) for k in ms[0]},
             "output_tokens_per_s_rounds": [m["output_tokens_per_s"] for m in ms]}
            for ms in (runs[c.buckets] for _, c in sets)]


def validated_table(sets: list[dict]) -> str:
    """Each set's measured run beside the defaults' (the first), from the JSON of --json."""
    base = sets[0]["measured"]["output_tokens_per_s"]
    lines = ["| buckets | graphs | graph pool, modelled / measured (MiB) | expected mean step (ms) | mean step (ms) | "
             "inter-token p50 (ms) | output tokens/s | vs default |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in sets:
        m = s["measured"]
        pool = f"{m['pool_mib']:.0f}" if m["pool_mib"] is not None else "no graphs"
        rounds = m.get("output_tokens_per_s_rounds", [])
        spread = f" ({min(rounds):.0f}–{max(rounds):.0f})" if len(rounds) > 1 else ""
        lines.append(f"| {s['name']} | {s['graphs']} | {s['pool_mib']:.0f} / {pool} | {s['expected_ms']:.3f} | "
                     f"{m['step_ms']:.3f} | {m['itl_p50_ms']:.3f} | {m['output_tokens_per_s']:.0f}{spread} | "
                     f"{100 * (m['output_tokens_per_s'] / base - 1):+.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = Parser(prog="mambastep tune", description=__doc__)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="PATH", help="HF checkpoint directory")
    source.add_argument("--preset", choices=sorted(PRESETS),
                        help="built-in shape with random weights (default: mamba2-130m on a GPU, tiny-hybrid on CPU)")
    parser.add_argument("--trace", metavar="PATH", help="step shapes as JSON lines (`mambastep run --trace`); "
                        "default: record a synthetic workload")
    parser.add_argument("--requests", type=int, default=64, help="synthetic workload: requests")
    parser.add_argument("--concurrency", type=int, default=16, help="synthetic workload: requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="synthetic workload seed")
    parser.add_argument("--max-graphs", type=int, default=None, help="graph budget (default: the defaults' count)")
    parser.add_argument("--pool-mib", type=float, default=None, help="graph-pool budget in MiB (default: none)")
    parser.add_argument("--max-decode", type=int, default=None, help="largest decode size to measure")
    parser.add_argument("--max-prefill", type=int, default=None, help="largest prefill size to measure")
    parser.add_argument("--measurements", metavar="PATH", default="tune-measurements.json",
                        help="the measurement cache, read when it matches this model, dtype, device and code")
    parser.add_argument("--out", metavar="PATH", default="buckets.json", help="where to write the BucketSet")
    parser.add_argument("--plot", metavar="PNG", help="draw step time against batch size, buckets marked")
    parser.add_argument("--validate", action="store_true",
                        help="run the synthetic workload with every set of the report, side by side")
    parser.add_argument("--rounds", type=int, default=1,
                        help="--validate: runs of each set, in reversed order every other round (default 1)")
    parser.add_argument("--json", metavar="PATH", help="write the report (and what --validate measured) as JSON")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    add_quantization(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    for flag in ("requests", "concurrency", "max_graphs", "max_decode", "max_prefill", "rounds"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be at least 1, got {value}")
    if args.max_graphs is not None and args.max_graphs < 2:
        parser.error("--max-graphs: a bucket set needs at least 2 graphs (a decode size and a mixed one)")
    for flag, path in (("--out", args.out), ("--measurements", args.measurements), ("--plot", args.plot),
                       ("--json", args.json)):
        writable_path(parser, flag, path)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error('--plot: needs matplotlib (pip install -e ".[plot]")')
    trace = None
    if args.trace:
        try:
            trace = read_trace(args.trace)
        except OSError as e:
            parser.error(f"--trace {args.trace}: {e.strerror}")
        except ValueError as e:
            parser.error(f"--trace {e}")
    device = device_arg(parser, args.device)
    gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if gpu else torch.float32
    default = BucketSet.default(gpu)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))

    name = args.model or args.preset or ("mamba2-130m" if gpu else "tiny-hybrid")
    try:
        model = (Model.from_pretrained(args.model, dtype=dtype, device=device, quantization=args.quantization)
                 if args.model else Model.from_preset(name, dtype=dtype, device=device, seed=args.seed,
                                                      quantization=args.quantization))
    except (ConfigError, WeightError) as e:
        parser.error(f"--model {args.model}: {e}")

    def make_engine(buckets, graphs=gpu):
        return Engine(model, buckets=buckets, use_graphs=graphs, progress=not args.quiet, trace=True)

    key = tune_measure.cache_key(model)
    cached = tune_measure.load(args.measurements, key) if Path(args.measurements).exists() else None
    if cached:
        costs, measured = cached
        say(f"measurements of {measured['date']} from {args.measurements}")
    else:
        if Path(args.measurements).exists():
            say(f"{args.measurements} holds another model, dtype, device or code version: measuring anew")
        candidates = tune_measure.Candidates.around(default, args.max_decode, args.max_prefill)
        say(f"measuring {len(candidates.decode)} decode sizes and {len(candidates.mixed_decode)} x "
            f"{len(candidates.prefill)} mixed buckets of {name} on {key['device']}")
        measured = tune_measure.measure(model, candidates, progress=not args.quiet)
        tune_measure.save(measured, args.measurements)
        costs = tune_measure.load(args.measurements, key)[0]

    jobs = workload(args.requests, model.cfg.vocab_size, args.seed)
    if trace is None:
        say(f"recording {args.requests} requests of {name} at concurrency {args.concurrency}, eagerly")
        trace = record(make_engine(default, graphs=False), jobs, args.concurrency, progress=not args.quiet)
    decode_steps, mixed_steps = workload_steps(trace)

    # the defaults, priced over the sizes measured (sizes above them run eagerly)
    base = BucketSet(tuple(s for s in default.decode if s in costs.decode) or (costs.decode[0],),
                     tuple(s for s in default.mixed_decode if s in costs.mixed_decode),
                     tuple(s for s in default.prefill if s in costs.prefill) or (costs.prefill[0],),
                     default.max_prefill_seqs)
    base_cost = expected_ms(costs, base, decode_steps, mixed_steps)
    budget = args.max_graphs or base_cost.graphs
    try:
        sets = compare(costs, decode_steps, mixed_steps, base_cost, budget, args.pool_mib or float("inf"),
                       default.max_prefill_seqs)
    except ValueError as e:
        parser.error(str(e))
    tuned = sets[1][1]
    tuned.buckets.save(args.out)
    print(f"{len(trace)} steps ({sum(decode_steps.values())} decode-only, {sum(mixed_steps.values())} mixed) of "
          f"{name}; budget {budget} graphs" + (f", {args.pool_mib:.0f} MiB of pool" if args.pool_mib else ""))
    print(_report(sets))
    b = tuned.buckets
    print(f"wrote {args.out}: decode {b.decode}, mixed decode {b.mixed_decode}, prefill {b.prefill}")
    if tuned.eager_steps:
        print(f"{tuned.eager_steps} steps fit no tuned bucket and run eagerly (a larger budget would cover them)")
    if args.plot:
        _plot(args.plot, costs, b, base)
        print(f"wrote {args.plot}")
    result = {"model": name, "device": key["device"], "date": datetime.date.today().isoformat(),
              "requests": args.requests, "concurrency": args.concurrency, "trace": args.trace, "steps": len(trace),
              "max_graphs": budget, "pool_mib": args.pool_mib, "rounds": args.rounds if args.validate else 0,
              "sets": [{"name": n, "buckets": dataclasses.asdict(c.buckets), "graphs": c.graphs,
                        "pool_mib": c.pool_mib, "expected_ms": c.mean_ms, "eager_steps": c.eager_steps}
                       for n, c in sets]}
    if args.validate:
        for s, m in zip(result["sets"], _validate(make_engine, jobs, args.concurrency, sets, args.rounds,
                                                      not args.quiet)):
            s["measured"] = m
        print(validated_table(result["sets"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0

if __name__ == "__main__":
    sys.exit(main())
