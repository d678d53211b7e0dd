"""A static-shape graph runner: capture a step's stages per bucket, replay them, or run eagerly.

It knows nothing of models. A step is two stages over buffers whose addresses never change:

- ``forward(bucket) -> Tensor``: the step's main work, reading the buffers for ``bucket``;
- ``tail(bucket, x, variant) -> Tensor``: a short stage after it, over ``forward``'s output
  ``x``, in one of a few ``variants`` chosen per step (sampling modes, say).

and ``upload()``, the step's one host-to-device copy of the buffers, which the caller refills on
the host first. Setup, once: every bucket runs eagerly on a side stream (kernels compile, every
stream gets its library handles), then the buckets are captured largest first into one shared
memory pool: per bucket a forward graph whose first node is the upload, and a tail graph per
variant. A step replays them; a bucket that was not captured runs the same functions eagerly.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable, Hashable

import torch
from tqdm import tqdm

from .buckets import Bucket, largest_first

__all__ = ["CaptureReport", "GraphRunner"]


@dataclass
class CaptureReport:
    graphs: int
    seconds: float
    pool_bytes: int

    def __str__(self) -> str:
        return f"captured {self.graphs} graphs in {self.seconds:.1f} s, graph pool {self.pool_bytes / 2**20:.0f} MiB"


class GraphRunner:
    def __init__(self, forward: Callable[[Bucket], torch.Tensor],
                 tail: Callable[[Bucket, torch.Tensor, Hashable], torch.Tensor], variants: tuple,
                 upload: Callable[[], None], device: torch.device):
        """forward, tail, variants, upload: the step's stages (module doc); device: where they run."""
        self._forward_fn, self._tail_fn, self.variants, self._upload = forward, tail, variants, upload
        self.device = torch.device(device)
        self._forward: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._tails: dict[tuple[Bucket, Hashable], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    @property
    def graphs(self) -> int:
        return len(self._forward) + len(self._tails)

    def captured(self, bucket: Bucket) -> bool:
        return bucket in self._forward

    def forward(self, bucket: Bucket) -> torch.Tensor:
        """Upload the refilled buffers and run ``forward`` for ``bucket``: a replay when captured
        (the upload is its first node), else eagerly. Returns its output (a replay's output
        buffer, which the next replay overwrites)."""
        # a replay needs no grad mode; only the eager path enters inference mode
        if bucket in self._forward:
            graph, out = self._forward[bucket]
            graph.replay()
            return out
        self._upload()
        with torch.inference_mode():
            return self._forward_fn(bucket)

    def tail(self, bucket: Bucket, x: torch.Tensor, variant: Hashable) -> torch.Tensor:
        """Run ``tail`` over ``forward``'s output ``x``: a replay when captured, else eagerly."""
        if (bucket, variant) in self._tails:
            graph, out = self._tails[bucket, variant]
            graph.replay()
            return out
        with torch.inference_mode():
            return self._tail_fn(bucket, x, variant)

    @torch.inference_mode()
    def capture(self, buckets: list[Bucket], prepare: Callable[[Bucket], None],
                progress: bool = True) -> CaptureReport:
        """Warm up and capture ``buckets``, largest first, into one pool. ``prepare(bucket)``
        refills the host buffers with a step that touches no state (padding only)."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device; the runner runs eagerly without one")
        # No garbage collection while capturing: a collected CUDA graph (another engine's, freed
        # only by the collector) would be reset mid-capture, which invalidates the capture.
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            return self._capture(largest_first(buckets), prepare, progress)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _capture(self, buckets: list[Bucket], prepare, progress: bool) -> CaptureReport:
        # the pool's size is what capture reserves: cached blocks freed by others must not count
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        # Warm-up on a side stream, as torch recommends before capture: every kernel compiles and
        # every stream gets its cuBLAS handle.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in tqdm(buckets, desc="warm-up", disable=not progress):
                prepare(bucket)
                self._upload()
                x = self._forward_fn(bucket)
                for variant in self.variants:
                    self._tail_fn(bucket, x, variant)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for bucket in tqdm(buckets, desc="capture", disable=not progress):
            prepare(bucket)
            self._upload()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._upload()  # one API call less per step, and no gap before the graph
                x = self._forward_fn(bucket)
            self._forward[bucket] = (graph, x)
            for variant in self.variants:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    out = self._tail_fn(bucket, x, variant)
                self._tails[bucket, variant] = (graph, out)
        torch.cuda.synchronize()
        used = torch.cuda.memory_reserved(self.device) - before
        return CaptureReport(self.graphs, time.perf_counter() - start, used)
