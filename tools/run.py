"""mambastep run: serve a synthetic workload through the Engine and report latencies.

Workloads (``--workload``):
  chat        independent requests, prompt and output lengths drawn around 223 and 140 tokens
              (ShareGPT's means)
  multi-turn  conversations of ``--turns`` turns, each resending the whole conversation (its
              prompts and answers) with a new user message of about 60 tokens
  agentic     long prompts (``--prompt-tokens``, default three quarters of --max-context) of
              which 90% is one of four shared prefixes (an agent's instructions and tools)

Requests arrive as earlier ones finish, keeping ``--concurrency`` in flight (a conversation's
next turn as soon as its last ends): a closed loop, whose offered load follows the engine's
speed. With ``--rate`` they arrive at that many a second instead (a Poisson process, seeded),
each when due, at most ``--concurrency`` in flight if given: the same load for any engine, so
two runs' latencies compare; a request's TTFT then counts from its arrival, any wait for a
place in flight included. Reported per request: time to first token (TTFT),
inter-token latency (ITL, the mean gap between its tokens) and request latency, and for
conversations the TTFT of their later turns apart; over the run: output tokens/s and
requests/s. ``--prefix-cache-gib`` runs the engine with a prefix cache of that size. An engine
whose state slots hold fewer requests than are in flight queues the rest, in their TTFT; the
run says so when it starts.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections import deque

import numpy as np
import torch
from tqdm import tqdm

from ..runtime.config import ConfigError
from ..runtime.engine import Engine
from ..runtime.presets import PRESETS
from ..runtime.request import SamplingParams
from ..runtime.weights import WeightError
from .args import Parser, add_quantization, add_sampling, bucket_file, device as device_arg, sampling as sampling_fields
from .args import add_speculative, speculative_arg, writable_path

# the workload's shortest prompt plus its shortest output
MIN_CONTEXT = 8


WORKLOADS = ("chat", "multi-turn", "agentic")


def _lognormal(rng, mean, n, hi):
    return np.clip(rng.lognormal(np.log(mean) - 0.18, 0.6, n), 4, hi).astype(int)


def workload(n: int, vocab: int, seed: int, prompt_mean=223, output_mean=140, max_context=4096):
    """n (prompt ids, output length) pairs, lengths log-normal around the given means."""
    rng = np.random.default_rng(seed)
    prompt_lens = _lognormal(rng, prompt_mean, n, max_context // 2)
    output_lens = _lognormal(rng, output_mean, n, max_context // 2)
    return [(rng.integers(1, vocab, p).tolist(), int(o)) for p, o in zip(prompt_lens, output_lens)]


def conversations(kind: str, n: int, vocab: int, seed: int, max_context: int, turns: int = 4,
                  prompt_tokens: int | None = None) -> list[list[tuple[list[int], int]]]:
    """``n`` requests as conversations, each a list of turns (the tokens the turn adds, its
    output length): ``chat`` one turn each; ``multi-turn`` ``turns`` each (n rounded up to
    whole conversations), the first of ``prompt_tokens`` (default: about 223) and the later ones
    adding a user message of about 60 tokens; ``agentic`` one turn of ``prompt_tokens``, 90% of
    them one of four shared prefixes."""
    rng = np.random.default_rng(seed)
    if kind == "chat":
        return [[job] for job in workload(n, vocab, seed, max_context=max_context)]
    if kind == "agentic":
        total = prompt_tokens or max_context * 3 // 4
        shared = [rng.integers(1, vocab, total * 9 // 10).tolist() for _ in range(4)]
        out = _lognormal(rng, 140, n, max(4, (max_context - total) // 2))
        return [[(shared[i % 4] + rng.integers(1, vocab, total - total * 9 // 10).tolist(), int(o))]
                for i, o in enumerate(out)]
    convs = []
    for _ in range(-(-n // turns)):
        first = prompt_tokens or _lognormal(rng, 223, 1, max_context // 4)[0]
        users = [rng.integers(1, vocab, int(k)).tolist() for k in [first, *_lognormal(rng, 60, turns - 1, 200)]]
        convs.append(list(zip(users, (int(o) for o in _lognormal(rng, 140, turns, max_context // 8)))))
    return convs


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrivals of a Poisson process of ``rate`` a second: seconds from the start, rising."""
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n)).tolist()


def serve(engine: Engine, convs, concurrency: int, sampling: dict, progress: bool,
          arrivals: list[float] | None = None) -> dict:
    """Run every conversation (a list of turns, each the tokens it adds and its output length;
    an independent request is a conversation of one turn), each turn after the last and resending
    the conversation so far, with at most ``concurrency`` requests in flight, each sampling with
    the ``SamplingParams`` fields in ``sampling``; per-request timings in seconds. A turn that
    would pass the engine's max_context ends its conversation. ``arrivals``: each conversation's
    first turn arrives that many seconds after the start (rising), and its timings count from
    then; else each request arrives as it is sent."""
    start = time.perf_counter()
    # (conversation, turn, its history, when it arrives: None, as it is sent)
    pending = deque((c, 0, [], None if arrivals is None else start + arrivals[c]) for c in range(len(convs)))
    started, first, last, gaps, tokens = {}, {}, {}, {}, {}
    job = {}  # request id -> (conversation, turn, prompt)
    done, total = 0, sum(len(c) for c in convs)
    bar = tqdm(total=total, desc="requests", disable=not progress, file=sys.stderr)
    while done < total:
        while (pending and len(started) - done < concurrency
               and (pending[0][3] is None or pending[0][3] <= time.perf_counter())):
            c, turn, history, due = pending.popleft()
            added, n_out = convs[c][turn]
            prompt = history + added
            if len(prompt) + n_out > engine.max_context:  # the conversation is as long as it gets
                total -= len(convs[c]) - turn
                bar.total = total
                continue
            params = SamplingParams(**sampling, max_tokens=n_out, ignore_eos=True)
            rid = engine.add_request(prompt, params)
            started[rid] = due if due is not None else time.perf_counter()
            tokens[rid], job[rid] = [], (c, turn, prompt)
        if done >= total:
            break
        if not engine.has_unfinished() and pending and pending[0][3] is not None:  # idle until the next arrival
            time.sleep(max(0.0, pending[0][3] - time.perf_counter()))
            continue
        for out in engine.step():
            now = time.perf_counter()
            if out.id not in first:
                first[out.id] = now
            else:
                gaps.setdefault(out.id, []).append(now - last[out.id])
            last[out.id] = now
            tokens[out.id] += out.new_tokens
            if out.finished:
                done += 1
                bar.update()
                c, turn, prompt = job[out.id]
                if turn + 1 < len(convs[c]):
                    pending.appendleft((c, turn + 1, prompt + tokens[out.id], None))
    wall = time.perf_counter() - start
    bar.close()
    ids = sorted(started)
    return {
        "ttft": [first[i] - started[i] for i in ids],
        "ttft_later_turns": [first[i] - started[i] for i in ids if job[i][1] > 0],
        "itl": [float(np.mean(gaps[i])) for i in ids if i in gaps],
        "latency": [last[i] - started[i] for i in ids],
        "output_tokens": sum(len(t) for t in tokens.values()),
        "requests": len(ids),
        "wall": wall,
        "outputs": {job[i][:2]: tokens[i] for i in ids},
    }


def summarize(t: dict, n_requests: int) -> dict:
    stats = {}
    for key in ("ttft", "itl", "latency", "ttft_later_turns"):
        if t.get(key):
            v = np.asarray(t[key]) * 1e3
            stats[key + "_ms"] = {"mean": float(v.mean()),
                                  **{f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}}
    stats["output_tokens"] = t["output_tokens"]
    stats["output_tokens_per_s"] = t["output_tokens"] / t["wall"]
    stats["requests_per_s"] = n_requests / t["wall"]
    stats["wall_s"] = t["wall"]
    return stats


def print_table(stats: dict, header: str) -> None:
    print(header)
    print("| metric | mean | p50 | p90 | p99 |")
    print("| --- | --- | --- | --- | --- |")
    for key, name in (("ttft_ms", "time to first token (ms)"),
                      ("ttft_later_turns_ms", "  of a conversation's later turns (ms)"),
                      ("itl_ms", "inter-token latency (ms)"), ("latency_ms", "request latency (ms)")):
        if key not in stats:
            continue
        s = stats[key]
        print(f"| {name} | {s['mean']:.3f} | {s['p50']:.3f} | {s['p90']:.3f} | {s['p99']:.3f} |")
    print(f"output tokens/s: {stats['output_tokens_per_s']:.1f}   requests/s: {stats['requests_per_s']:.2f}   "
          f"wall: {stats['wall_s']:.1f} s")


def main(argv=None) -> int:
    parser = Parser(prog="mambastep run", description=__doc__)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="PATH", help="HF checkpoint directory (config.json + safetensors)")
    source.add_argument("--preset", choices=sorted(PRESETS),
                        help="built-in shape with random weights (default: mamba2-130m on a GPU, tiny-hybrid on CPU)")
    parser.add_argument("--requests", type=int, default=None, help="requests to serve (default: 256 on GPU, 16 on CPU)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="requests in flight (default: 64 on GPU, 8 on CPU; with --rate, no limit)")
    parser.add_argument("--rate", type=float, default=None, metavar="R",
                        help="requests (conversations) arriving R a second, a Poisson process, rather than each as "
                             "another finishes (see above)")
    parser.add_argument("--eager", action="store_true", help="run without CUDA graphs (for comparison)")
    parser.add_argument("--pipelined", action="store_true", help="launch step N+1 before reading step N's tokens")
    parser.add_argument("--buckets", metavar="PATH", help="graph buckets from `mambastep tune` (default: built in)")
    add_sampling(parser)
    parser.add_argument("--max-context", type=int, default=4096, help="prompt + output tokens per request")
    add_quantization(parser)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0, help="workload and weight seed")
    parser.add_argument("--json", metavar="PATH", help="also write the statistics as JSON to PATH")
    parser.add_argument("--trace", metavar="PATH", help="write every step's shape, bucket and time (ms; not with "
                        "--pipelined) as JSON lines to PATH (`mambastep tune` reads such traces)")
    parser.add_argument("--workload", choices=WORKLOADS, default="chat",
                        help="chat (independent requests), multi-turn (conversations resent whole each turn) or "
                             "agentic (long prompts sharing 90%% of their tokens); see above")
    parser.add_argument("--turns", type=int, default=4, help="turns a conversation (multi-turn)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="agentic: the prompts' length (default three quarters of --max-context); multi-turn: "
                             "the first turn's (default about 223)")
    parser.add_argument("--prefix-cache-gib", type=float, default=0.0, metavar="GIB",
                        help="keep snapshots of prompts' state in this much device memory, so that a repeated "
                             "prefix is not prefilled again (default 0: no prefix cache)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_speculative(parser)
    args = parser.parse_args(argv)

    device = device_arg(parser, args.device)
    gpu = device.startswith("cuda")
    requests = args.requests if args.requests is not None else (256 if gpu else 16)
    concurrency = args.concurrency if args.concurrency is not None else (64 if gpu else 8)
    if args.rate is not None and args.concurrency is None:
        concurrency = requests * args.turns  # no limit: more than the run ever has in flight
    for flag, value in (("--requests", requests), ("--concurrency", concurrency)):
        if value < 1:
            parser.error(f"{flag}: must be at least 1, got {value}")
    if args.rate is not None and not args.rate > 0:
        parser.error(f"--rate: must be above 0 requests a second, got {args.rate}")
    if args.max_context < MIN_CONTEXT:
        parser.error(f"--max-context: must be at least {MIN_CONTEXT} (the workload's shortest prompt and "
                     f"output), got {args.max_context}")
    if args.turns < 1 or args.prefix_cache_gib < 0:
        parser.error(f"--turns must be at least 1 and --prefix-cache-gib at least 0, got {args.turns}, "
                     f"{args.prefix_cache_gib}")
    if args.prompt_tokens is not None and not 10 <= args.prompt_tokens <= args.max_context - 8:
        parser.error(f"--prompt-tokens: expected 10 to --max-context - 8 = {args.max_context - 8}, "
                     f"got {args.prompt_tokens}")
    sampling = sampling_fields(parser, args)
    buckets = bucket_file(parser, "--buckets", args.buckets)
    writable_path(parser, "--json", args.json)
    writable_path(parser, "--trace", args.trace)
    dtype = torch.bfloat16 if gpu else torch.float32
    common = dict(dtype=dtype, device=device, max_context=args.max_context, use_graphs=gpu and not args.eager,
                  pipelined=args.pipelined, progress=not args.quiet, buckets=buckets, trace=args.trace is not None,
                  quantization=args.quantization, prefix_cache_gib=args.prefix_cache_gib,
                  speculative=speculative_arg(parser, args))
    try:
        if args.model:
            try:
                engine = Engine.from_pretrained(args.model, **common)
            except (ConfigError, WeightError) as e:
                parser.error(f"--model {args.model}: {e}")
            name = args.model
        else:
            name = args.preset or ("mamba2-130m" if gpu else "tiny-hybrid")
            engine = Engine.from_preset(name, seed=args.seed, **common)
    except ValueError as e:  # a prefix cache that holds no snapshot, a draft model of too few tokens
        parser.error(str(e).replace("prefix_cache_gib", "--prefix-cache-gib", 1).replace("draft model:",
                                                                                        "--draft-model:", 1))
    if engine.capture_report is not None and not args.quiet:
        print(engine.capture_report, file=sys.stderr)
    bounded = args.rate is None or args.concurrency is not None  # else no limit on requests in flight
    # the engine queues what its state slots cannot hold; that wait is part of each TTFT
    queued = concurrency - engine.num_slots if bounded else 0
    if queued > 0:
        print(f"mambastep run: the engine holds {engine.num_slots} requests at a time (its state slots: the "
              f"largest decode bucket, or what a share of free device memory holds); {queued} of the "
              f"{concurrency} in flight wait for a slot, in their TTFT", file=sys.stderr)

    convs = conversations(args.workload, requests, engine.cfg.vocab_size, args.seed, args.max_context, args.turns,
                          args.prompt_tokens)
    arrivals = None if args.rate is None else arrival_times(len(convs), args.rate, args.seed)
    timings = serve(engine, convs, concurrency, sampling, progress=not args.quiet, arrivals=arrivals)
    if args.trace:
        engine.write_trace(args.trace)
    requests = timings["requests"]
    stats = summarize(timings, requests)
    if engine.prefix_cache is not None:
        stats["prefix_cache"] = {"snapshots": len(engine.prefix_cache.slots), **engine.prefix_cache.stats}
    if engine.speculative is not None:
        stats["speculative"] = dict(engine.speculative_stats)
    mode = "eager" if (args.eager or not gpu) else "CUDA graphs"
    load = f"concurrency {concurrency}" if args.rate is None else (
        f"{args.rate:g} a second" + (f", concurrency {concurrency}" if args.concurrency is not None else ""))
    if queued > 0:
        load += f" ({engine.num_slots} at a time)"
    print_table(stats, f"\n{name} on {torch.cuda.get_device_name() if gpu else 'CPU'} ({mode}), {args.workload}, "
                       f"{requests} requests, {load}")
    if engine.prefix_cache is not None:
        c = stats["prefix_cache"]
        print(f"prefix cache: {c['snapshots']} snapshots, {c['hits']} hits of {c['lookups']} lookups, "
              f"{c['tokens_restored']} prompt tokens restored, {c['evictions']} evictions")
    if engine.speculative is not None:
        s = stats["speculative"]
        print(f"speculative: {s['verified']} verify sequences, {s['accepted']} of {s['drafts']} drafts accepted")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, "device": device, "device_name": torch.cuda.get_device_name() if gpu else "CPU",
                       "date": datetime.date.today().isoformat(), "mode": mode, "pipelined": args.pipelined,
                       "quantization": args.quantization, "workload": args.workload,
                       "prefix_cache_gib": args.prefix_cache_gib, "num_drafts": args.speculative,
                       "draft_model": args.draft_model, "mtp": args.mtp, "requests": requests,
                       "concurrency": concurrency if bounded else None,
                       "slots": engine.num_slots,
                       "rate": args.rate, "sampling": sampling, **stats}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
