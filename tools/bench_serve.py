"""mambastep bench serve: a load generator against a running `mambastep serve`, in genai-perf's
terms: time to first token, inter-token latency, request latency (mean, p50, p90, p99) and
output tokens/s, at a given concurrency, with the same synthetic workload as `mambastep run`
(prompts ~223 and outputs ~140 tokens, sent as token ids, streamed).

    mambastep serve --preset mamba2-130m --port 8000 &
    mambastep bench serve --url http://127.0.0.1:8000 --concurrency 64 --requests 256
"""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
import time

import numpy as np
from tqdm import tqdm

from .args import Parser, writable_path
from .run import print_table, summarize, workload


async def _one(http, prompt, n_out: int, model: str | None, stats: dict) -> None:
    body = {"prompt": prompt, "max_tokens": n_out, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    times, tokens = [], 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:  # a step's tokens
                times.append(time.perf_counter())
            else:  # the closing usage chunk
                tokens = chunk["usage"]["completion_tokens"]
    stats["ttft"].append(times[0] - start)
    if len(times) > 1:
        stats["itl"].append(float(np.mean(np.diff(times))))
    stats["latency"].append(times[-1] - start)
    stats["output_tokens"] += tokens


async def load(url: str, jobs, concurrency: int, model: str | None = None, progress: bool = True) -> dict:
    """Run ``jobs`` against ``url`` with ``concurrency`` requests in flight; timings in seconds."""
    import httpx

    stats = {"ttft": [], "itl": [], "latency": [], "output_tokens": 0}
    queue = list(reversed(jobs))
    bar = tqdm(total=len(jobs), desc="requests", disable=not progress, file=sys.stderr)

    async def worker(http):
        while queue:
            prompt, n_out = queue.pop()
            await _one(http, prompt, n_out, model, stats)
            bar.update()

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    bar.close()
    return {**stats, "wall": wall}


def main(argv=None) -> int:
    parser = Parser(prog="mambastep bench serve", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", help="the model name to send (default: none, the server's)")
    parser.add_argument("--requests", type=int, default=64, help="requests to send")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn below this")
    parser.add_argument("--max-context", type=int, default=4096, help="the server's prompt + output bound")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--json", metavar="PATH", help="also write the statistics as JSON to PATH")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for flag, value in (("--requests", args.requests), ("--concurrency", args.concurrency), ("--vocab", args.vocab)):
        if value < 1:
            parser.error(f"{flag}: must be at least 1, got {value}")
    writable_path(parser, "--json", args.json)
    import httpx

    try:
        httpx.get(args.url + "/health", timeout=10).raise_for_status()
    except httpx.HTTPError as e:
        parser.error(f"--url {args.url}: no server answers ({e})")
    jobs = workload(args.requests, args.vocab, args.seed, max_context=args.max_context)
    timings = asyncio.run(load(args.url, jobs, args.concurrency, args.model, progress=not args.quiet))
    stats = summarize(timings, args.requests)
    print_table(stats, f"\n{args.url}: {args.requests} requests, concurrency {args.concurrency} (HTTP, streamed)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.url, "date": datetime.date.today().isoformat(), "requests": args.requests,
                       "concurrency": args.concurrency, **stats}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
