"""mambastep bench serve: a load generator against a running `mambastep serve`, in genai-perf's
terms: time to first token, inter-token latency, request latency (mean, p50, p90, p99) and
output tokens/s, at a given concurrency, with the same synthetic workload as `mambastep run`
(prompts ~223 and outputs ~140 tokens, sent as token ids, streamed; with --vocab the model's
vocabulary size, the very prompts `mambastep run --seed` draws). Inter-token latency is
genai-perf's: (last token - first token) / (tokens - 1) per request, as a chunk may carry several.

    mambastep serve --preset mamba2-130m --port 8000 &
    mambastep bench serve --url http://127.0.0.1:8000 --concurrency 64 --requests 256
"""

from __future__ import annotations

import asyncio
import datetime
import json
import multiprocessing
import os
import queue as queue_module
import sys
import threading
import time

from tqdm import tqdm

from .args import Parser, writable_path
from .run import print_table, summarize, workload

_SETUP_TIMEOUT = 120  # s for a client process to start, import httpx and build its client


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
            # parse only what may be the closing usage chunk: the client must keep up with the server
            chunk = json.loads(line[6:]) if '"usage"' in line else None
            if chunk is None or chunk["choices"]:  # a step's tokens
                times.append(time.perf_counter())
            else:
                tokens = chunk["usage"]["completion_tokens"]
    stats["ttft"].append(times[0] - start)
    if tokens > 1:  # genai-perf's inter-token latency: a chunk may carry several tokens
        stats["itl"].append((times[-1] - times[0]) / (tokens - 1))
    stats["latency"].append(times[-1] - start)
    stats["output_tokens"] += tokens


async def _load(url: str, take, concurrency: int, model: str | None, done, ready=None) -> dict:
    """``concurrency`` streams that each send the jobs ``take()`` hands out until it returns None;
    ``done()`` after each request. The clock starts once the client is set up and ``ready()``
    (blocking: every client process set up) has returned, as `mambastep run`'s starts at its first
    request: importing httpx and building a client take a fifth of a second in a fresh process.
    Timings in seconds; "start" and "end" on the system-wide monotonic clock."""
    import httpx

    stats = {"ttft": [], "itl": [], "latency": [], "output_tokens": 0}

    async def worker(http):
        while (job := take()) is not None:
            await _one(http, *job, model, stats)
            done()

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        if ready is not None:
            await asyncio.to_thread(ready)
        stats["start"] = time.monotonic()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        stats["end"] = time.monotonic()
    stats["wall"] = stats["end"] - stats["start"]
    return stats


def _client(url, jobs, concurrency, model, ready, finished, results) -> None:
    """One client process: its share of the streams, taking jobs from the shared queue."""

    def take():
        return jobs.get(timeout=60)

    def done():
        with finished.get_lock():
            finished.value += 1

    results.put(asyncio.run(_load(url, take, concurrency, model, done, lambda: ready.wait(_SETUP_TIMEOUT))))


def default_processes(concurrency: int) -> int:
    """Client processes for ``concurrency`` streams: up to 8, half the CPUs."""
    return min(concurrency, 8, max(1, (os.cpu_count() or 2) // 2))


def load(url: str, jobs, concurrency: int, model: str | None = None, progress: bool = True,
         processes: int = 1) -> dict:
    """Run ``jobs`` against ``url`` with ``concurrency`` requests in flight, spread over
    ``processes`` client processes (one Python process cannot read tens of thousands of chunks a
    second); per-request timings in seconds and the wall time."""
    bar = tqdm(total=len(jobs), desc="requests", disable=not progress, file=sys.stderr)
    if processes == 1:
        queue = list(reversed(jobs))
        stats = asyncio.run(_load(url, lambda: queue.pop() if queue else None, concurrency, model, bar.update))
        bar.close()
        return stats
    ctx = multiprocessing.get_context("spawn")
    shared, finished, ready, results = ctx.Queue(), ctx.Value("i", 0), ctx.Barrier(processes + 1), ctx.Queue()
    for job in jobs:
        shared.put(job)
    for _ in range(concurrency):  # one end marker a stream
        shared.put(None)
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    procs = [ctx.Process(target=_client, args=(url, shared, c, model, ready, finished, results), daemon=True)
             for c in shares]
    for p in procs:
        p.start()
    try:
        ready.wait(_SETUP_TIMEOUT)  # every client process is set up: their clocks start
    except threading.BrokenBarrierError:
        for p in procs:
            p.kill()
        raise RuntimeError(f"the client processes were not set up within {_SETUP_TIMEOUT} s "
                           "(a traceback above says why)") from None
    parts = []
    while len(parts) < processes:
        try:
            parts.append(results.get(timeout=0.2))
        except queue_module.Empty:
            # a client that ended has put its result first, unless it failed (one that ended
            # cleanly while another still runs is no failure)
            if sum(p.exitcode is not None for p in procs) > len(parts) and results.empty():
                raise RuntimeError("a client process failed (its traceback is above)") from None
        bar.update(finished.value - bar.n)
    wall = max(s["end"] for s in parts) - min(s["start"] for s in parts)
    bar.close()
    for p in procs:
        p.join()
    return {"ttft": sum((s["ttft"] for s in parts), []), "itl": sum((s["itl"] for s in parts), []),
            "latency": sum((s["latency"] for s in parts), []),
            "output_tokens": sum(s["output_tokens"] for s in parts), "wall": wall}


def main(argv=None) -> int:
    parser = Parser(prog="mambastep bench serve", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", help="the model name to send (default: none, the server's)")
    parser.add_argument("--requests", type=int, default=64, help="requests to send")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn below this")
    parser.add_argument("--max-context", type=int, default=4096, help="the server's prompt + output bound")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--processes", type=int, default=None,
                        help="client processes the streams are spread over (default: up to 8, half the CPUs)")
    parser.add_argument("--json", metavar="PATH", help="also write the statistics as JSON to PATH")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for flag, value in (("--requests", args.requests), ("--concurrency", args.concurrency), ("--vocab", args.vocab)):
        if value < 1:
            parser.error(f"{flag}: must be at least 1, got {value}")
    processes = args.processes or default_processes(args.concurrency)
    if not 1 <= processes <= args.concurrency:
        parser.error(f"--processes: expected 1..{args.concurrency} (the concurrency), got {processes}")
    writable_path(parser, "--json", args.json)
    import httpx

    try:
        r = httpx.get(args.url + "/health", timeout=10)
        if r.status_code == 503 and (health := r.json()).get("status") == "starting":
            parser.error(f"--url {args.url}: the server is starting ({health['listening']} of its "
                         f"{health['api_processes']} API processes listen); try again in a moment")
        r.raise_for_status()
        health = r.json()
        served = httpx.get(args.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        parser.error(f"--url {args.url}: no server answers ({e})")
    jobs = workload(args.requests, args.vocab, args.seed, max_context=args.max_context)
    # one request first: a wrong --model or --vocab is the server's one-line answer, not a traceback
    highest = max((job[0] for job in jobs), key=max)  # the prompt with the largest id any job sends
    probe = {"prompt": list(highest), "max_tokens": 1, **({"model": args.model} if args.model else {})}
    try:
        r = httpx.post(args.url + "/v1/completions", json=probe, timeout=60)
    except httpx.HTTPError as e:
        parser.error(f"--url {args.url}: the first request failed ({e})")
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        parser.error(f"--url {args.url}: the server refused the first request (HTTP {r.status_code}: {message}); "
                     "check --model and --vocab")
    before = health.get("steps")
    timings = load(args.url, jobs, args.concurrency, args.model, progress=not args.quiet, processes=processes)
    after = httpx.get(args.url + "/health", timeout=10).json().get("steps")
    stats = summarize(timings, args.requests)
    print_table(stats, f"\n{args.url}: {args.requests} requests, concurrency {args.concurrency} (HTTP, streamed)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.url, "model": args.model or served, "date": datetime.date.today().isoformat(),
                       "requests": args.requests, "concurrency": args.concurrency, "vocab": args.vocab,
                       "seed": args.seed, "processes": processes, "engine": health.get("engine"),
                       "api_processes": health.get("api_processes", 1),
                       "server_steps_per_s": (after - before) / timings["wall"] if before is not None else None,
                       **stats}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
