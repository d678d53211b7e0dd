"""Run step plans: refill the step buffers, then replay the bucket's CUDA graphs (or run eagerly).

Setup, once: allocate the step buffers at the bucket maxima, warm every bucket up eagerly (Triton
compiles, cuBLAS creates its handles, on every stream), then capture the buckets largest first
into one shared memory pool: per bucket, one forward graph and one small sampling graph per
sampling mode. A step: pick the smallest bucket that holds the plan, write the plan into the host
arena, replay the forward graph (whose first node is the step's one host-to-device copy of the
arena), replay the sampling graph, copy the drawn tokens to pinned host memory asynchronously. A
plan larger than every bucket runs the same functions eagerly over exactly-sized views of the
same buffers. Without CUDA the runner is eager throughout, over the same padded buffers.

Drawn tokens also land in ``slot_tokens`` on the device, indexed by slot: a decode row whose plan
token is -1 reads its input from there, so consecutive steps need no host round trip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from ..runtime.plan import StepPlan
from ..runtime.sampling import MODES, sample, sampling_mode
from ..runtime.step_buffers import Bucket, StepBuffers
from .buckets import BucketSet, largest_first

__all__ = ["Runner", "CaptureReport", "PendingTokens"]


@dataclass
class CaptureReport:
    graphs: int
    seconds: float
    pool_bytes: int

    def __str__(self) -> str:
        return f"captured {self.graphs} graphs in {self.seconds:.1f} s, graph pool {self.pool_bytes / 2**20:.0f} MiB"


class PendingTokens:
    """The tokens of a launched step, on their way to pinned host memory."""

    def __init__(self, host: np.ndarray, event: torch.cuda.Event | None):
        self._host, self._event = host, event

    def get(self) -> np.ndarray:
        """Wait for the step, then its drawn tokens [n_rows] (a copy)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.copy()


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
        # High priority: when both branches queue kernels, the prefill branch's (short grids, on
        # the critical path) take SMs first and the decode branch fills around them (measured in
        # docs/BENCHMARKS.md: the fork's gain at decode 64 + 512 prefill tokens rose from 3% to 8%).
        self.aux_stream = torch.cuda.Stream(model.device, priority=-1) if (overlap and self.cuda) else None
        # the token drawn for each slot, the next decode input; the extra last entry takes the
        # tokens of rows that keep none
        self.slot_tokens = torch.zeros(pool.num_slots + 1, dtype=torch.int64, device=model.device)
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.sample_graphs: dict[tuple[Bucket, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_pool = None
        rows = self.buffers.rows(Bucket(self.buffers.max_decode, self.buffers.max_prefill_tokens))
        pin = self.cuda
        # two host buffers (and their events), so a pipelined step's copy never overwrites
        # tokens not yet read
        self._host_tokens = [torch.zeros(rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._token_events = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self._flip = 0

    def bucket_for(self, plan: StepPlan) -> Bucket:
        """The graph bucket for ``plan``, or an exact-size bucket when none holds it."""
        return self.buckets.choose(plan) or Bucket(plan.num_decode, plan.num_prefill_tokens)

    def forward(self, bucket: Bucket) -> torch.Tensor:
        """The step's forward over the buffers' views for ``bucket`` (what a graph captures):
        logits [rows, vocab] fp32."""
        return self.model.forward(self.buffers.inputs(bucket), self.pool, self.aux_stream, drawn=self.slot_tokens)

    def draw(self, bucket: Bucket, logits: torch.Tensor, mode: str) -> torch.Tensor:
        """Sample every logit row of ``bucket`` and store kept tokens in ``slot_tokens``."""
        *params, sample_slots = self.buffers.sampling(bucket)
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        sample(logits, *params, mode=mode, out=tokens)
        trash = self.slot_tokens.shape[0] - 1
        where = torch.where(sample_slots >= 0, sample_slots, trash).long()
        self.slot_tokens.index_copy_(0, where, tokens)
        return tokens

    def run(self, plan: StepPlan, bucket: Bucket | None = None) -> torch.Tensor:
        """Logits [n_rows, vocab] for the plan's rows: the last token of each prefill sequence,
        then each decode row; ``bucket`` overrides the choice (tests, tuning). The tensor is the
        graph's output buffer, which the next step overwrites: copy what you keep."""
        bucket = self._refill(plan, bucket)
        return self._forward(bucket)[: plan.num_rows]

    def launch(self, plan: StepPlan) -> PendingTokens:
        """Run the step and draw a token per row; returns without waiting for the device."""
        bucket = self._refill(plan)
        logits = self._forward(bucket)
        mode = sampling_mode(plan.temperature, plan.top_k, plan.top_p, self.model.cfg.vocab_size) \
            if plan.sampled else "greedy"
        if (bucket, mode) in self.sample_graphs:
            graph, tokens = self.sample_graphs[bucket, mode]
            graph.replay()
        else:
            with torch.inference_mode():
                tokens = self.draw(bucket, logits, mode)
        host = self._host_tokens[self._flip][: plan.num_rows]
        host.copy_(tokens[: plan.num_rows], non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = self._token_events[self._flip]
            event.record()
        self._flip ^= 1
        return PendingTokens(host.numpy(), event)

    def _refill(self, plan: StepPlan, bucket: Bucket | None = None) -> Bucket:
        bucket = bucket or self.bucket_for(plan)
        self.buffers.fill(plan, bucket)
        if bucket not in self.graphs:  # a forward graph uploads the arena itself
            self.buffers.upload()
        return bucket

    def _forward(self, bucket: Bucket) -> torch.Tensor:
        # a replay needs no grad mode; only the eager path enters inference mode (~1 us a step)
        if bucket in self.graphs:
            graph, logits = self.graphs[bucket]
            graph.replay()
            return logits
        with torch.inference_mode():
            return self.forward(bucket)

    @torch.inference_mode()
    def capture(self, buckets: list[Bucket] | None = None, modes=MODES, progress: bool = True) -> CaptureReport:
        """Warm up and capture ``buckets`` (default: all), largest first, into one pool: a forward
        graph each and a sampling graph per mode."""
        if not self.cuda:
            raise RuntimeError("CUDA graphs need a CUDA device; the runner runs eagerly without one")
        buckets = largest_first(buckets or self.buckets.all())
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
                logits = self.forward(bucket)
                for mode in modes:
                    self.draw(bucket, logits, mode)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for bucket in tqdm(buckets, desc="capture", disable=not progress):
            self.buffers.fill(empty, bucket)
            self.buffers.upload()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                self.buffers.upload()  # one API call less per step, and no gap before the graph
                logits = self.forward(bucket)
            self.graphs[bucket] = (graph, logits)
            for mode in modes:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.graph_pool):
                    tokens = self.draw(bucket, logits, mode)
                self.sample_graphs[bucket, mode] = (graph, tokens)
        torch.cuda.synchronize()
        used = torch.cuda.memory_reserved(self.model.device) - before
        return CaptureReport(len(self.graphs) + len(self.sample_graphs), time.perf_counter() - start, used)
