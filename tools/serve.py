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
import multiprocessing
import signal
import socket
import sys
import threading

import torch

from ..runtime.presets import PRESETS
from ..runtime.text import TextEngine
from .args import Parser, bucket_file, device as device_arg, template_file, text_engine


def main(argv=None) -> int:
    parser = Parser(prog="mambastep serve", description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH", help="HF checkpoint directory (with tokenizer.json)")
    source.add_argument("--preset", choices=sorted(PRESETS), help="built-in shape with random weights")
    parser.add_argument("--name", help="the model name clients send (default: the path or preset)")
    parser.add_argument("--chat-template", metavar="PATH", help="a chat template file (the template, or JSON with "
                        "a \"chat_template\" field) in place of the checkpoint's")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="requests queued or running at once; past it a 503 (default: no bound, they queue)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens where a request names none")
    parser.add_argument("--max-context", type=int, default=4096, help="prompt + output tokens per request")
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
    args = parser.parse_args(argv)
    try:  # the extra, checked before anything starts; ``_serve`` uses the first two
        import uvicorn  # noqa: F401

        from ..runtime.openai_api import create_app  # noqa: F401
        from ..runtime.serving import EngineLoop, EngineProcess
    except ImportError as e:
        parser.error(f"the server needs its extra: pip install -e \".[serve]\" ({e})")
    device = device_arg(parser, args.device)
    if args.api_processes is None:
        args.api_processes = 2 if args.engine == "process" and hasattr(socket, "SO_REUSEPORT") else 1
    if not 0 <= args.port < 65536:
        parser.error(f"--port: expected 0..65535, got {args.port}")
    for flag, value in (("--max-requests", args.max_requests), ("--max-tokens", args.max_tokens),
                        ("--api-processes", args.api_processes)):
        if value is not None and value < 1:
            parser.error(f"{flag}: must be at least 1, got {value}")
    if args.api_processes > 1 and args.engine != "process":
        parser.error("--api-processes: more than one needs the engine in its own process (--engine process)")
    if args.api_processes > 1 and not hasattr(socket, "SO_REUSEPORT"):
        parser.error("--api-processes: more than one needs SO_REUSEPORT (Linux)")
    try:  # first: a port in use fails now, not after the engine's minutes of warm-up and capture
        sock = _listen(args.host, args.port, shared=args.api_processes > 1)
    except OSError as e:
        parser.error(f"--host {args.host} --port {args.port}: {e.strerror or e}")
    gpu = device.startswith("cuda")
    template_file(parser, args.chat_template)
    common = dict(dtype=torch.bfloat16 if gpu else torch.float32, device=device, max_context=args.max_context,
                  buckets=bucket_file(parser, "--buckets", args.buckets), use_graphs=gpu and not args.eager,
                  pipelined=args.pipelined, chat_template=args.chat_template)
    if args.engine == "process":
        try:
            loop = EngineProcess(functools.partial(TextEngine.load, args.model, args.preset, **common),
                                 max_requests=args.max_requests, attach=args.api_processes - 1)
        except ValueError as e:
            parser.error(str(e))
    else:
        loop = EngineLoop(text_engine(parser, args.model, args.preset, **common), max_requests=args.max_requests)
        # The engine thread lets go of the GIL while it waits for the GPU; with the default 5 ms
        # switch interval a busy event loop then keeps it for up to 5 ms, a 130M model's twenty
        # decode steps.
        sys.setswitchinterval(2e-4)
    name = args.name or args.model or args.preset
    workers = []
    try:
        ctx = multiprocessing.get_context("spawn")
        listening = ctx.Value("i", 0)  # the HTTP server processes taking connections yet
        for conn in getattr(loop, "attached", []):  # they bind the port this process got
            workers.append(ctx.Process(target=_api_process, name="mambastep-api", args=(
                conn, args.host, sock.getsockname()[1], name, args.max_tokens, args.max_requests, listening)))
            workers[-1].start()
        _serve(loop, name, args.max_tokens, sock, listening)
    finally:
        for w in workers:
            w.terminate()  # uvicorn's SIGTERM: it stops serving; its client leaves the engine
        for w in workers:
            w.join(10)
        loop.close()
    return 0


def _listen(host: str, port: int, shared: bool) -> socket.socket:
    """The listening socket; ``shared``: others may bind the same port (SO_REUSEPORT), the kernel
    spreading connections over them."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _serve(engine_loop, name: str, default_max_tokens: int, sock: socket.socket, listening) -> None:
    """Serve the API over ``engine_loop`` on ``sock`` until a signal, or until the loop stops (the
    engine process gone: an API process then has nothing to serve); ``listening`` (a shared
    counter) counts this process once it takes connections, and /health waits for them all.
    uvicorn re-raises the signal it stopped on; for SIGTERM that would end the process before
    its ``finally``, so it exits instead. (The server's extra is installed: ``main`` checked.)"""
    import uvicorn

    from ..runtime.openai_api import create_app

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = create_app(engine_loop, name, default_max_tokens=default_max_tokens, listening=lambda: listening.value)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))

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


def _api_process(conn, host: str, port: int, name: str, default_max_tokens: int, max_requests, listening) -> None:
    """One more HTTP server process: the same app over its own connection to the engine process."""
    from ..runtime.serving import EngineClient

    client = EngineClient(conn, max_requests=max_requests)
    try:
        _serve(client, name, default_max_tokens, _listen(host, port, shared=True), listening)
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
