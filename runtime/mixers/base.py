"""The block contract: a model is embedding, blocks, final norm, LM head; a block is (norm, mixer)
and computes ``residual += mixer(norm(residual))``.

Ownership is one rule on both execution paths: the block's norm and the residual stream belong
to the model; a mixer maps a normed input to its output and owns its layer's state slots.

- Layer by layer (any step): the model computes ``h = norm(residual)``, the mixer returns
  ``mixer.forward(h, ctx, rows)``, and the model folds the residual add into the next block's
  norm. ``rows``: h quantized per row (``kernels.fp8.Fp8Rows``), which the norm writes beside h
  where the mixer's FP8 products would quantize it (``takes_rows``), else None.
- Fused (small decode-only steps, mixers with ``fuses_decode``): the model hands the mixer its
  block's norm and the residual stream, ``mixer.fused_decode(residual, norm, ctx)``; the mixer's
  first kernel applies that norm in its prologue and its last adds into the residual in its
  epilogue. Same math, fewer launches.

A mixer whose prefill and decode rows take different kernels (Mamba2, attention) defines four
pieces, and ``Mixer.forward`` runs them: ``project`` over all packed tokens, then the
``prefill`` branch (rows ``[0, Tp)``) and the ``decode`` branch (rows ``[Tp, Tp + B)``), forked
onto the auxiliary stream when the step has one and both kinds of row, then ``finish`` over all
tokens. A position-wise mixer (MLP, MoE) overrides ``forward`` with its math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...kernels.fp8 import Fp8Rows
from ...kernels.norm import rms_norm
from ..decode_options import DecodeOptions
from ..state_pool import StatePool
from ..step_inputs import StepInputs

__all__ = ["Block", "Mixer", "Norm", "StepContext", "norm_args", "run_branches"]


@dataclass(frozen=True)
class Norm:
    """A block's RMSNorm. ``round_first``: HF's Mamba2 (and Granite) rounds the normalised row before its weight,
    NemotronH only the product (only bf16 tells them apart). ``unit``: the weight is all ones, the
    checkpoint's folded into the projection after it (``Model``'s ``fold_norms``), so a fused
    kernel need not read it."""

    weight: torch.Tensor
    eps: float
    round_first: bool
    unit: bool = False

    def __call__(self, x: torch.Tensor, *, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, pdl: bool = False, rows: Fp8Rows | None = None) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, residual=residual, out=out, round_first=self.round_first, pdl=pdl,
                        rows=rows)


def norm_args(norm: Norm | None) -> dict:
    """``norm_linear``'s arguments for ``norm`` in the first projection's prologue of a fused
    decode chain; for None (the rows come normed: a parallel block's, a shared expert's) no norm."""
    if norm is None:
        return dict(norm_w=None, eps=0.0, round_first=True, unit_norm=False)
    return dict(norm_w=norm.weight, eps=norm.eps, round_first=norm.round_first, unit_norm=norm.unit)


@dataclass(frozen=True)
class StepContext:
    """What a mixer reads besides its input: the step's metadata (shared by every layer), the
    state pool, the auxiliary stream of a forked step (or None) and the model's decode options.
    ``observe``: None, or a callable that MoE layers hand ``(layer, expert ids)`` (benchmarks
    count the experts a step reads; an eager step only). ``side_stream``: where work beside a
    block's critical path runs (None: in turn): a MoE layer's shared expert beside its routed
    experts, a parallel block's attention beside its Mamba2 mixer. It has the step's own
    priority, where the auxiliary stream has a higher one."""

    inputs: StepInputs
    pool: StatePool
    aux_stream: torch.cuda.Stream | None
    options: DecodeOptions
    observe: Callable[[int, torch.Tensor], None] | None = None
    side_stream: torch.cuda.Stream | None = None


class Mixer:
    """A block's mixer (see the module doc). ``fuses_decode``: the mixer offers ``fused_decode``.
    ``staggered``: in a forked step the decode branch waits for an event the prefill branch
    records part-way (``prefill``'s ``passed``), rather than starting at the fork.
    ``norm_reader``: the attribute holding the one projection weight [N, D] that reads the block
    norm's output, or None where more than one op reads it (MoE: the router and both kinds of
    expert)."""

    fuses_decode = False
    staggered = False
    norm_reader: str | None = None

    def takes_rows(self, tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the mixer's products over a step of ``tokens`` normed rows of ``dtype`` on
        ``device`` would quantize them per row (FP8 tensor cores, dynamic scales), so that the
        norm writes them quantized beside (``forward``'s ``rows``)."""
        return False

    def forward(self, h: torch.Tensor, ctx: StepContext, rows: Fp8Rows | None = None) -> torch.Tensor:
        """The mixer over the step's packed tokens: h [T, D] normed input -> out [T, D]; rows: h
        quantized per row, where ``takes_rows``."""
        work = self.project(h, ctx, rows)
        self.run(work, ctx)
        return self.finish(work)

    def run(self, work, ctx: StepContext) -> None:
        """Both branches over ``project``'s work: forked onto the auxiliary stream where the step
        has one and both kinds of rows, else in turn."""
        tp, b = ctx.inputs.num_prefill_tokens, ctx.inputs.num_decode
        forked = ctx.aux_stream is not None and tp and b
        passed = torch.cuda.Event() if forked and self.staggered else None
        run_branches(
            (lambda: self.prefill(work, ctx, passed)) if tp else None,
            (lambda: self.decode(work, ctx)) if b else None,
            ctx.aux_stream, decode_after=passed,
        )

    def project(self, h: torch.Tensor, ctx: StepContext, rows: Fp8Rows | None = None):
        """The work both branches share (one GEMM over all tokens, and the buffers they write)."""
        raise NotImplementedError

    def prefill(self, work, ctx: StepContext, passed: torch.cuda.Event | None) -> None:
        raise NotImplementedError

    def decode(self, work, ctx: StepContext) -> None:
        raise NotImplementedError

    def finish(self, work) -> torch.Tensor:
        raise NotImplementedError

    def fused_decode(self, residual: torch.Tensor, norm: Norm, ctx: StepContext) -> None:
        """``residual += mixer(norm(residual))`` in place, for a small decode-only step."""
        raise NotImplementedError(f"{type(self).__name__} has no fused decode")

    def absorb_norm(self, weight: torch.Tensor) -> bool:
        """Fold the block norm's ``weight`` [D] into the ``norm_reader`` projection, ``W[:, k] *
        weight[k]`` in fp32 rounded once to W's dtype (a new tensor: the checkpoint's is left as
        it was); False, changing nothing, where the mixer has no one reader."""
        if self.norm_reader is None:
            return False
        w = getattr(self, self.norm_reader)
        if not isinstance(w, torch.Tensor):  # FP8: folding would quantize the weight again
            return False
        setattr(self, self.norm_reader, (w.float() * weight.float()).to(w.dtype))
        return True


@dataclass(frozen=True)
class Block:
    norm: Norm
    mixer: Mixer


def run_branches(prefill: Callable[[], None] | None, decode: Callable[[], None] | None,
                 aux_stream: torch.cuda.Stream | None, decode_after: torch.cuda.Event | None = None) -> None:
    """Call both branches; with an auxiliary stream and both present, fork and join around them.

    The prefill branch goes to ``aux_stream`` after it waits for everything queued so far on the
    current stream (the shared projection); the decode branch stays on the current stream, which
    then waits for the prefill branch. Inside CUDA-graph capture this becomes a fork and a join
    in the graph. Buffers made before the fork are freed only after the join, so the allocator
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
