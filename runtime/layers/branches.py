"""Run a layer's prefill and decode branches, overlapped on two streams when asked."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["run_branches"]


def run_branches(prefill: Callable[[], None] | None, decode: Callable[[], None] | None,
                 aux_stream: torch.cuda.Stream | None, decode_after: torch.cuda.Event | None = None) -> None:
    """Call both branches; with an auxiliary stream and both present, fork and join around them.

    The prefill branch goes to ``aux_stream`` after it waits for everything queued so far on the
    current stream (the in_proj GEMM); the decode branch stays on the current stream, which then
    waits for the prefill branch. Inside CUDA-graph capture this becomes a fork and a join in
    the graph. Buffers made before the fork are freed only after the join, so the allocator
    never hands them out while the auxiliary stream still uses them.

    ``decode_after``: an event the prefill branch records part-way; the decode branch starts once
    the prefill branch has reached it (a staggered fork). Ignored when the branches run in turn.
    """
    if aux_stream is None or prefill is None or decode is None:
        for branch in (prefill, decode):
            if branch is not None:
                branch()
        return
    main = torch.cuda.current_stream()
    aux_stream.wait_stream(main)
    with torch.cuda.stream(aux_stream):
        prefill()
    if decode_after is not None:
        main.wait_event(decode_after)
    decode()
    main.wait_stream(aux_stream)
