"""mambastep serve: an OpenAI-compatible HTTP server (Starlette on uvicorn) over the Engine.

    mambastep serve --model PATH --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 16, "stream": true}'

Endpoints: /v1/completions and /v1/chat/completions (with "stream": true as server-sent events
and usage counts), /v1/models, /health. One loop owns the engine and steps while requests
arrive, in a process of its own (or with --engine thread, a thread of the server), behind
--api-processes N HTTP server processes on the same port (two by default); a client that
disconnects frees its slot; a bad request gets a 400 and touches nothing else; past
--max-requests a request gets a 503. Sampling fields a request leaves out take the checkpoint's
generation_config.json values (temperature, top_p, top_k), else OpenAI's defaults. A preset
(random weights, no tokenizer) serves text as bytes and token-id prompts, for load tests. Needs
`pip install -e ".[serve]"`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

from ..runtime.presets import PRESETS
from ..runtime.serving.text import TextEngine
from .args import Parser, add_quantization, add_speculative, bucket_file, device as device_arg, speculative_arg
from .args import template_file, text_engine


def main(argv=None) -> int:
    parser = Parser(prog="mambastep serve", description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH", help="HF checkpoint directory (with tokenizer.json)")
    source.add_argument("--preset", choices=sorted(PRESETS), help="built-in shape with random weights")
    parser.add_argument("--served-model-name", "--name", dest="name", nargs="+", metavar="NAME",
                        help="the model name(s) clients send, any of them (default: the path or preset); "
                             "responses name the one asked for, /v1/models lists them all")
    parser.add_argument("--chat-template", metavar="PATH", help="a chat template file (the template, or JSON with "
                        "a \"chat_template\" field) in place of the checkpoint's")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="requests queued or running at once; past it a 503 (default: no bound, they queue)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="max_tokens where a request names none (default: the rest of the context)")
    parser.add_argument("--max-context", type=int, default=4096, help="prompt + output tokens per request")
    parser.add_argument("--prefix-cache-gib", type=float, default=0.0, metavar="GIB",
                        help="keep snapshots of prompts' state in this much device memory, so that a repeated "
                             "prefix (a conversation's next turn, a shared system prompt) is not prefilled again "
                             "(default 0: no prefix cache); /metrics counts its hits")
    add_quantization(parser)
    add_speculative(parser)
    parser.add_argument("--buckets", metavar="PATH", help="graph buckets from `mambastep tune`")
    parser.add_argument("--pipelined", action="store_true", help="launch step N+1 before reading step N's tokens")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--engine", choices=("process", "thread"), default="process",
                        help="where the engine steps: a process of its own, fed over a pipe, so that it never "
                             "waits for the server's GIL (default), or a thread of the server")
    parser.add_argument("--api-processes", type=int, default=None,
                        help="HTTP server processes in front of the engine process, on one port, each with its "
                             "own pipe to it, for more streams a second than one Python process can write "
                             "(Linux; --max-requests bounds them together; default 2 with --engine process on Linux, "
                             "where Mamba2-130M at 64 streams kept 94%% of its in-process tokens/s against 85%% "
                             "behind one; else 1)")
    parser.add_argument("--api-key", help="a key every /v1 request must send (Authorization: Bearer KEY, as the "
                        "OpenAI client does); /health, /metrics and /version stay open")
    parser.add_argument("--max-body-bytes", type=int, default=16 << 20, help="a larger request body is a 413")
    parser.add_argument("--max-connections", type=int, default=2048,
                        help="open connections per HTTP server process; past them a 503")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM or SIGINT: seconds to let requests in flight finish (new ones get a "
                             "503, /health says draining) before the rest end with an error and the server exits")
    parser.add_argument("--no-access-log", action="store_true", help="no log line a request (on standard error)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may take from arrival; past them it is aborted with a 504 (or, "
                             "streamed, an error event) (default: no limit)")
    parser.add_argument("--watchdog-timeout", type=float, default=120.0,
                        help="seconds without a step while requests wait, after which the engine is taken for "
                             "wedged: every request ends with an error, /health says failed, the server exits 1")
    args = parser.parse_args(argv)
    try:  # the extra, checked before anything starts; ``_serve`` uses the first two
        import uvicorn  # noqa: F401

        from ..runtime.serving.openai_api import create_app  # noqa: F401
        from ..runtime.serving.loop import EngineLoop, EngineProcess
        if importlib.util.find_spec("prometheus_client") is None:  # found, not imported: see below
            raise ImportError("No module named 'prometheus_client'")
    except ImportError as e:
        parser.error(f"the server needs its extra: pip install -e \".[serve]\" ({e})")
    device = device_arg(parser, args.device)
    if args.api_processes is None:
        args.api_processes = 2 if args.engine == "process" and hasattr(socket, "SO_REUSEPORT") else 1
    if not 0 <= args.port < 65536:
        parser.error(f"--port: expected 0..65535, got {args.port}")
    for flag, value in (("--max-requests", args.max_requests), ("--max-tokens", args.max_tokens),
                        ("--api-processes", args.api_processes), ("--max-body-bytes", args.max_body_bytes),
                        ("--max-connections", args.max_connections)):
        if value is not None and value < 1:
            parser.error(f"{flag}: must be at least 1, got {value}")
    for flag, value in (("--shutdown-timeout", args.shutdown_timeout), ("--watchdog-timeout", args.watchdog_timeout),
                        ("--request-timeout", args.request_timeout or 1)):
        if not value > 0:
            parser.error(f"{flag}: must be a positive number of seconds, got {value}")
    if args.api_processes > 1 and args.engine != "process":
        parser.error("--api-processes: more than one needs the engine in its own process (--engine process)")
    if args.api_processes > 1 and not hasattr(socket, "SO_REUSEPORT"):
        parser.error("--api-processes: more than one needs SO_REUSEPORT (Linux)")
    speculative = speculative_arg(parser, args)
    try:  # first: a port in use fails now, not after the engine's minutes of warm-up and capture
        sock = _listen(args.host, args.port, shared=args.api_processes > 1)
    except OSError as e:
        parser.error(f"--host {args.host} --port {args.port}: {e.strerror or e}")
    gpu = device.startswith("cuda")
    template_file(parser, args.chat_template)
    common = dict(dtype=torch.bfloat16 if gpu else torch.float32, device=device, max_context=args.max_context,
                  buckets=bucket_file(parser, "--buckets", args.buckets), use_graphs=gpu and not args.eager,
                  pipelined=args.pipelined, chat_template=args.chat_template, quantization=args.quantization,
                  prefix_cache_gib=args.prefix_cache_gib, speculative=speculative)
    if args.engine == "process":
        try:
            loop = EngineProcess(functools.partial(TextEngine.load, args.model, args.preset, **common),
                                 max_requests=args.max_requests, attach=args.api_processes - 1,
                                 watchdog=args.watchdog_timeout)
        except ValueError as e:
            parser.error(str(e))
    else:
        loop = EngineLoop(text_engine(parser, args.model, args.preset, **common), max_requests=args.max_requests,
                          watchdog=args.watchdog_timeout)
        # The engine thread lets go of the GIL while it waits for the GPU; with the default 5 ms
        # switch interval a busy event loop then keeps it for up to 5 ms, a 130M model's twenty
        # decode steps.
        sys.setswitchinterval(2e-4)
    settings = _Settings(args.name or [args.model or args.preset], args.max_tokens, args.api_key, args.max_body_bytes,
                         args.max_connections, args.shutdown_timeout, args.watchdog_timeout, args.max_requests,
                         not args.no_access_log, args.request_timeout)
    # /metrics sums every HTTP server process's counts through files here; prometheus_client
    # picks its value store when first imported, so this comes before anything imports it
    metrics_dir = tempfile.TemporaryDirectory(prefix="mambastep-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir.name
    workers, told = [], set()

    def drain_workers():
        """Every HTTP server process drains its own requests: told once (a second SIGTERM would
        cut its drain short), on a signal here, the engine's end or an error."""
        for w in workers:
            if w.pid not in told and w.is_alive():
                w.terminate()
            told.add(w.pid)

    try:
        ctx = multiprocessing.get_context("spawn")
        listening = ctx.Value("i", 0)  # the HTTP server processes taking connections yet
        attached = getattr(loop, "attached", [])
        # each HTTP server process's requests still open once it drains (-1: not draining yet);
        # entry 0 this process's, entry i the i-th worker's
        in_flight = ctx.Array("i", [-1] * (1 + len(attached)))
        for i, conn in enumerate(attached, start=1):  # they bind the port this process got
            workers.append(ctx.Process(target=_api_process, name="mambastep-api", args=(
                conn, args.host, sock.getsockname()[1], settings, listening, (in_flight, i))))
            workers[-1].start()
            # the worker holds its own copy now: with this one closed, the engine sees its
            # pipe end when the worker dies, and aborts its requests
            conn.close()
        _watch_workers(workers, loop, in_flight)
        _serve(loop, settings, sock, listening, (in_flight, 0), on_signal=drain_workers)
    finally:
        drain_workers()
        for w in workers:
            w.join(args.shutdown_timeout + 10)
            if w.is_alive():
                w.kill()
        loop.close()
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        metrics_dir.cleanup()
    if loop.failure:
        print(f"mambastep serve: error: {loop.failure}; every request in flight ended with an error", file=sys.stderr)
        return 1
    return 0


@dataclass(frozen=True)
class _Settings:
    """What every HTTP server process serves with (picklable, for the spawned ones)."""

    name: list[str]
    max_tokens: int | None
    api_key: str | None
    max_body_bytes: int
    max_connections: int
    shutdown_timeout: float
    watchdog_timeout: float
    max_requests: int | None
    access_log: bool
    request_timeout: float | None


def _watch_workers(workers, loop, in_flight) -> None:
    """Say in the log when an HTTP server process dies on its own (the engine drops its requests);
    a dead one has nothing in flight (the others' drains do not wait for it)."""
    def watch(i, w):
        w.join()
        in_flight[i] = 0
        if w.exitcode not in (0, None) and not loop.closed:
            print(f"mambastep serve: HTTP server process {w.pid} exited with code {w.exitcode}; its requests "
                  "were aborted, the others go on", file=sys.stderr, flush=True)
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(w.pid)  # its live gauges leave /metrics
    for i, w in enumerate(workers, start=1):
        threading.Thread(target=watch, args=(i, w), daemon=True).start()


def _listen(host: str, port: int, shared: bool) -> socket.socket:
    """The listening socket; ``shared``: others may bind the same port (SO_REUSEPORT), the kernel
    spreading connections over them."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _serve(engine_loop, settings: _Settings, sock: socket.socket, listening, peers, on_signal=None) -> None:
    """Serve the API over ``engine_loop`` on ``sock`` until a signal, or until the loop stops (the
    engine failed or went away: an API process then has nothing to serve); ``listening`` (a
    shared counter) counts this process once it takes connections, and /health waits for them
    all. SIGTERM or SIGINT drains: new requests and /health get a 503 "draining", requests in
    flight have ``shutdown_timeout`` to finish, then the rest end with an error and the server
    exits; a second signal exits at once. ``peers``: (the HTTP server processes' shared counts
    of requests in flight, this one's index): a process whose own requests are done keeps
    answering 503 until every process's are, so that none closes its socket while the kernel
    still hands it connections that the others would answer (those would be reset). (The
    server's extra is installed: ``main`` checked.)"""
    import uvicorn

    from ..runtime.serving.openai_api import create_app

    draining = threading.Event()
    if settings.access_log:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(message)s"))
        access = logging.getLogger("mambastep.access")
        access.addHandler(handler)
        access.setLevel(logging.INFO)
    app = create_app(engine_loop, settings.name, default_max_tokens=settings.max_tokens,
                     listening=lambda: listening.value, api_key=settings.api_key,
                     max_body_bytes=settings.max_body_bytes, draining=draining.is_set, access_log=settings.access_log,
                     request_timeout=settings.request_timeout)

    seen = set()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # uvicorn's signal handler; nothing is re-raised after
            # the same signal twice (Ctrl-C, Ctrl-C) exits at once; another one, as the serve
            # process's SIGTERM after a Ctrl-C that reached the whole group, does not
            if sig in seen:
                self.should_exit = self.force_exit = True
            seen.add(sig)
            if draining.is_set():
                return
            draining.set()
            if on_signal is not None:
                on_signal()
            threading.Thread(target=drain, daemon=True).start()

    in_flight, me = peers

    def drain():
        end = time.monotonic() + settings.shutdown_timeout
        while time.monotonic() < end and not engine_loop.closed:
            in_flight[me] = engine_loop.open_requests()
            if not any(in_flight[:]):  # every process drained (one not yet told counts as -1)
                break
            time.sleep(0.05)
        engine_loop.end_all()  # what is left ends with an error (a 503, or an error event)
        server.should_exit = True

    server = Server(uvicorn.Config(app, log_level="warning", limit_concurrency=settings.max_connections,
                                   timeout_keep_alive=5, timeout_graceful_shutdown=5))

    def stop_with_the_engine():
        engine_loop.wait_closed()
        server.should_exit = True

    def count_when_started():
        while not server.started:
            if engine_loop.wait_closed(0.005):
                return
        with listening.get_lock():
            listening.value += 1

    threading.Thread(target=stop_with_the_engine, daemon=True).start()
    threading.Thread(target=count_when_started, daemon=True).start()
    server.run(sockets=[sock])


def _api_process(conn, host: str, port: int, settings: _Settings, listening, peers) -> None:
    """One more HTTP server process: the same app over its own connection to the engine process."""
    from ..runtime.serving.loop import EngineClient

    client = EngineClient(conn, max_requests=settings.max_requests, watchdog=settings.watchdog_timeout)
    try:
        _serve(client, settings, _listen(host, port, shared=True), listening, peers)
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
