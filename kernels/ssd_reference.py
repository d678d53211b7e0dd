"""Plain fp32 torch versions of the chunked SSD scan: a per-token loop (the oracle) and the SSD
block decomposition per sequence (the CPU path and the benchmark baseline).

Both read the metadata on the host (they sync), loop over sequences in Python, and share the
Triton kernel's semantics; see ``ssd.ssd_scan`` for the argument list.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .varlen import PrefillMetadata

__all__ = ["ssd_scan_ref", "ssd_scan_chunked_torch"]


def process_dt(dt, dt_bias, dt_softplus, dt_limit):
    """dt' = clamp(softplus(dt + dt_bias), *dt_limit) in fp32; dt: [L, H]."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _live_sequences(meta: PrefillMetadata):
    """(tokens start, end, slot, has_initial_state) of every sequence the kernels would scan."""
    cu = torch.as_tensor(meta.cu_seqlens).tolist()
    slots = torch.as_tensor(meta.slot_idx).tolist()
    init = torch.as_tensor(meta.has_initial_state).tolist()
    for s, slot in enumerate(slots):
        if slot >= 0 and cu[s + 1] > cu[s]:
            yield cu[s], cu[s + 1], slot, bool(init[s])


def _prepare_out(x, out):
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # rows of padding tokens and skipped sequences stay zero
    out.zero_()
    return out


def _per_head(t, H):
    """[L, G, N] -> [L, H, N] (head h reads group h // (H // G)), in fp32."""
    return t.float().repeat_interleave(H // t.shape[1], dim=1)


def ssd_scan_ref(x, dt, A, B, C, D, ssm_state, meta, *, z=None, dt_bias=None, dt_softplus=True,
                 dt_limit=(0.0, float("inf")), out=None, workspace=None):
    """The recurrence one token at a time, in fp32: obviously correct and slow."""
    H = x.shape[1]
    out = _prepare_out(x, out)
    for t0, t1, slot, has_init in _live_sequences(meta):
        dts = process_dt(dt[t0:t1], dt_bias, dt_softplus, dt_limit)  # [L, H]
        xs, Bs, Cs = x[t0:t1].float(), _per_head(B[t0:t1], H), _per_head(C[t0:t1], H)
        h = ssm_state[slot].float() if has_init else ssm_state.new_zeros(ssm_state.shape[1:], dtype=torch.float32)
        for i in range(t1 - t0):
            decay = torch.exp(dts[i] * A.float())  # [H]
            # h: [H, P, N]
            h = decay[:, None, None] * h + (dts[i, :, None] * xs[i])[:, :, None] * Bs[i][:, None, :]
            y = torch.einsum("hpn,hn->hp", h, Cs[i])
            if D is not None:
                y = y + D.float()[:, None] * xs[i]
            if z is not None:
                y = y * F.silu(z[t0 + i].float())
            out[t0 + i] = y.to(out.dtype)
        ssm_state[slot] = h.to(ssm_state.dtype)
    return out


def _scan_sequence(x, dt, A, B, C, h0, chunk_size):
    """SSD blocks of one sequence; x: [L, H, P], dt: [L, H], B, C: [L, H, N], h0: [H, P, N].

    Returns y: [L, H, P] (without the D term) and the final state [H, P, N], all fp32.
    """
    L, H, P = x.shape
    nc = -(-L // chunk_size)
    pad = nc * chunk_size - L

    def chunks(t):
        # zero padding: dt = 0 makes padded positions neither decay nor contribute
        return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).reshape(nc, chunk_size, *t.shape[1:])

    xdt = chunks(x * dt[..., None])  # [nc, l, H, P]
    Bc, Cc = chunks(B), chunks(C)  # [nc, l, H, N]
    cs = torch.cumsum(chunks(dt * A), dim=1).transpose(1, 2)  # [nc, H, l]

    # within-chunk decay exp(cs_l - cs_s) for s <= l, else 0
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    seg = (cs[..., :, None] - cs[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [nc, H, l, s]
    scores = torch.einsum("clhn,cshn->chls", Cc, Bc) * seg
    y = torch.einsum("chls,cshp->clhp", scores, xdt)

    # each chunk's own contribution to the state at its end
    to_end = torch.exp(cs[..., -1:] - cs)  # [nc, H, l]
    local = torch.einsum("chl,clhn,clhp->chpn", to_end, Bc, xdt)  # [nc, H, P, N]

    # carry the state across chunks, keeping the state each chunk starts from
    chunk_decay = torch.exp(cs[..., -1])  # [nc, H]
    starts = []
    h = h0
    for c in range(nc):
        starts.append(h)
        h = chunk_decay[c][:, None, None] * h + local[c]
    starts = torch.stack(starts)  # [nc, H, P, N]

    y = y + torch.einsum("clhn,chpn->clhp", Cc, starts) * cs.exp().transpose(1, 2)[..., None]
    return y.reshape(nc * chunk_size, H, P)[:L], h


def ssd_scan_chunked_torch(x, dt, A, B, C, D, ssm_state, meta, *, z=None, dt_bias=None,
                           dt_softplus=True, dt_limit=(0.0, float("inf")), out=None, workspace=None):
    """The SSD block decomposition per sequence in fp32 torch ops (chunks of ``meta.chunk_size``)."""
    H = x.shape[1]
    out = _prepare_out(x, out)
    for t0, t1, slot, has_init in _live_sequences(meta):
        xs = x[t0:t1].float()
        h0 = ssm_state[slot].float() if has_init else ssm_state.new_zeros(ssm_state.shape[1:], dtype=torch.float32)
        dts = process_dt(dt[t0:t1], dt_bias, dt_softplus, dt_limit)
        y, h = _scan_sequence(xs, dts, A.float(), _per_head(B[t0:t1], H), _per_head(C[t0:t1], H), h0,
                              meta.chunk_size)
        if D is not None:
            y = y + D.float()[:, None] * xs
        if z is not None:
            y = y * F.silu(z[t0:t1].float())
        out[t0:t1] = y.to(out.dtype)
        ssm_state[slot] = h.to(ssm_state.dtype)
    return out
