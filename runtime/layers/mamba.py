"""The Mamba2 mixer over packed ``[prefill | decode]`` tokens.

One in_proj GEMM over all tokens, then two branches that touch disjoint rows and disjoint slots:
prefill rows go through the varlen conv and the chunked SSD scan, decode rows through the conv
update and the selective state update. Both write into one output buffer, then the gated norm
and out_proj run over all tokens again. The branches are separate methods so that a runner can
put them on different streams (``run_branches``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.conv1d import conv1d_update, conv1d_varlen
from ...kernels.decode_linear import ConvTail, gated_norm_linear, norm_linear
from ...kernels.norm import gated_rms_norm
from ...kernels.ssd import ssd_scan
from ...kernels.state_update import selective_state_update
from ..config import ModelConfig
from ..step_inputs import StepInputs
from .branches import run_branches

__all__ = ["MambaLayer"]


class MambaLayer:
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
        self.norm_w = w[p + "norm.weight"]
        self.out_proj = w[p + "out_proj.weight"]
        self.out_proj_bias = w.get(p + "out_proj.bias")

    def project(self, x: torch.Tensor):
        """in_proj over all tokens, and the empty buffers both branches write into."""
        proj = F.linear(x, self.in_proj, self.in_proj_bias)  # [T, inner + conv_dim + H]
        T = x.shape[0]
        xbc = torch.empty(T, self.conv_dim, dtype=x.dtype, device=x.device)
        y = torch.empty(T, self.H, self.P, dtype=x.dtype, device=x.device)
        return proj, xbc, y

    def _views(self, proj, xbc, rows: slice):
        z_dt = proj[rows]
        xbc_in = z_dt[:, self.inner : self.inner + self.conv_dim]
        dt = z_dt[:, self.inner + self.conv_dim :]
        out = xbc[rows]
        return xbc_in, dt, out

    def _ssm_operands(self, xbc_rows: torch.Tensor):
        T, GN = xbc_rows.shape[0], self.G * self.N
        x = xbc_rows[:, : self.inner].view(T, self.H, self.P)
        B = xbc_rows[:, self.inner : self.inner + GN].view(T, self.G, self.N)
        C = xbc_rows[:, self.inner + GN :].view(T, self.G, self.N)
        return x, B, C

    def prefill_branch(self, proj, xbc, y, inputs: StepInputs, conv_state, ssm_state, passed=None) -> None:
        """``passed``: an event to record once the scan's chunk states are passed (see forward)."""
        tp = inputs.num_prefill_tokens
        xbc_in, dt, xbc_out = self._views(proj, xbc, slice(0, tp))
        conv1d_varlen(xbc_in, self.conv_w, self.conv_b, conv_state, inputs.prefill, out=xbc_out)
        x, B, C = self._ssm_operands(xbc_out)
        ssd_scan(x, dt, self.A, B, C, self.D, ssm_state, inputs.prefill, dt_bias=self.dt_bias,
                 dt_softplus=True, dt_limit=self.dt_limit, out=y[:tp], passed=passed)

    def decode_branch(self, proj, xbc, y, inputs: StepInputs, conv_state, ssm_state) -> None:
        tp = inputs.num_prefill_tokens
        rows = slice(tp, tp + inputs.num_decode)
        xbc_in, dt, xbc_out = self._views(proj, xbc, rows)
        conv1d_update(xbc_in, conv_state, self.conv_w, self.conv_b, inputs.decode_slots, out=xbc_out)
        x, B, C = self._ssm_operands(xbc_out)
        selective_state_update(ssm_state, x, dt, self.A, B, C, self.D, inputs.decode_slots,
                               dt_bias=self.dt_bias, dt_softplus=True, out=y[rows])

    def finish(self, proj, y) -> torch.Tensor:
        """Gated norm with z, then out_proj, over all tokens."""
        T = y.shape[0]
        z = proj[:, : self.inner]
        normed = gated_rms_norm(y.view(T, self.inner), z, self.norm_w, self.inner // self.G, self.eps)
        return F.linear(normed, self.out_proj, self.out_proj_bias)

    def decode_fused(self, residual: torch.Tensor, norm_w: torch.Tensor, round_first: bool,
                     inputs: StepInputs, state, pdl: bool = False) -> None:
        """The whole block for a small decode-only step, ``residual += mixer(norm(residual))``, in
        three kernels: block norm + in_proj + conv update; state update; gated norm + out_proj +
        residual add (``kernels.decode_linear``)."""
        T = residual.shape[0]
        proj = torch.empty(T, self.in_proj.shape[0], dtype=self.in_proj.dtype, device=residual.device)
        conv = ConvTail(state.conv[self.idx], self.conv_w, self.conv_b, inputs.decode_slots, self.inner)
        norm_linear(residual, norm_w, self.eps, self.in_proj, bias=self.in_proj_bias, round_first=round_first,
                    conv=conv, out=proj, pdl=pdl)
        x, B, C = self._ssm_operands(proj[:, self.inner : self.inner + self.conv_dim])
        y = torch.empty(T, self.H, self.P, dtype=proj.dtype, device=proj.device)
        selective_state_update(state.ssm[self.idx], x, proj[:, self.inner + self.conv_dim :], self.A, B, C, self.D,
                               inputs.decode_slots, dt_bias=self.dt_bias, dt_softplus=True, out=y, pdl=pdl)
        # z (from in_proj) and the residual (from the previous block) are two or more kernels back
        gated_norm_linear(y.view(T, self.inner), proj[:, : self.inner], self.norm_w, self.inner // self.G, self.eps,
                          self.out_proj, bias=self.out_proj_bias, residual=residual, pdl=pdl, early=True)

    def forward(self, x: torch.Tensor, inputs: StepInputs, state, aux_stream=None) -> torch.Tensor:
        proj, xbc, y = self.project(x)
        args = (proj, xbc, y, inputs, state.conv[self.idx], state.ssm[self.idx])
        # Forked, the decode branch waits until the scan's chunk states are passed: its state
        # update streams the decode rows' whole state and, beside the scan's first, short,
        # latency-bound kernels, slows them down 1.5-3x; beside the chunk scan it costs less
        # (docs/BENCHMARKS.md, the staggered fork).
        forked = aux_stream is not None and inputs.num_prefill_tokens and inputs.num_decode
        passed = torch.cuda.Event() if forked else None
        run_branches(
            (lambda: self.prefill_branch(*args, passed=passed)) if inputs.num_prefill_tokens else None,
            (lambda: self.decode_branch(*args)) if inputs.num_decode else None,
            aux_stream, decode_after=passed,
        )
        return self.finish(proj, y)
