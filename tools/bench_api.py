"""mambastep bench api: what the HTTP side of `mambastep serve` costs, without a model or a GPU.

`mambastep serve`'s app and engine placement run in a process of their own over a stand-in
engine that steps at a fixed pace (each request one byte-level token a step, ``--step-ms`` a
step, asleep meanwhile as the real engine waits for the GPU), loaded by `bench serve`'s client
with the same workload. It prints the API process's CPU time per streamed token, the share of one
core it used, and the client's statistics: the server overhead that `bench serve` measures on the
GPU, here on any machine. The default pace is Mamba2-130M's step at concurrency 64 on the H200.

    mambastep bench api --concurrency 64 --requests 256 --step-ms 1.75
"""

from __future__ import annotations

import functools
import itertools
import json
import multiprocessing
import os
import sys
import threading
import time

from ..runtime.request import RequestOutput
from .args import Parser, writable_path

__all__ = ["StandInEngine", "main"]


class StandInEngine:
    """Just enough of ``Engine`` for ``TextEngine`` and the engine loops: every request gets one
    token a step (a letter, so text streams), ``step_s`` a step, until its ``max_tokens``."""

    def __init__(self, step_s: float = 1.75e-3, slots: int = 256):
        self.step_s, self.slots = step_s, slots
        self.max_context = 1 << 20
        self.prefix_cache = None
        self.requests: dict[int, list[int]] = {}  # id -> [tokens left, tokens made]
        self._ids = itertools.count()

    @property
    def scheduler(self):
        return self  # the loops read ``engine.scheduler``'s free slots, running and waiting requests

    @property
    def free_slots(self) -> list[int]:
        return list(range(max(0, self.slots - len(self.requests))))

    @property
    def running(self) -> list[int]:
        return list(self.requests)[: self.slots]

    @property
    def waiting(self) -> list[int]:
        return list(self.requests)[self.slots:]

    def add_request(self, prompt: list[int], params) -> int:
        if not prompt:
            raise ValueError("prompt: empty")
        rid = next(self._ids)
        self.requests[rid] = [params.max_tokens, 0]
        return rid

    def abort(self, request_id: int) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        outs = []
        for rid, state in list(self.requests.items()):
            state[0] -= 1
            state[1] += 1
            done = state[0] == 0
            outs.append(RequestOutput(rid, [97 + state[1] % 26], done, "length" if done else None))
            if done:
                del self.requests[rid]
        return outs


def stand_in(step_s: float):
    """The TextEngine over a stand-in engine, with the byte-level tokenizer (picklable for the
    engine process by way of functools.partial)."""
    from ..runtime.serving.text import TextEngine
    from ..runtime.serving.tokenizer import ByteTokenizer

    return TextEngine(StandInEngine(step_s=step_s), ByteTokenizer(256))


def _api_process(engine: str, step_s: float, http: str, loop: str, conn) -> None:
    """`mambastep serve`'s app over the stand-in, on a free loopback port; sends the port, then
    answers each message with this process's CPU seconds (all its threads)."""
    import uvicorn

    from ..runtime.serving.openai_api import create_app
    from ..runtime.serving.loop import EngineLoop, EngineProcess

    build = functools.partial(stand_in, step_s)
    engine_loop = EngineProcess(build) if engine == "process" else EngineLoop(build())
    if engine == "thread":
        sys.setswitchinterval(2e-4)  # as `mambastep serve --engine thread` does
    server = uvicorn.Server(uvicorn.Config(create_app(engine_loop, "stand-in"), host="127.0.0.1", port=0,
                                           http=http, loop=loop, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            conn.send(None)
            return
        time.sleep(0.01)
    conn.send(server.servers[0].sockets[0].getsockname()[1])
    while conn.recv():
        t = os.times()
        conn.send(t.user + t.system)
    server.should_exit = True
    thread.join(10)
    engine_loop.close()


def main(argv=None) -> int:
    parser = Parser(prog="mambastep bench api", description=__doc__)
    parser.add_argument("--engine", choices=("process", "thread"), default="process",
                        help="where the stand-in engine steps, as `mambastep serve --engine` (default: process)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--requests", type=int, default=256, help="requests to send")
    parser.add_argument("--step-ms", type=float, default=1.75, help="the stand-in engine's step time")
    parser.add_argument("--http", choices=("auto", "h11", "httptools"), default="auto",
                        help="uvicorn's HTTP implementation (auto: httptools where installed)")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="uvicorn's event loop (auto: uvloop where installed)")
    parser.add_argument("--processes", type=int, default=None, help="client processes (default: as bench serve)")
    parser.add_argument("--json", metavar="PATH", help="also write the statistics as JSON to PATH")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for flag, value in (("--requests", args.requests), ("--concurrency", args.concurrency)):
        if value < 1:
            parser.error(f"{flag}: must be at least 1, got {value}")
    if not args.step_ms > 0:
        parser.error(f"--step-ms: must be positive, got {args.step_ms}")
    writable_path(parser, "--json", args.json)
    try:
        import uvicorn  # noqa: F401
    except ImportError as e:
        parser.error(f"the server needs its extra: pip install -e \".[serve]\" ({e})")
    from .bench_serve import default_processes, load
    from .run import print_table, summarize, workload

    processes = args.processes or default_processes(args.concurrency)
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    api = ctx.Process(target=_api_process, args=(args.engine, args.step_ms / 1e3, args.http, args.loop, child_conn),
                      name="mambastep-api")  # not a daemon: it starts the engine process
    api.start()
    port = None
    for _ in range(1200):
        if conn.poll(0.1):
            port = conn.recv()
            break
        if not api.is_alive():
            break
    if port is None:
        api.kill()
        parser.error("the API process did not start (its traceback is above)")
    url = f"http://127.0.0.1:{port}"
    jobs = workload(args.requests, 256, 0)
    try:
        conn.send(True)
        cpu0 = conn.recv()
        timings = load(url, jobs, args.concurrency, progress=not args.quiet, processes=processes)
        conn.send(True)
        cpu = conn.recv() - cpu0
    finally:
        try:
            conn.send(False)
        except OSError:  # it has died: its traceback is above
            pass
        api.join(20)
        if api.is_alive():
            api.kill()
    stats = summarize(timings, args.requests)
    # the API process's CPU over the run (it idles outside it)
    stats.update(api_cpu_s=cpu, api_cpu_us_per_token=1e6 * cpu / stats["output_tokens"],
                 api_cores=cpu / timings["wall"])
    print_table(stats, f"\nstand-in engine, {args.step_ms} ms a step, engine {args.engine}: {args.requests} requests, "
                       f"concurrency {args.concurrency} (HTTP, streamed)")
    print(f"API process: {stats['api_cpu_us_per_token']:.1f} us of CPU a streamed token, "
          f"{stats['api_cores']:.2f} of a core")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engine": args.engine, "step_ms": args.step_ms, "http": args.http, "loop": args.loop,
                       "requests": args.requests, "concurrency": args.concurrency, "processes": processes, **stats},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
