"""The Mamba2 mixer over packed ``[prefill | decode]`` tokens.

One in_proj GEMM over all tokens, then two branches that touch disjoint rows and disjoint slots:
prefill rows go through the varlen conv and the chunked SSD scan, decode rows through the conv
update and the selective state update. Both write into one output buffer, then the gated norm
(Falcon-H1: the gate alone, ``y * silu(z)``) and out_proj run over all tokens again. Fused, a small
decode step is three kernels: block norm + in_proj + conv update; state update; gated norm +
out_proj + residual add (without the norm: the gate in the state update's epilogue, then out_proj;
a one-group norm before a streamed out_proj: the gate there too, the norm in out_proj's stream).

A verify step's prefill rows (``runtime.replay``) are scanned, token by token where they are few,
after each sequence's drafts kept by the verify step before, replayed from the layer's record.
"""

from __future__ import annotations

import torch

from ...kernels.activation import gate_silu
from ...kernels.conv1d import conv1d_update, conv1d_varlen
from ...kernels.decode_linear import ConvTail, gated_norm_linear, norm_linear, streams
from ...kernels.fp8 import Fp8Rows
from ...kernels.linear import linear, takes_rows
from ...kernels.norm import gated_rms_norm
from ...kernels.replay import gather_rows, replay_conv, take_rows
from ...kernels.ssd import ssd_scan
from ...kernels.ssd_short import SHORT_TOKENS, ssd_short_scan
from ...kernels.state_update import selective_state_update
from ..config import ModelConfig
from .base import Mixer, Norm, StepContext, norm_args

__all__ = ["Mamba2Mixer"]

# a short verify step's layout, conv, conv states and record in one launch (``replay_conv``);
# False: the gather, the conv's two launches and the take, as longer steps run
FUSED_VERIFY = True
# where out_proj's FP8 product would quantize the gated norm's rows, the norm writes them so
GATED_ROWS = True
# without a gated norm (Falcon-H1), a fused decode step's gate y * silu(z) rides in the state
# update's epilogue; False: a kernel of its own after it (``gate_silu``). Falcon-H1-7B's one-row
# step 0.2% faster (H100, docs/experiments.md)
GATE_IN_UPDATE = True
# a one-group gated norm before a streamed out_proj (Granite-4.0-H, Bamba): the gate in the state
# update's epilogue and the norm in out_proj's stream, as a block norm is (its squares summed
# along the K loop, the rstd applied to the sums); False: the gated norm a kernel of its own.
# Granite-4.0-H-micro's one-row step 0.5% faster (H100)
NORM_IN_STREAM = True


class Mamba2Mixer(Mixer):
    fuses_decode = True
    norm_reader = "in_proj"
    # Forked, the decode branch waits until the scan's chunk states are passed: its state update
    # streams the decode rows' whole state, and beside the scan's first, short, latency-bound
    # kernels it slows them down; beside the chunk scan it costs less.
    staggered = True

    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, torch.Tensor]):
        p = f"layers.{idx}.mixer."
        self.idx = idx
        self.H, self.P, self.N, self.G = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
        self.inner, self.conv_dim = cfg.mamba_inner, cfg.conv_dim
        self.eps, self.dt_limit = cfg.norm_eps, cfg.dt_limit
        self.in_proj = w[p + "in_proj.weight"]
        self.in_proj_bias = w.get(p + "in_proj.bias")
        self.conv_w = w[p + "conv1d.weight"].squeeze(1)  # [conv_dim, K]
        self.conv_b = w.get(p + "conv1d.bias")
        self.A = -torch.exp(w[p + "A_log"].float())
        self.D = w[p + "D"]
        self.dt_bias = w[p + "dt_bias"]
        self.norm_w = w[p + "norm.weight"] if cfg.mamba_gated_norm else None
        self.out_proj = w[p + "out_proj.weight"]
        self.out_proj_bias = w.get(p + "out_proj.bias")

    # in_proj's columns: z [inner] | xBC [conv_dim] | dt [H]
    def _z(self, proj):
        return proj[:, : self.inner]

    def _xbc(self, proj):
        return proj[:, self.inner : self.inner + self.conv_dim]

    def _dt(self, proj):
        return proj[:, self.inner + self.conv_dim :]

    def _ssm_operands(self, xbc: torch.Tensor):
        """x [T, H, P], B and C [T, G, N]: views of the conv's output columns."""
        T, GN = xbc.shape[0], self.G * self.N
        x = xbc[:, : self.inner].view(T, self.H, self.P)
        B = xbc[:, self.inner : self.inner + GN].view(T, self.G, self.N)
        C = xbc[:, self.inner + GN :].view(T, self.G, self.N)
        return x, B, C

    def takes_rows(self, tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        return takes_rows(tokens, dtype, device, self.in_proj)

    def project(self, h: torch.Tensor, ctx: StepContext, rows=None):
        """in_proj over all tokens, and the empty buffers both branches write into."""
        return self.buffers(linear(h, self.in_proj, self.in_proj_bias, rows))  # proj [T, inner + conv_dim + H]

    def buffers(self, proj: torch.Tensor):
        """The work of in_proj's output ``proj``: it, and the empty buffers both branches write into."""
        T = proj.shape[0]
        xbc = torch.empty(T, self.conv_dim, dtype=proj.dtype, device=proj.device)
        y = torch.empty(T, self.H, self.P, dtype=proj.dtype, device=proj.device)
        return proj, xbc, y

    def prefill(self, work, ctx: StepContext, passed=None) -> None:
        """``passed``: an event the scan records once its chunk states are passed."""
        proj, xbc, y = work
        tp, replay = ctx.inputs.num_prefill_tokens, ctx.inputs.replay
        if replay is not None:
            return self._verify(proj, y[:tp], ctx, passed)
        conv_state, ssm_state = ctx.pool.conv[self.idx], ctx.pool.ssm[self.idx]
        conv1d_varlen(self._xbc(proj[:tp]), self.conv_w, self.conv_b, conv_state, ctx.inputs.prefill, out=xbc[:tp])
        x, B, C = self._ssm_operands(xbc[:tp])
        ssd_scan(x, self._dt(proj[:tp]), self.A, B, C, self.D, ssm_state, ctx.inputs.prefill, dt_bias=self.dt_bias,
                 dt_softplus=True, dt_limit=self.dt_limit, out=y[:tp], passed=passed)

    def _verify(self, proj: torch.Tensor, y: torch.Tensor, ctx: StepContext, passed=None) -> None:
        """A verify step's prefill rows (``runtime.replay``): the conv and the scan over the
        layout of each sequence's replayed rows (from the record) and its own; then the own
        rows' outputs taken back, and the sequences' drafts' rows kept in the record for the
        next verify step. Short steps in two launches (``replay_conv``, then the scan writing
        the own rows' outputs in place), longer ones in the gather, the prefill's conv and
        scan, and the take."""
        replay, record = ctx.inputs.replay, ctx.pool.record[self.idx]
        tp = y.shape[0]
        conv_state, ssm_state = ctx.pool.conv[self.idx], ctx.pool.ssm[self.idx]
        scan_args = dict(dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit, passed=passed)
        if FUSED_VERIFY and tp <= SHORT_TOKENS:
            rows = replay_conv(proj[:tp, self.inner :], record, replay.src, replay.record, replay.own, self.conv_w,
                               self.conv_b, conv_state, replay.meta, y.view(tp, self.inner))
            x, B, C = self._ssm_operands(rows[:, : self.conv_dim])
            ssd_short_scan(x, rows[:, self.conv_dim :], self.A, B, C, self.D, ssm_state, replay.meta, out=y,
                           out_rows=replay.src, **scan_args)
            return
        rows = gather_rows(proj[:tp, self.inner :], record, replay.src)  # [layout rows, conv_dim + H]
        xbc = conv1d_varlen(rows[:, : self.conv_dim], self.conv_w, self.conv_b, conv_state, replay.meta)
        x, B, C = self._ssm_operands(xbc)
        scan = ssd_short_scan if tp <= SHORT_TOKENS else ssd_scan
        out = scan(x, rows[:, self.conv_dim :], self.A, B, C, self.D, ssm_state, replay.meta, **scan_args)
        take_rows(out.view(-1, self.inner), replay.own, y.view(tp, self.inner), proj[:tp, self.inner :], replay.record,
                  record)

    def decode(self, work, ctx: StepContext) -> None:
        proj, xbc, y = work
        tp = ctx.inputs.num_prefill_tokens
        rows = slice(tp, tp + ctx.inputs.num_decode)
        slots = ctx.inputs.decode_slots
        conv1d_update(self._xbc(proj[rows]), ctx.pool.conv[self.idx], self.conv_w, self.conv_b, slots, out=xbc[rows])
        x, B, C = self._ssm_operands(xbc[rows])
        selective_state_update(ctx.pool.ssm[self.idx], x, self._dt(proj[rows]), self.A, B, C, self.D, slots,
                               dt_bias=self.dt_bias, dt_softplus=True, out=y[rows])

    def finish(self, work) -> torch.Tensor:
        """Gated norm with z (or the gate alone), then out_proj, over all tokens."""
        proj, _, y = work
        y = y.view(y.shape[0], self.inner)
        rows = None
        if GATED_ROWS and self.norm_w is not None and takes_rows(y.shape[0], y.dtype, y.device, self.out_proj):
            rows = Fp8Rows.empty(y.shape[0], self.inner, y.device)  # out_proj's rows, made by the norm
        return linear(self.gate(y, proj, rows=rows), self.out_proj, self.out_proj_bias, rows)

    def gate(self, y: torch.Tensor, proj: torch.Tensor, *, out: torch.Tensor | None = None, pdl: bool = False,
             rows: Fp8Rows | None = None) -> torch.Tensor:
        """out_proj's input from the scan's y [T, inner]: the gated norm with in_proj's z, or the
        gate alone (``y * silu(z)``), into ``out`` (row-strided views allowed) or a new tensor.
        rows: the gated norm's output quantized per row too (``gated_rms_norm``'s)."""
        if self.norm_w is None:
            return gate_silu(y, self._z(proj), out=out, pdl=pdl)
        return gated_rms_norm(y, self._z(proj), self.norm_w, self.inner // self.G, self.eps, out=out, pdl=pdl,
                              rows=rows)

    def fused_decode(self, residual: torch.Tensor, norm: Norm, ctx: StepContext) -> None:
        self.fused(residual, norm, ctx, residual=residual)

    def fused(self, x: torch.Tensor, norm: Norm | None, ctx: StepContext, *, residual: torch.Tensor | None = None,
              out: torch.Tensor | None = None, first_pdl: bool = True) -> torch.Tensor:
        """The fused decode of ``norm(x)`` (x as it is without a norm): added into ``residual``
        in place, or written to ``out``; returns what it wrote. ``first_pdl``: the first kernel
        is a programmatic dependent (not where it follows another stream's work)."""
        opts = ctx.options
        proj = norm_linear(x, weight=self.in_proj, bias=self.in_proj_bias, conv=self.conv_tail(ctx),
                           pdl=opts.pdl and first_pdl, tile_k=opts.tile_k, **norm_args(norm))
        tail = dict(bias=self.out_proj_bias, residual=residual, out=out, pdl=opts.pdl, tile_k=opts.tile_k)
        if self.norm_w is None:
            return norm_linear(self.gated_update(proj, ctx), None, 0.0, self.out_proj, early=residual is not None,
                               **tail)
        if NORM_IN_STREAM and self.G == 1 and streams(proj.shape[0], self.out_proj, opts.tile_k):
            # one group: the gated norm is the RMS norm of y * silu(z) over the whole row
            return norm_linear(self.state_update(proj, ctx, gate=True), self.norm_w, self.eps, self.out_proj,
                               early=residual is not None, **tail)
        y = self.state_update(proj, ctx)
        # z (from in_proj) and the residual (from the previous block) are two or more kernels back
        return gated_norm_linear(y, self._z(proj), self.norm_w, self.inner // self.G, self.eps, self.out_proj,
                                 early=True, **tail)

    def conv_tail(self, ctx: StepContext) -> ConvTail:
        """The conv update of the xBC columns as in_proj's epilogue in a fused decode step: its
        output's xBC columns come out already convolved, as ``decode`` writes them into xbc."""
        return ConvTail(ctx.pool.conv[self.idx], self.conv_w, self.conv_b, ctx.inputs.decode_slots, self.inner)

    def state_update(self, proj: torch.Tensor, ctx: StepContext, *, out: torch.Tensor | None = None,
                     gate: bool = False) -> torch.Tensor:
        """A fused decode step's state update from in_proj's output (its xBC columns convolved,
        ``conv_tail``): y [T, inner], a programmatic dependent where the options say; into ``out``
        (row-strided views allowed) or a new tensor. gate: y * silu(z) in its epilogue."""
        T = proj.shape[0]
        xs, B, C = self._ssm_operands(self._xbc(proj))
        y = torch.empty(T, self.inner, dtype=proj.dtype, device=proj.device) if out is None else out
        z = self._z(proj).view(T, self.H, self.P) if gate else None
        selective_state_update(ctx.pool.ssm[self.idx], xs, self._dt(proj), self.A, B, C, self.D,
                               ctx.inputs.decode_slots, z=z, dt_bias=self.dt_bias, dt_softplus=True,
                               out=y.view(T, self.H, self.P), pdl=ctx.options.pdl)
        return y

    def gated_update(self, proj: torch.Tensor, ctx: StepContext, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """out_proj's input for a fused decode step, from in_proj's output: the state update,
        then the gated norm or the gate alone (``gate``); without a gated norm the gate rides in
        the state update's epilogue (``GATE_IN_UPDATE``)."""
        if GATE_IN_UPDATE and self.norm_w is None:
            return self.state_update(proj, ctx, out=out, gate=True)
        return self.gate(self.state_update(proj, ctx), proj, out=out, pdl=ctx.options.pdl)
