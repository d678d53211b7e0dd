"""mambastep serve: an OpenAI-compatible HTTP server (Starlette on uvicorn) over the Engine.

    mambastep serve --model PATH --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 16, "stream": true}'

Endpoints: /v1/completions and /v1/chat/completions (with "stream": true as server-sent events
and usage counts), /v1/models, /health. One loop owns the engine and steps while requests
arrive, in a process of its own (or with --engine thread, a thread of the server); a client that
disconnects frees its slot; a bad request gets a 400 and touches nothing else; past
--max-requests a request gets a 503. A preset (random weights, no tokenizer) serves
text as bytes and token-id prompts, for load tests. Needs `pip install -e ".[serve]"`.
"""

from __future__ import annotations

import functools
import sys

import torch

from ..runtime.presets import PRESETS
from ..runtime.text import TextEngine
from .args import Parser, bucket_file, device as device_arg, text_engine


def main(argv=None) -> int:
    parser = Parser(prog="mambastep serve", description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH", help="HF checkpoint directory (with tokenizer.json)")
    source.add_argument("--preset", choices=sorted(PRESETS), help="built-in shape with random weights")
    parser.add_argument("--name", help="the model name clients send (default: the path or preset)")
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
    args = parser.parse_args(argv)
    try:
        import uvicorn

        from ..runtime.openai_api import create_app
        from ..runtime.serving import EngineLoop, EngineProcess
    except ImportError as e:
        parser.error(f"the server needs its extra: pip install -e \".[serve]\" ({e})")
    device = device_arg(parser, args.device)
    if not 0 <= args.port < 65536:
        parser.error(f"--port: expected 0..65535, got {args.port}")
    for flag, value in (("--max-requests", args.max_requests), ("--max-tokens", args.max_tokens)):
        if value is not None and value < 1:
            parser.error(f"{flag}: must be at least 1, got {value}")
    gpu = device.startswith("cuda")
    common = dict(dtype=torch.bfloat16 if gpu else torch.float32, device=device, max_context=args.max_context,
                  buckets=bucket_file(parser, "--buckets", args.buckets), use_graphs=gpu and not args.eager,
                  pipelined=args.pipelined)
    if args.engine == "process":
        try:
            loop = EngineProcess(functools.partial(TextEngine.load, args.model, args.preset, **common),
                                 max_requests=args.max_requests)
        except ValueError as e:
            parser.error(str(e))
    else:
        loop = EngineLoop(text_engine(parser, args.model, args.preset, **common), max_requests=args.max_requests)
        # The engine thread lets go of the GIL while it waits for the GPU; with the default 5 ms
        # switch interval a busy event loop then keeps it for up to 5 ms, a 130M model's twenty
        # decode steps.
        sys.setswitchinterval(2e-4)
    name = args.name or args.model or args.preset
    try:
        uvicorn.run(create_app(loop, name, default_max_tokens=args.max_tokens), host=args.host, port=args.port,
                    log_level="warning")
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
