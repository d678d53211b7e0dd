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

import itertools
from pathlib import Path

import numpy as np
import torch

from ..graphs import BucketSet
from .decode_options import DecodeOptions
from .model import Model
from .request import Request, RequestOutput, SamplingParams
from .scheduler import Scheduler
from .state_pool import StatePool
from .step_runner import PendingTokens, StepRunner

__all__ = ["Engine", "SamplingParams", "RequestOutput"]


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
    ):
        """model: a loaded Model; num_slots: concurrent requests (default: what
        ``memory_fraction`` of free device memory holds, at most the largest decode bucket);
        max_context: prompt plus output tokens per request; buckets: a BucketSet or a tuned bucket
        file (``mambastep tune``); use_graphs: capture CUDA graphs (default: on CUDA);
        overlap: fork prefill onto a second stream in mixed steps; pipelined: see the module doc."""
        self.model, self.cfg = model, model.cfg
        cuda = model.device.type == "cuda"
        if isinstance(buckets, (str, Path)):
            buckets = BucketSet.load(buckets)
        self.buckets = buckets or BucketSet.default(cuda)
        self.max_context = max_context
        if num_slots is None:
            num_slots = self.buckets.max_decode
            if cuda:
                free = torch.cuda.mem_get_info(model.device)[0]
                fit = StatePool.slots_for_budget(self.cfg, max_context, free * memory_fraction, model.dtype)
                num_slots = max(1, min(num_slots, fit))
        self.pool = StatePool(self.cfg, num_slots, max_context, dtype=model.dtype, device=model.device)
        self.runner = StepRunner(model, self.pool, self.buckets, max_decode=num_slots, overlap=overlap)
        self.scheduler = Scheduler(num_slots, self.buckets.max_prefill_tokens, self.buckets.max_prefill_seqs,
                                   self.runner.buffers.max_decode)
        self.pipelined = pipelined
        self.capture_report = None
        if use_graphs if use_graphs is not None else cuda:
            self.capture_report = self.runner.capture(progress=progress)
        self._ids = itertools.count()
        self._seeds = itertools.count(1 << 32)
        self.requests: dict[int, Request] = {}
        self._in_flight: tuple[PendingTokens, list[Request | None]] | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype=torch.bfloat16, device=None,
                        options: DecodeOptions | None = None, **kw) -> "Engine":
        """An engine over an HF checkpoint directory (config.json + safetensors)."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(Model.from_pretrained(path, dtype=dtype, device=device, options=options), **kw)

    @classmethod
    def from_preset(cls, name: str, *, dtype=torch.bfloat16, device=None, seed: int = 0,
                    options: DecodeOptions | None = None, **kw) -> "Engine":
        """An engine over a built-in model shape with random weights."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(Model.from_preset(name, dtype=dtype, device=device, seed=seed, options=options), **kw)

    def add_request(self, prompt_ids, params: SamplingParams | None = None) -> int:
        """Queue a prompt; returns its request id. Raises ValueError (and changes nothing) for an
        empty prompt, ids outside the vocabulary, a prompt that leaves no room to generate within
        max_context, or params that are not SamplingParams."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError("prompt_ids: expected a non-empty list of token ids")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"prompt_ids: expected integer token ids, got {prompt.dtype}")
        bad = prompt[(prompt < 0) | (prompt >= self.cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"prompt_ids: {bad[:5].tolist()} outside the vocabulary [0, {self.cfg.vocab_size})")
        if prompt.size >= self.max_context:
            raise ValueError(f"prompt_ids: {prompt.size} tokens leave no room to generate within "
                             f"max_context={self.max_context}")
        seed = params.seed if params.seed is not None else next(self._seeds)
        req = Request(next(self._ids), prompt.astype(np.int64), params, seed)
        self.requests[req.id] = req
        self.scheduler.add(req)
        return req.id

    def abort(self, request_id: int) -> None:
        """Drop a request wherever it is (queued, in prefill, decoding); its slot is freed."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request id {request_id}")
        req.finish_reason = "abort"
        self._retire(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the new token of each request that got one (in pipelined mode,
        those of the previous step) and which finished."""
        launched = None
        if self.scheduler.has_work():
            plan, rows = self.scheduler.schedule()
            if plan.num_rows:
                launched = (self.runner.launch(plan), rows)
        if not self.pipelined:
            return self._collect(launched) if launched else []
        done, self._in_flight = self._in_flight, launched
        return self._collect(done) if done else []

    def generate(self, prompts, params: SamplingParams | None = None) -> list[list[int]]:
        """Generate for each prompt to completion; returns the output token ids in prompt order."""
        ids = [self.add_request(p, params) for p in prompts]
        outputs = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                if out.id in outputs:
                    outputs[out.id] += out.new_tokens
        return [outputs[i] for i in ids]

    def _collect(self, launched) -> list[RequestOutput]:
        pending, rows = launched
        tokens = pending.get()
        outputs = []
        for req, token in zip(rows, tokens.tolist()):
            if req is None or req.finished:
                continue  # a prompt chunk, or a pipelined step past a stop or an abort
            req.output.append(token)
            req.finish_reason = self._stop_reason(req, token)
            outputs.append(RequestOutput(req.id, [token], req.finished, req.finish_reason))
            if req.finished:
                self._retire(req)
        return outputs

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token == self.cfg.eos_token_id):
            return "stop"
        # the next decode would write its token at position ``computed``
        if len(req.output) >= p.max_tokens or req.computed >= self.max_context:
            return "length"
        return None

    def _retire(self, req: Request) -> None:
        """Forget a finished request and free its slot. A step still in flight may write that
        slot, but the device runs steps in order, so a new owner's prefill comes after it."""
        self.scheduler.release(req)
        self.requests.pop(req.id, None)
