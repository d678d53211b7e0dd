"""Run step plans: refill the step buffers, then replay the bucket's CUDA graph (or run eagerly).

Setup, once: allocate the step buffers at the bucket maxima, warm every bucket up eagerly (Triton
compiles, cuBLAS creates its handles, on every stream), then capture the buckets largest first
into one shared memory pool. A step: pick the smallest bucket that holds the plan, write the plan
into the host arena, one host-to-device copy, ``graph.replay()``. A plan larger than every bucket
runs the same forward eagerly over exactly-sized views of the same buffers. Without CUDA the
runner is eager throughout, over the same padded buffers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..runtime.plan import StepPlan
from ..runtime.step_buffers import Bucket, StepBuffers
from .buckets import BucketSet

__all__ = ["Runner", "CaptureReport"]


@dataclass
class CaptureReport:
    graphs: int
    seconds: float
    pool_bytes: int

    def __str__(self) -> str:
        return f"captured {self.graphs} graphs in {self.seconds:.1f} s, graph pool {self.pool_bytes / 2**20:.0f} MiB"


class Runner:
    def __init__(self, model, pool, buckets: BucketSet | None = None, *, max_decode: int | None = None,
                 max_prefill_tokens: int | None = None, overlap: bool = True):
        """model: runtime.Model; pool: runtime.StatePool; buckets: graph buckets (defaults);
        max_decode / max_prefill_tokens: the largest step, eager above the buckets (defaults to
        the largest bucket); overlap: fork the prefill branch onto an auxiliary stream."""
        self.model, self.pool = model, pool
        self.buckets = buckets or BucketSet()
        self.cuda = model.device.type == "cuda"
        self.buffers = StepBuffers(
            max_decode=max(max_decode or 0, self.buckets.max_decode),
            max_prefill_tokens=max(max_prefill_tokens or 0, self.buckets.max_prefill_tokens),
            max_prefill_seqs=self.buckets.max_prefill_seqs,
            chunk_size=model.cfg.chunk_size if "mamba" in model.cfg.layer_types else 64,
            device=model.device,
        )
        self.aux_stream = torch.cuda.Stream(model.device) if (overlap and self.cuda) else None
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None

    def bucket_for(self, plan: StepPlan) -> Bucket:
        """The graph bucket for ``plan``, or an exact-size bucket when none holds it."""
        return self.buckets.choose(plan) or Bucket(plan.num_decode, plan.num_prefill_tokens)

    def forward(self, bucket: Bucket) -> torch.Tensor:
        """The step function over the buffers' views for ``bucket`` (what a graph captures)."""
        return self.model.forward(self.buffers.inputs(bucket), self.pool, self.aux_stream)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits [n_prefill + n_decode, vocab] for the plan's rows: the last token of each
        prefill sequence, then each decode row. The tensor is the graph's output buffer, which
        the next step overwrites: copy what you keep."""
        bucket = self.bucket_for(plan)
        self.buffers.fill(plan, bucket)
        self.buffers.upload()
        if bucket in self.graphs:
            graph, logits = self.graphs[bucket]
            graph.replay()
        else:
            logits = self.forward(bucket)
        return logits[: plan.num_prefill + plan.num_decode]

    @torch.inference_mode()
    def capture(self, buckets: list[Bucket] | None = None, progress: bool = True) -> CaptureReport:
        """Warm up and capture ``buckets`` (default: all), largest first, into one pool."""
        if not self.cuda:
            raise RuntimeError("CUDA graphs need a CUDA device; the runner runs eagerly without one")
        buckets = sorted(buckets or self.buckets.all(), key=lambda k: (k.decode + k.prefill, k.prefill), reverse=True)
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.model.device)
        self.graph_pool = self.graph_pool or torch.cuda.graph_pool_handle()
        empty = StepPlan()
        # Warm-up on a side stream, as torch recommends before capture: every kernel compiles and
        # every stream gets its cuBLAS handle. Padding-only plans touch no slot.
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in tqdm(buckets, desc="warm-up", disable=not progress):
                self.buffers.fill(empty, bucket)
                self.buffers.upload()
                self.forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for bucket in tqdm(buckets, desc="capture", disable=not progress):
            self.buffers.fill(empty, bucket)
            self.buffers.upload()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                logits = self.forward(bucket)
            self.graphs[bucket] = (graph, logits)
        torch.cuda.synchronize()
        used = torch.cuda.memory_reserved(self.model.device) - before
        return CaptureReport(len(buckets), time.perf_counter() - start, used)
