"""Run step plans: refill the step buffers, then run the model and sampling per bucket.

The stages handed to the graph runner (``graphs.GraphRunner``) are the model's forward over the
step buffers' views for a bucket, and a draw of one token per logit row in a sampling mode. A
step picks the smallest bucket that holds its plan (an exact-size one above every bucket, run
eagerly), writes the plan into the host arena, runs the forward (on a captured bucket, one graph
launch whose first node is the arena's copy), runs the draw, and copies the drawn tokens to
pinned host memory asynchronously. Without CUDA everything runs eagerly over the same padded
buffers.

Drawn tokens also land in ``slot_tokens`` on the device, indexed by slot: a decode row whose plan
token is -1 reads its input from there, so consecutive steps need no host round trip.

The draw's variants are (sampling mode, processed, logprobs): ``processed`` copies the
processors' inputs, updates what each slot has seen (``SlotTokensSeen``) and applies the
penalties and biases before the draw; ``logprobs`` writes each row's log-probabilities into
fixed device buffers, copied to pinned memory beside the tokens. A step that needs neither runs
the draw alone, as before.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import torch

from ..graphs import Bucket, BucketSet, CaptureReport, GraphRunner
from ..kernels.logits_processors import MAX_LOGPROBS, logprobs
from ..kernels.sample import MODES, sample, sampling_mode
from .model import Model
from .plan import StepPlan
from .slot_tokens_seen import SlotTokensSeen
from .state_pool import StatePool
from .step_buffers import StepBuffers

__all__ = ["PendingTokens", "StepRunner", "on_device"]


class PendingTokens:
    """The tokens of a launched step, on their way to pinned host memory; ``bucket``: the
    static shape the step ran in."""

    def __init__(self, host: np.ndarray, event: torch.cuda.Event | None, bucket: Bucket,
                 logprobs: tuple[np.ndarray, ...] | None = None):
        self._host, self._event, self.bucket, self._logprobs = host, event, bucket, logprobs

    def get(self) -> np.ndarray:
        """Wait for the step, then its drawn tokens [n_rows] (a copy)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.copy()

    def logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """After ``get``: copies of (drawn [n_rows], top values [n_rows, K], top ids [n_rows, K])
        when the step computed log-probabilities, else None."""
        return None if self._logprobs is None else tuple(a.copy() for a in self._logprobs)


class StepRunner:
    def __init__(self, model: Model, pool: StatePool, buckets: BucketSet, *, max_decode: int | None = None,
                 max_prefill_tokens: int | None = None, overlap: bool = True, keep_hidden: bool = False,
                 greedy_only: bool = False):
        """buckets: the graph buckets; max_decode / max_prefill_tokens: the largest step, run
        eagerly above the buckets (default: the largest bucket); overlap: fork the prefill
        branch onto an auxiliary stream; keep_hidden: every step leaves its packed rows' final
        hidden states in ``hidden`` (for an MTP drafter, ``runtime.mtp``), else it is None;
        greedy_only: the draw's one variant captured is greedy, without processors or logprobs
        (a drafter's runner; other variants would run eagerly)."""
        self.model, self.pool, self.buckets = model, pool, buckets
        self.cuda = model.device.type == "cuda"
        if buckets.drafts > pool.drafts and model.cfg.has("mamba"):
            raise ValueError(f"verify buckets of {buckets.drafts} drafts need a state pool that records as many a "
                             f"slot for the Mamba2 layers to replay (StatePool(drafts={buckets.drafts})); it has "
                             f"{pool.drafts}")
        self.buffers = StepBuffers(
            max_decode=max(max_decode or 0, buckets.max_decode),
            max_prefill_tokens=max(max_prefill_tokens or 0, buckets.max_prefill_tokens),
            max_prefill_seqs=buckets.max_prefill_seqs,
            chunk_size=model.cfg.chunk_size if model.cfg.has("mamba") else 64,
            device=model.device,
            max_drafts=buckets.drafts,
            record_stride=pool.drafts,
        )
        # High priority: when both branches queue kernels, the prefill branch's (short grids, on
        # the critical path) take SMs first and the decode branch fills around them.
        self.aux_stream = torch.cuda.Stream(model.device, priority=-1) if (overlap and self.cuda) else None
        # A MoE layer's shared expert, beside the routed experts, is off the critical path: at the
        # step's own priority, so the routed grids are not kept waiting for SMs (Nemotron-3-Nano
        # at 4 and 8 rows 2% faster than on the auxiliary stream; 1, 2, 32 and 64 rows tie).
        self.side_stream = torch.cuda.Stream(model.device, priority=0) if (overlap and self.cuda) else None
        # the token drawn for each slot, the next decode input; the extra last entry takes the
        # tokens of rows that keep none
        self.slot_tokens = torch.zeros(pool.num_slots + 1, dtype=torch.int64, device=model.device)
        self.seen = SlotTokensSeen(pool.num_slots, model.cfg.vocab_size, model.device)
        rows = self.buffers.rows(Bucket(self.buffers.max_decode, self.buffers.max_prefill_tokens, buckets.drafts))
        k = min(MAX_LOGPROBS, model.cfg.vocab_size)
        # where the logprobs variants write: drawn, top values, top ids (a row each)
        self.logprobs = (torch.zeros(rows, dtype=torch.float32, device=model.device),
                         torch.zeros(rows, k, dtype=torch.float32, device=model.device),
                         torch.zeros(rows, k, dtype=torch.int64, device=model.device))
        # [prefill tokens | decode rows] of the last step, packed as its bucket packs them
        self.hidden = torch.zeros(self.buffers.max_prefill_tokens + self.buffers.max_decode, model.cfg.hidden_size,
                                  dtype=model.dtype, device=model.device) if keep_hidden else None
        # The stages close over the step's parts, not over the runner: a runner that held its graph
        # runner through its own bound methods would be a reference cycle, freed only by the
        # garbage collector, whose run inside another engine's capture breaks that capture.
        forward = functools.partial(_run_model, model, self.buffers, pool, self.aux_stream, self.side_stream,
                                    self.slot_tokens, self.hidden)
        draw = functools.partial(_draw, self.buffers, self.slot_tokens, self.seen, self.logprobs)
        variants = (("greedy", False, False),) if greedy_only else tuple(itertools.product(MODES, (False, True),
                                                                                           (False, True)))
        self.graphs = GraphRunner(forward, draw, variants, self.buffers.upload, model.device)
        # two host buffers (and their events), so a pipelined step's copy never overwrites
        # tokens not yet read
        self._host_tokens = [torch.zeros(rows, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self._host_logprobs = [tuple(torch.zeros(t.shape, dtype=t.dtype, pin_memory=self.cuda) for t in self.logprobs)
                               for _ in range(2)]
        self._token_events = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self._flip = 0

    def bucket_for(self, plan: StepPlan) -> Bucket:
        """The graph bucket for ``plan``, or an exact-size bucket when none holds it."""
        return (self.buckets.choose(plan.num_decode, plan.num_prefill_tokens, plan.num_prefill, plan.num_drafts)
                or Bucket(plan.num_decode, plan.num_prefill_tokens, plan.num_drafts))

    def capture(self, buckets: list[Bucket] | None = None, progress: bool = True) -> CaptureReport:
        """Capture ``buckets`` (default: all), largest first: a forward graph each and a
        sampling graph per mode. Padding-only plans warm them up, touching no slot."""
        empty = StepPlan()
        return self.graphs.capture(buckets or self.buckets.all(), lambda b: self.buffers.fill(empty, b), progress)

    def fork(self, src: int, dsts: list[int], tokens: int) -> None:
        """Copy slot ``src``'s state (its first ``tokens`` positions) and what it has seen into
        slots ``dsts``, on the device after every step launched so far and before the next: a
        few kernels, outside the graphs, when a prompt of several choices has been prefilled."""
        self.copy_state(src, dsts, tokens)
        with torch.inference_mode():
            self.seen.copy(src, dsts)

    def admit(self, slot: int, bias, prompt) -> None:
        """Start what ``slot`` has seen for a request whose prompt did not start in a step (a
        prefix cache restored its beginning): its bias entries (ids, values, until: numpy
        [MAX_BIASED] each) and its prompt's tokens so far marked; between steps, no sync."""
        device = self.model.device
        ids, values, until = (on_device(a, dtype, device)[None] for a, dtype in
                              zip(bias, (torch.int32, torch.float32, torch.int32)))
        tokens = on_device(prompt, torch.int64, device)
        with torch.inference_mode():
            self.seen.admit(on_device([slot], torch.int32, device), ids, values, until)
            self.seen.see_prompt(torch.full_like(tokens, slot), tokens)

    def copy_state(self, src: int, dsts: list[int], tokens: int, recurrent: bool = True) -> None:
        """Copy slot ``src``'s state (its first ``tokens`` positions; keys and values only where
        not ``recurrent``) into slots ``dsts``, on the device after every step launched so far
        and before the next (a prefix cache's snapshot and restore, a fork)."""
        with torch.inference_mode():
            self.pool.copy_slot(src, dsts, tokens, recurrent)

    def refill(self, plan: StepPlan, bucket: Bucket) -> None:
        """The step buffers refilled for ``plan`` in ``bucket``, its slots checked against the
        pool first (``StepPlan.check_slots``)."""
        plan.check_slots(self.pool.num_slots)
        self.buffers.fill(plan, bucket)

    def logits(self, plan: StepPlan, bucket: Bucket | None = None) -> torch.Tensor:
        """Run the plan's forward without drawing: logits [n_rows, vocab] fp32 for its rows (the
        last tokens of each prefill sequence, then each decode row); ``bucket`` overrides the
        choice. The tensor is the forward's output buffer, which the next step overwrites: copy
        what you keep."""
        bucket = bucket or self.bucket_for(plan)
        self.refill(plan, bucket)
        return self.graphs.forward(bucket)[: plan.num_rows]

    def launch(self, plan: StepPlan) -> PendingTokens:
        """Run the step and draw a token per row; returns without waiting for the device."""
        bucket = self.bucket_for(plan)
        self.refill(plan, bucket)
        logits = self.graphs.forward(bucket)
        mode = sampling_mode(plan.temperature, plan.top_k, plan.top_p, self.model.cfg.vocab_size) \
            if plan.sampled else "greedy"
        tokens = self.graphs.tail(bucket, logits, (mode, plan.processed, plan.logprobs))
        n = plan.num_rows
        host = self._host_tokens[self._flip][:n]
        host.copy_(tokens[:n], non_blocking=self.cuda)
        host_logprobs = None
        if plan.logprobs:
            host_logprobs = tuple(h[:n] for h in self._host_logprobs[self._flip])
            for h, d in zip(host_logprobs, self.logprobs):
                h.copy_(d[:n], non_blocking=self.cuda)
            host_logprobs = tuple(h.numpy() for h in host_logprobs)
        event = None
        if self.cuda:
            event = self._token_events[self._flip]
            event.record()
        self._flip ^= 1
        return PendingTokens(host.numpy(), event, bucket, host_logprobs)


def on_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host array on ``device``, copied from pinned memory without a sync."""
    t = torch.as_tensor(np.asarray(values), dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _run_model(model: Model, buffers: StepBuffers, pool: StatePool, aux_stream, side_stream,
               slot_tokens: torch.Tensor, hidden: torch.Tensor | None, bucket: Bucket) -> torch.Tensor:
    """The model over the buffers' views for ``bucket``: logits [rows, vocab] fp32."""
    return model.forward(buffers.inputs(bucket), pool, aux_stream, drawn=slot_tokens, side_stream=side_stream,
                         hidden=hidden)


def _draw(buffers: StepBuffers, slot_tokens: torch.Tensor, seen: SlotTokensSeen, logprob_out: tuple,
          bucket: Bucket, logits: torch.Tensor, variant: tuple[str, bool, bool]) -> torch.Tensor:
    """Sample every logit row of ``bucket`` and store kept tokens in ``slot_tokens`` (its last
    entry takes the tokens of rows that feed no slot). ``variant``: (mode, processed, logprobs)
    as the module doc says; processed rows' logits are changed in place."""
    mode, processed, with_logprobs = variant
    temperature, top_k, top_p, seed, position, sample_slots = buffers.sampling(bucket)
    if processed:
        buffers.upload_processors()
        p = buffers.processor_inputs(bucket)
        seen.admit(p["admit_slots"], p["bias_ids"], p["bias_values"], p["bias_until"])
        inputs = buffers.inputs(bucket)
        if inputs.prefill is not None:
            meta = inputs.prefill
            token_slots = torch.where(meta.seq_idx >= 0, meta.slot_idx[meta.seq_idx.clamp(min=0).long()], -1)
            seen.see_prompt(token_slots, inputs.input_ids[: meta.max_tokens])
        seen.apply(logits, p["processor_slots"], p["presence"], p["frequency"], p["repetition"], position)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    sample(logits, temperature, top_k, top_p, seed, position, mode=mode, out=tokens)
    if processed:
        seen.count(sample_slots, tokens)
    if with_logprobs:
        n = logits.shape[0]
        logprobs(logits, temperature, top_k, tokens, tuple(t[:n] for t in logprob_out))
    trash = slot_tokens.shape[0] - 1
    where = torch.where(sample_slots >= 0, sample_slots, trash).long()
    slot_tokens.index_copy_(0, where, tokens)
    return tokens
