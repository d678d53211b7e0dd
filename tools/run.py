"""mambastep run: serve a synthetic chat-like workload through the Engine and report latencies.

Prompt and output lengths are drawn around 223 and 140 tokens (ShareGPT's means); requests
arrive as earlier ones finish, keeping ``--concurrency`` in flight. Reported per request: time to
first token (TTFT), inter-token latency (ITL, the mean gap between its tokens) and request
latency; and over the run: output tokens/s and requests/s.
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from ..runtime.config import ConfigError
from ..runtime.engine import Engine
from ..runtime.presets import PRESETS
from ..runtime.request import SamplingParams
from ..runtime.weights import WeightError
from .args import Parser, add_quantization, add_sampling, bucket_file, device as device_arg, sampling as sampling_fields
from .args import writable_path

# the workload's shortest prompt plus its shortest output
MIN_CONTEXT = 8


def workload(n: int, vocab: int, seed: int, prompt_mean=223, output_mean=140, max_context=4096):
    """n (prompt ids, output length) pairs, lengths log-normal around the given means."""
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(prompt_mean) - 0.18, 0.6, n), 4, max_context // 2).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(output_mean) - 0.18, 0.6, n), 4, max_context // 2).astype(int)
    return [(rng.integers(1, vocab, p).tolist(), int(o)) for p, o in zip(prompt_lens, output_lens)]


def serve(engine: Engine, jobs, concurrency: int, sampling: dict, progress: bool) -> dict:
    """Run every job with at most ``concurrency`` in flight, each request sampling with the
    ``SamplingParams`` fields in ``sampling``; per-request timings in seconds."""
    pending = list(reversed(jobs))
    started, first, last, counts, gaps = {}, {}, {}, {}, {}
    done = 0
    bar = tqdm(total=len(jobs), desc="requests", disable=not progress, file=sys.stderr)
    t0 = time.perf_counter()
    while done < len(jobs):
        while pending and len(started) - done < concurrency:
            prompt, n_out = pending.pop()
            params = SamplingParams(**sampling, max_tokens=n_out, ignore_eos=True)
            rid = engine.add_request(prompt, params)
            started[rid] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            if out.id not in first:
                first[out.id] = now
            else:
                gaps.setdefault(out.id, []).append(now - last[out.id])
            last[out.id] = now
            counts[out.id] = counts.get(out.id, 0) + len(out.new_tokens)
            if out.finished:
                done += 1
                bar.update()
    wall = time.perf_counter() - t0
    bar.close()
    ids = sorted(started)
    return {
        "ttft": [first[i] - started[i] for i in ids],
        "itl": [float(np.mean(gaps[i])) for i in ids if i in gaps],
        "latency": [last[i] - started[i] for i in ids],
        "output_tokens": int(sum(counts.values())),
        "wall": wall,
    }


def summarize(t: dict, n_requests: int) -> dict:
    stats = {}
    for key in ("ttft", "itl", "latency"):
        v = np.asarray(t[key]) * 1e3
        stats[key + "_ms"] = {"mean": float(v.mean()), **{f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}}
    stats["output_tokens"] = t["output_tokens"]
    stats["output_tokens_per_s"] = t["output_tokens"] / t["wall"]
    stats["requests_per_s"] = n_requests / t["wall"]
    stats["wall_s"] = t["wall"]
    return stats


def print_table(stats: dict, header: str) -> None:
    print(header)
    print("| metric | mean | p50 | p90 | p99 |")
    print("| --- | --- | --- | --- | --- |")
    for key, name in (("ttft_ms", "time to first token (ms)"), ("itl_ms", "inter-token latency (ms)"),
                      ("latency_ms", "request latency (ms)")):
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
                        help="requests in flight (default: 64 on GPU, 8 on CPU)")
    parser.add_argument("--eager", action="store_true", help="run without CUDA graphs (for comparison)")
    parser.add_argument("--pipelined", action="store_true", help="launch step N+1 before reading step N's tokens")
    parser.add_argument("--buckets", metavar="PATH", help="graph buckets from `mambastep tune` (default: built in)")
    add_sampling(parser)
    parser.add_argument("--max-context", type=int, default=4096, help="prompt + output tokens per request")
    add_quantization(parser)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0, help="workload and weight seed")
    parser.add_argument("--json", metavar="PATH", help="also write the statistics as JSON to PATH")
    parser.add_argument("--trace", metavar="PATH", help="write every step's shape and bucket as JSON lines to PATH "
                        "(`mambastep tune` reads such traces)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    device = device_arg(parser, args.device)
    gpu = device.startswith("cuda")
    requests = args.requests if args.requests is not None else (256 if gpu else 16)
    concurrency = args.concurrency if args.concurrency is not None else (64 if gpu else 8)
    for flag, value in (("--requests", requests), ("--concurrency", concurrency)):
        if value < 1:
            parser.error(f"{flag}: must be at least 1, got {value}")
    if args.max_context < MIN_CONTEXT:
        parser.error(f"--max-context: must be at least {MIN_CONTEXT} (the workload's shortest prompt and "
                     f"output), got {args.max_context}")
    sampling = sampling_fields(parser, args)
    buckets = bucket_file(parser, "--buckets", args.buckets)
    writable_path(parser, "--json", args.json)
    writable_path(parser, "--trace", args.trace)
    dtype = torch.bfloat16 if gpu else torch.float32
    common = dict(dtype=dtype, device=device, max_context=args.max_context, use_graphs=gpu and not args.eager,
                  pipelined=args.pipelined, progress=not args.quiet, buckets=buckets, trace=args.trace is not None,
                  quantization=args.quantization)
    if args.model:
        try:
            engine = Engine.from_pretrained(args.model, **common)
        except (ConfigError, WeightError) as e:
            parser.error(f"--model {args.model}: {e}")
        name = args.model
    else:
        name = args.preset or ("mamba2-130m" if gpu else "tiny-hybrid")
        engine = Engine.from_preset(name, seed=args.seed, **common)
    if engine.capture_report is not None and not args.quiet:
        print(engine.capture_report, file=sys.stderr)

    jobs = workload(requests, engine.cfg.vocab_size, args.seed, max_context=args.max_context)
    timings = serve(engine, jobs, concurrency, sampling, progress=not args.quiet)
    if args.trace:
        engine.write_trace(args.trace)
    stats = summarize(timings, requests)
    mode = "eager" if (args.eager or not gpu) else "CUDA graphs"
    print_table(stats, f"\n{name} on {torch.cuda.get_device_name() if gpu else 'CPU'} ({mode}), "
                       f"{requests} requests, concurrency {concurrency}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": name, "device": device, "device_name": torch.cuda.get_device_name() if gpu else "CPU",
                       "date": datetime.date.today().isoformat(), "mode": mode, "pipelined": args.pipelined,
                       "quantization": args.quantization,
                       "requests": requests, "concurrency": concurrency, "sampling": sampling, **stats}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
