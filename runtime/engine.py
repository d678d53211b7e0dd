"""The embeddable API: add requests, call ``step()``, read tokens.

    engine = Engine.from_preset("mamba2-130m", device="cuda")
    rid = engine.add_request([1, 2, 3], SamplingParams(temperature=0.8, max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.id, out.new_tokens, out.finished)

Setup, in order: the model (checkpoint or preset), the state pool (slots sized from a memory
budget), the runner with its step buffers, then warm-up and graph capture. ``step()`` asks the
scheduler for a plan, launches it (refill, one copy, graph replays, token copy to pinned memory)
and reads the drawn tokens for stop checks.

Pipelined mode launches step N+1 before reading step N's tokens, hiding the host's work behind
the device's. It costs one extra decode step for a request that stops: that step is already
launched when the stop is seen, and its token is dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..graphs import Bucket, BucketSet
from ..kernels.logits_processors import MAX_BIASED
from .decode_options import DecodeOptions
from .draft_model import ModelDrafter, draft_engine, load_draft_model
from .model import Model
from .mtp_drafter import MTPDrafter, MTPDrafting
from .prefix_cache import PrefixCache
from .request import Request, RequestOutput, SamplingParams, TokenLogprobs
from .scheduler import Scheduler
from .slot_tokens_seen import SlotTokensSeen
from .speculative import Speculative, accepted
from .state_pool import StatePool, free_device_bytes
from .step_runner import PendingTokens, StepRunner

__all__ = ["Engine", "SamplingParams", "RequestOutput", "StepShape"]


@dataclass(frozen=True)
class StepShape:
    """One launched step: its decode rows, prefill tokens and sequences, the most drafts a
    sequence carried, the bucket it ran in, and ``ms``: its time on the host, from scheduling it to
    its tokens in hand (None in a pipelined engine, whose steps' tokens are read while the next
    one runs)."""

    decode: int
    prefill_tokens: int
    prefill_seqs: int
    bucket: Bucket
    drafts: int = 0
    ms: float | None = None


class Engine:
    def __init__(
        self,
        model: Model,
        *,
        num_slots: int | None = None,
        max_context: int = 4096,
        buckets: BucketSet | str | Path | None = None,
        use_graphs: bool | None = None,
        overlap: bool = True,
        pipelined: bool = False,
        memory_fraction: float = 0.4,
        progress: bool = True,
        trace: bool = False,
        prefix_cache_slots: int = 0,
        prefix_cache_gib: float = 0.0,
        speculative: Speculative | None = None,
    ):
        """model: a loaded Model; num_slots: concurrent requests (default: what
        ``memory_fraction`` of free device memory holds, at most the largest decode bucket);
        max_context: prompt plus output tokens per request; buckets: a BucketSet or a tuned bucket
        file (``mambastep tune``); use_graphs: capture CUDA graphs (default: on CUDA);
        overlap: fork prefill onto a second stream in mixed steps; pipelined: see the module doc;
        trace: record every launched step's shape and bucket in ``self.trace``;
        prefix_cache_slots: snapshots a prefix cache keeps (``runtime.prefix_cache``; 0: none),
        each a slot of the pool beside the requests', at block boundaries of the SSD chunk size;
        or prefix_cache_gib: as many as that much device memory holds; speculative: draft and
        verify tokens (``runtime.speculative``; not pipelined), the buckets given verify graphs."""
        self.model, self.cfg = model, model.cfg
        cuda = model.device.type == "cuda"
        if isinstance(buckets, (str, Path)):
            buckets = BucketSet.load(buckets)
        self.buckets = buckets or BucketSet.default(cuda)
        if speculative is not None:
            if pipelined:
                raise ValueError("speculative: a speculating engine reads each step's tokens before it schedules "
                                 "the next; pipelined=True cannot be")
            if self.buckets.drafts < speculative.num_drafts:
                self.buckets = dataclasses.replace(self.buckets, drafts=speculative.num_drafts)
        self.speculative = speculative
        # verify sequences run, the drafts they carried, and how many of those were accepted
        self.speculative_stats = {"verified": 0, "drafts": 0, "accepted": 0}
        self.max_context = max_context
        if num_slots is None:
            num_slots = self.buckets.max_decode
            if cuda:
                free = free_device_bytes(model.device)
                # a slot is its state and what its request has seen (the logits processors' tables)
                per_slot = (StatePool.bytes_per_slot(self.cfg, max_context, model.dtype, drafts=self.buckets.drafts)
                            + SlotTokensSeen.bytes_per_slot(self.cfg.vocab_size))
                fit = int(free * memory_fraction // per_slot)
                num_slots = max(1, min(num_slots, fit))
        self.num_slots = num_slots  # the requests'; a prefix cache's snapshots take slots beyond them
        if not (isinstance(prefix_cache_slots, int) and prefix_cache_slots >= 0):
            raise ValueError(f"prefix_cache_slots: expected an int >= 0, got {prefix_cache_slots!r}")
        per_slot = StatePool.bytes_per_slot(self.cfg, max_context, model.dtype, drafts=self.buckets.drafts)
        if prefix_cache_gib:
            if prefix_cache_slots:
                raise ValueError("prefix_cache_slots and prefix_cache_gib: give one of them")
            prefix_cache_slots = int(prefix_cache_gib * 2**30 // per_slot)
            if prefix_cache_slots < 1:
                raise ValueError(f"prefix_cache_gib: {prefix_cache_gib} GiB holds no snapshot of "
                                 f"{per_slot / 2**30:.3f} GiB (a slot's state at max_context={max_context})")
        self.pool = StatePool(self.cfg, num_slots + prefix_cache_slots, max_context, dtype=model.dtype,
                              device=model.device, drafts=self.buckets.drafts)
        mtp = speculative is not None and speculative.mtp
        if mtp and model.mtp_weights is None:
            raise ValueError("speculative mtp: the model was loaded without its MTP layers; load it with mtp=True "
                             "(Model.from_pretrained(path, mtp=True))")
        self.runner = StepRunner(model, self.pool, self.buckets, max_decode=num_slots, overlap=overlap,
                                 keep_hidden=mtp)
        self.prefix_cache = None
        if prefix_cache_slots:  # blocks of the SSD chunk the step buffers cut prompts into
            self.prefix_cache = PrefixCache(list(range(num_slots, num_slots + prefix_cache_slots)),
                                            self.runner.buffers.chunk_size, slot_bytes=per_slot)
        self.scheduler = Scheduler(num_slots, self.buckets.max_prefill_tokens, self.buckets.max_prefill_seqs,
                                   self.runner.buffers.max_decode, self.prefix_cache, speculative, max_context)
        self.pipelined = pipelined
        self.capture_report = None
        graphs = use_graphs if use_graphs is not None else cuda
        if graphs:
            self.capture_report = self.runner.capture(progress=progress)
        # each speculating request's new drafter: from the draft model's engine, or the given kind
        self.draft_engine = None
        self._new_drafter = speculative.drafter if speculative is not None else None
        if speculative is not None and speculative.draft_model is not None:
            draft = load_draft_model(speculative.draft_model, dtype=model.dtype, device=model.device,
                                     seed=speculative.draft_seed)
            self.draft_engine = draft_engine(draft, self.cfg.vocab_size, max_context, use_graphs=use_graphs)
            self._new_drafter = functools.partial(ModelDrafter, self.draft_engine, self.cfg.vocab_size)
        self.mtp = None
        if mtp:
            self.mtp = MTPDrafting(model, self.runner, num_slots, max_context, speculative.num_drafts,
                                   speculative.max_batch, snapshot_slots=prefix_cache_slots, graphs=graphs)
            self._new_drafter = functools.partial(MTPDrafter, self.mtp)
        self._ids = itertools.count()
        self._seeds = itertools.count(1 << 32)
        self.requests: dict[int, Request] = {}
        self._in_flight: tuple[PendingTokens, list[Request | None]] | None = None
        # outputs of requests a generate() call stepped past, by request id, for the next step()
        self._held: dict[int, RequestOutput] = {}
        self.trace: list[StepShape] | None = [] if trace else None

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype=torch.bfloat16, device=None,
                        options: DecodeOptions | None = None, quantization: str | None = None, **kw) -> "Engine":
        """An engine over an HF checkpoint directory (config.json + safetensors); an FP8
        checkpoint runs as stored, ``quantization="fp8"`` quantizes a full-precision one at load."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(Model.from_pretrained(path, dtype=dtype, device=device, options=options,
                                         quantization=quantization, mtp=_drafts_with_mtp(kw)), **kw)

    @classmethod
    def from_preset(cls, name: str, *, dtype=torch.bfloat16, device=None, seed: int = 0,
                    options: DecodeOptions | None = None, quantization: str | None = None, **kw) -> "Engine":
        """An engine over a built-in model shape with random weights (``quantization`` as in
        ``from_pretrained``)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(Model.from_preset(name, dtype=dtype, device=device, seed=seed, options=options,
                                     quantization=quantization, mtp=_drafts_with_mtp(kw)), **kw)

    def add_request(self, prompt_ids, params: SamplingParams | None = None) -> int:
        """Queue a prompt; returns its request id. Raises ValueError (and changes nothing) for an
        empty prompt, ids outside the vocabulary, a prompt that leaves no room to generate within
        max_context, or params that are not SamplingParams."""
        req = self._request(prompt_ids, params)
        self.requests[req.id] = req
        self.scheduler.add(req)
        return req.id

    def add_choices(self, prompt_ids, params: SamplingParams | None = None, n: int = 1) -> list[int]:
        """Queue ``n`` requests over one prompt, prefilled once: all but its last token run as
        one prefix, whose state is then copied into each choice's slot. Choice i draws with seed
        ``params.seed + i`` (or the engine's next n seeds), so its tokens are those of the
        request alone with that seed. Returns their ids; raises ValueError as ``add_request``,
        or where the engine has fewer than ``n`` slots."""
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
            raise ValueError(f"n: expected an int >= 1, got {n!r}")
        if n > self.num_slots:
            raise ValueError(f"n: {n} choices run at once, in {n} slots; this engine has {self.num_slots}")
        first = self._request(prompt_ids, params)
        seed = first.seed
        if first.params.seed is None:
            for _ in range(n - 1):
                next(self._seeds)
        wrap = lambda s: (s + 2**63) % 2**64 - 2**63  # noqa: E731  (seed + i stays an int64)
        choices = [first] + [Request(next(self._ids), first.prompt, first.params, wrap(seed + i), bias=first.bias,
                                     drafter=self._drafter(first.params)) for i in range(1, n)]
        for r in choices:
            self.requests[r.id] = r
        if n == 1 or len(first.prompt) == 1:  # nothing to share
            for r in choices:
                self.scheduler.add(r)
        else:
            # (an MTP drafter takes in the prefix's positions too, for the choices' drafts)
            self.scheduler.add(Request(-1, first.prompt[:-1], first.params, seed, bias=first.bias, choices=choices,
                                       drafter=self._drafter(first.params) if self.mtp is not None else None))
        return [r.id for r in choices]

    def _request(self, prompt_ids, params) -> Request:
        """A checked request with an id and a seed, not queued."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        try:
            prompt = np.asarray(prompt_ids)
        except ValueError:  # numpy refuses ragged nesting
            raise ValueError("prompt_ids: expected a flat list of token ids, got a nested, ragged one") from None
        if prompt.ndim != 1:
            raise ValueError(f"prompt_ids: expected a flat list of token ids, got shape {list(prompt.shape)}")
        if prompt.size == 0:
            raise ValueError("prompt_ids: expected a non-empty list of token ids")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"prompt_ids: expected integer token ids, got {prompt.dtype}")
        bad = prompt[(prompt < 0) | (prompt >= self.cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"prompt_ids: {bad[:5].tolist()} outside the vocabulary [0, {self.cfg.vocab_size})")
        if prompt.size >= self.max_context:
            raise ValueError(f"prompt_ids: {prompt.size} tokens leave no room to generate within "
                             f"max_context={self.max_context} (prompt plus output tokens)")
        bias = self._bias_entries(params) if params.processed else None
        seed = params.seed if params.seed is not None else next(self._seeds)
        return Request(next(self._ids), prompt.astype(np.int64), params, seed, bias=bias,
                       drafter=self._drafter(params))

    def _drafter(self, params: SamplingParams):
        """A new drafter where the request speculates: the engine does, the request asks to (or
        leaves it to the engine's default), and it has no logits processors, whose counts a
        verify step's rows would need per draft."""
        spec = self.speculative
        if spec is None or params.processed or not (spec.default if params.speculative is None else params.speculative):
            return None
        return self._new_drafter()

    def _bias_entries(self, params: SamplingParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A request's bias entries (ids, values, until), ``MAX_BIASED`` each: its logit_bias,
        always, and -inf on its stop tokens while fewer than min_tokens are drawn."""
        entries = [(t, b, np.iinfo(np.int32).max) for t, b in params.logit_bias]
        if params.min_tokens:
            stops = set(params.stop_token_ids)
            if not params.ignore_eos and self.cfg.eos_token_id is not None:
                stops.add(self.cfg.eos_token_id)
            entries += [(t, -np.inf, params.min_tokens) for t in sorted(stops)]
        if len(entries) > MAX_BIASED:
            raise ValueError(f"logit_bias: {len(params.logit_bias)} biased tokens (with min_tokens' "
                             f"{len(entries) - len(params.logit_bias)} stop tokens) exceed {MAX_BIASED}")
        bad = [t for t, _, _ in entries if t >= self.cfg.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token ids {bad[:5]} outside the vocabulary [0, {self.cfg.vocab_size})")
        ids, values, until = (np.zeros(MAX_BIASED, dtype) for dtype in (np.int32, np.float32, np.int32))
        for i, (t, b, u) in enumerate(entries):
            ids[i], values[i], until[i] = t, b, u
        return ids, values, until

    def abort(self, request_id: int) -> None:
        """Drop a request wherever it is (queued, in prefill, decoding); its slot is freed, and
        no output of it comes out after this, held ones (``generate``) included."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request id {request_id} (never added, or already finished)")
        req.finish_reason = "abort"
        self._held.pop(request_id, None)
        self._retire(req)

    def has_unfinished(self) -> bool:
        """Whether a request is queued or running, or outputs wait for the next ``step()``."""
        return self.scheduler.has_work() or self._in_flight is not None or bool(self._held)

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the new token of each request that got one (in pipelined mode,
        those of the previous step) and which finished. Outputs that a ``generate`` call
        stepped past come first, one per request."""
        outputs = self._step()
        if self._held:
            held, self._held = self._held, {}
            for out in outputs:
                _hold(held, out)
            outputs = list(held.values())
        return outputs

    def generate(self, prompts, params: SamplingParams | None = None) -> list[list[int]]:
        """Generate for each prompt to completion; returns the output token ids in prompt order.

        It steps the whole engine: requests added before the call go on too, and their outputs
        are kept and returned by the next ``step()``; none is lost."""
        ids = [self.add_request(p, params) for p in prompts]
        outputs = {i: [] for i in ids}
        running = set(ids)
        while running:
            for out in self._step():
                if out.id not in outputs:
                    _hold(self._held, out)
                    continue
                outputs[out.id] += out.new_tokens
                if out.finished:
                    running.discard(out.id)
        return [outputs[i] for i in ids]

    def write_trace(self, path: str | Path) -> None:
        """The recorded steps as JSON lines: decode rows, prefill tokens and sequences, the
        bucket's decode rows and prefill tokens, and the step's milliseconds where known
        (``Engine(trace=True)``, ``StepShape``)."""
        if self.trace is None:
            raise ValueError("no trace: build the engine with trace=True")
        with open(path, "w") as f:
            for s in self.trace:
                line = {"decode": s.decode, "prefill_tokens": s.prefill_tokens, "prefill_seqs": s.prefill_seqs,
                        "bucket": [s.bucket.decode, s.bucket.prefill]}
                if s.ms is not None:
                    line["ms"] = round(s.ms, 3)
                f.write(json.dumps(line) + "\n")

    def _step(self) -> list[RequestOutput]:
        launched = None
        start = time.perf_counter()
        if self.scheduler.has_work():
            plan, rows = self.scheduler.schedule()
            for src, dsts, tokens in self.scheduler.forks:
                self.runner.fork(src, dsts, tokens)
                if self.mtp is not None:
                    by_slot = {r.slot: r for r in self.scheduler.running}
                    self.mtp.fork(src, dsts, tokens, [by_slot[s] for s in [src, *dsts] if s in by_slot])
            for snapshot, req, tokens in self.scheduler.restores:
                self.runner.copy_state(snapshot, [req.slot], tokens)
                if self.mtp is not None:
                    self.mtp.restore(snapshot, req, tokens)
                if req.params.processed:  # what its slot has seen: its bias, the prompt so far
                    self.runner.admit(req.slot, req.bias, req.prompt[:tokens])
            if plan.num_rows:
                launched = (self.runner.launch(plan), rows)
                if self.trace is not None:
                    self.trace.append(StepShape(plan.num_decode, plan.num_prefill_tokens, plan.num_prefill,
                                                launched[0].bucket, plan.num_drafts))
            # the step wrote the snapshots' conv and SSM states; their keys and values, after it
            for slot, snapshot, tokens in self.scheduler.snapshots:
                self.runner.copy_state(slot, [snapshot], tokens, recurrent=False)
        if not self.pipelined:
            if not launched:
                return []
            gate = self.scheduler.gate
            outcomes = [] if gate is not None else None  # each verify sequence's drafts offered and kept
            outputs = self._collect(launched, outcomes)
            if self.mtp is not None:  # the MTP takes in what the step made certain, and keeps snapshots
                by_slot = {r.slot: r for r in self.scheduler.running}
                self.mtp.follow(plan, launched[0].bucket, by_slot)
                for slot, snapshot, tokens in self.scheduler.snapshots:
                    self.mtp.snapshot(slot, snapshot, tokens, by_slot.get(slot))
            seconds = time.perf_counter() - start
            if gate is not None:
                self._time(plan, outcomes, seconds)
            if self.trace is not None:
                self.trace[-1] = dataclasses.replace(self.trace[-1], ms=seconds * 1e3)
            return outputs
        done, self._in_flight = self._in_flight, launched
        return self._collect(done) if done else []

    def _collect(self, launched, outcomes: list[tuple[int, int]] | None = None) -> list[RequestOutput]:
        """The step's outputs; ``outcomes``, where given, gets each verify sequence's drafts
        offered and kept."""
        pending, rows = launched
        tokens = pending.get().tolist()
        logprobs = pending.logprobs()
        outputs = []
        i = 0
        while i < len(rows):
            req = rows[i]
            if req is None or req.finished:  # a prompt chunk, or a pipelined step past a stop or an abort
                i += 1
                continue
            # a verify sequence's rows: its drafts are kept while each equals the draw before it
            verify, req.verify = req.verify, None
            drafts = verify or []
            n = 1 + self._accepted(drafts, tokens[i : i + 1 + len(drafts)])
            if outcomes is not None and verify is not None:
                outcomes.append((len(drafts), n - 1))
            if drafts:
                stats = self.speculative_stats
                stats["verified"], stats["drafts"], stats["accepted"] = (
                    stats["verified"] + 1, stats["drafts"] + len(drafts), stats["accepted"] + n - 1)
            out = RequestOutput(req.id, [], False)
            k = req.params.logprobs
            if k is not None:
                out.logprobs = []
            for j in range(i, i + n):
                req.output.append(tokens[j])
                out.new_tokens.append(tokens[j])
                if k is not None:
                    drawn, top_values, top_ids = logprobs
                    out.logprobs.append(TokenLogprobs(float(drawn[j]), list(zip(top_ids[j, :k].tolist(),
                                                                                top_values[j, :k].tolist()))))
                req.finish_reason = self._stop_reason(req, tokens[j])
                if req.finished:
                    break
            out.finished, out.finish_reason = req.finished, req.finish_reason
            if req.drafter is not None:  # (a speculating engine is not pipelined: the output is whole)
                req.drawn = len(req.output)  # the rows past the last token kept drew nothing kept
            outputs.append(out)
            if req.finished:
                self._retire(req)
            i += 1 + len(drafts)
        return outputs

    def _time(self, plan, outcomes: list[tuple[int, int]], seconds: float) -> None:
        """Tell the speculation gate what a step of decode rows alone, or of verify sequences
        alone, took (and each sequence's drafts offered and kept); steps with prompt chunks say
        nothing of either."""
        gate = self.scheduler.gate
        if plan.num_prefill == 0 and plan.num_decode:
            gate.decoded(plan.num_decode, seconds)
        elif plan.num_drafts and plan.num_decode == 0 and len(outcomes) == plan.num_prefill:
            gate.verified(len(outcomes), seconds, outcomes)

    def _accepted(self, drafts: list[int], drawn: list[int]) -> int:
        """How many of a verify sequence's drafts it keeps (``speculative.accepted``; a
        benchmark that sets the acceptance overrides this)."""
        return accepted(drafts, drawn)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token == self.cfg.eos_token_id):
            return "stop"
        # counted from the tokens collected, never from ``computed``, which a pipelined step in
        # flight has already advanced
        if len(req.output) >= p.max_tokens or len(req.prompt) + len(req.output) >= self.max_context:
            return "length"
        return None

    def _retire(self, req: Request) -> None:
        """Forget a finished request and free its slot. A step still in flight may write that
        slot, but the device runs steps in order, so a new owner's prefill comes after it."""
        self.scheduler.release(req)
        self.requests.pop(req.id, None)


def _drafts_with_mtp(kw: dict) -> bool:
    """Whether the engine's ``speculative`` argument asks for the MTP layers (then loaded too)."""
    spec = kw.get("speculative")
    return isinstance(spec, Speculative) and spec.mtp


def _hold(held: dict[int, RequestOutput], out: RequestOutput) -> None:
    """Add ``out`` to ``held``, merged into what its request already has there."""
    prev = held.get(out.id)
    if prev is None:
        held[out.id] = RequestOutput(out.id, list(out.new_tokens), out.finished, out.finish_reason,
                                     None if out.logprobs is None else list(out.logprobs))
    else:
        prev.new_tokens += out.new_tokens
        if out.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + out.logprobs
        prev.finished, prev.finish_reason = out.finished, out.finish_reason
