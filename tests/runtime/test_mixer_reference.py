"""One Mamba2 mixer layer composed from mambastep's kernel references equals HF transformers'.

The composition here is what the model layer does: in_proj, split into z / xBC / dt, causal conv,
SSD scan for prefill tokens or the selective state update for decode tokens, gated norm,
out_proj. HF runs its own torch math (mamba_ssm and causal_conv1d are not installed).
"""

import pytest
import torch
from transformers import DynamicCache, Mamba2Config, NemotronHConfig
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from mambastep.kernels import PrefillMetadata
from mambastep.kernels.conv1d import conv1d_update, conv1d_varlen
from mambastep.kernels.norm import gated_rms_norm
from mambastep.kernels.ssd import ssd_scan
from mambastep.kernels.state_update import selective_state_update
from hf_models import HF_5_23, HF_5_25
from support import assert_close

HIDDEN, HEADS, HEAD_DIM, STATE, CONV, CHUNK = 32, 8, 8, 16, 4, 8


def _mamba2(groups):
    cfg = Mamba2Config(
        hidden_size=HIDDEN, expand=2, num_heads=HEADS, head_dim=HEAD_DIM, n_groups=groups,
        state_size=STATE, conv_kernel=CONV, chunk_size=CHUNK, num_hidden_layers=1, vocab_size=16,
    )
    return Mamba2Mixer(cfg, 0), cfg


def _nemotron_h(groups):
    cfg = NemotronHConfig(
        hidden_size=HIDDEN, expand=2, mamba_num_heads=HEADS, mamba_head_dim=HEAD_DIM,
        n_groups=groups, ssm_state_size=STATE, conv_kernel=CONV, chunk_size=CHUNK,
        layers_block_type=["mamba"], vocab_size=16,
        # a clamp that bites: prefill dt is clamped to time_step_limit, decode dt is not
        time_step_limit=(0.01, float("inf")),
    )
    return NemotronHMamba2Mixer(cfg, 0), cfg


class MixerFromKernels:
    """The mixer's forward over one sequence, from the public kernel ops and slot-indexed pools."""

    def __init__(self, hf):
        self.hf = hf
        self.inner = hf.intermediate_size
        self.groups = hf.n_groups
        conv_dim = hf.conv_dim
        # slot 1 of a 3-slot pool, so the other slots can be checked untouched
        self.slot = 1
        self.conv_state = torch.randn(3, conv_dim, CONV - 1)
        self.ssm_state = torch.randn(3, HEADS, HEAD_DIM, STATE)
        self.untouched = (self.conv_state[[0, 2]].clone(), self.ssm_state[[0, 2]].clone())

    def _split(self, h):
        hf = self.hf
        proj = hf.in_proj(h)
        z, xbc, dt = proj.split([self.inner, hf.conv_dim, HEADS], dim=-1)
        return z, xbc, dt

    def _finish(self, y, z):
        hf = self.hf
        y = gated_rms_norm(y.reshape(len(z), -1), z, hf.norm.weight, self.inner // self.groups,
                           hf.norm.variance_epsilon)
        return hf.out_proj(y)

    def _ssm_inputs(self, xbc):
        GN = self.groups * STATE
        x, B, C = xbc.split([self.inner, GN, GN], dim=-1)
        T = len(x)
        return x.view(T, HEADS, HEAD_DIM), B.view(T, self.groups, STATE), C.view(T, self.groups, STATE)

    def prefill(self, h, has_initial_state):
        hf = self.hf
        z, xbc, dt = self._split(h)
        meta = PrefillMetadata.build([len(h)], [self.slot], [int(has_initial_state)], chunk_size=CHUNK)
        xbc = conv1d_varlen(xbc, hf.conv1d.weight.squeeze(1), hf.conv1d.bias, self.conv_state, meta)
        x, B, C = self._ssm_inputs(xbc)
        A = -torch.exp(hf.A_log.float())
        y = ssd_scan(x, dt, A, B, C, hf.D, self.ssm_state, meta, dt_bias=hf.dt_bias,
                     dt_softplus=True, dt_limit=tuple(hf.time_step_limit))
        return self._finish(y, z)

    def decode(self, h):
        hf = self.hf
        z, xbc, dt = self._split(h)
        slot_idx = torch.tensor([self.slot], dtype=torch.int32)
        xbc = conv1d_update(xbc, self.conv_state, hf.conv1d.weight.squeeze(1), hf.conv1d.bias, slot_idx)
        x, B, C = self._ssm_inputs(xbc)
        A = -torch.exp(hf.A_log.float())
        y = selective_state_update(self.ssm_state, x, dt, A, B, C, hf.D, slot_idx, dt_bias=hf.dt_bias,
                                   dt_softplus=True)
        return self._finish(y, z)


@pytest.mark.parametrize("make", [_mamba2, _nemotron_h], ids=["mamba2", "nemotron_h"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("prompt_len", [1, CHUNK - 1, 2 * CHUNK + 3])
@torch.no_grad()
def test_mixer_prefill_then_decode_matches_hf(make, groups, prompt_len):
    torch.manual_seed(0)
    if not HF_5_23:
        pytest.skip("the standalone mixer with a DynamicCache decodes as here from transformers 5.23")
    if make is _nemotron_h and not HF_5_25:
        pytest.skip("NemotronH clamps prefill dt to time_step_limit from transformers 5.25")
    hf, cfg = make(groups)
    hf.eval()
    hf.D.data.normal_()
    hf.conv1d.bias.data.normal_()
    ours = MixerFromKernels(hf)
    cache = DynamicCache(config=cfg)
    prompt = torch.randn(1, prompt_len, HIDDEN)

    ref = hf(prompt, cache=cache)
    out = ours.prefill(prompt[0], has_initial_state=False)
    assert_close(out, ref[0])
    for _ in range(5):
        tok = torch.randn(1, 1, HIDDEN)
        assert_close(ours.decode(tok[0]), hf(tok, cache=cache)[0])
    # the pools hold HF's states in the slot, and nothing else moved
    assert_close(ours.ssm_state[ours.slot], cache.get_recurrent_state(0, state_idx=0)[0])
    assert_close(ours.conv_state[ours.slot], cache.get_conv_state(0, state_idx=0)[0, :, 1:])
    assert torch.equal(ours.conv_state[[0, 2]], ours.untouched[0])
    assert torch.equal(ours.ssm_state[[0, 2]], ours.untouched[1])


@torch.no_grad()
def test_chunked_prefill_continues_from_slot_state():
    """A prompt prefilled in two pieces (the second from the slot's state) equals one prefill."""
    torch.manual_seed(1)
    hf, _ = _nemotron_h(2)
    whole, split = MixerFromKernels(hf), MixerFromKernels(hf)
    prompt = torch.randn(2 * CHUNK + 5, HIDDEN)
    ref = whole.prefill(prompt, has_initial_state=False)
    first = split.prefill(prompt[:CHUNK + 3], has_initial_state=False)
    second = split.prefill(prompt[CHUNK + 3:], has_initial_state=True)
    assert_close(torch.cat([first, second]), ref)
    assert_close(split.ssm_state[split.slot], whole.ssm_state[whole.slot])
    assert_close(split.conv_state[split.slot], whole.conv_state[whole.slot])


@pytest.mark.parametrize("with_z", [False, True])
def test_ssd_scan_equals_state_update_token_by_token(device, with_z):
    """The Triton SSD scan over a sequence equals the Triton decode update applied per token."""
    torch.manual_seed(2)
    H, P, N, G, chunk = 4, 16, 16, 2, 16
    L = 2 * chunk + 3
    x = torch.randn(L, H, P, device=device)
    dt = torch.randn(L, H, device=device)
    B, C = torch.randn(2, L, G, N, device=device)
    z = torch.randn(L, H, P, device=device) if with_z else None
    A = -torch.rand(H, device=device) - 0.5
    D, dt_bias = torch.randn(2, H, device=device)
    pool = torch.randn(3, H, P, N, device=device)
    scan_pool, step_pool = pool.clone(), pool.clone()

    meta = PrefillMetadata.build([L], [2], [1], chunk_size=chunk, device=device)
    y_scan = ssd_scan.triton(x, dt, A, B, C, D, scan_pool, meta, z=z, dt_bias=dt_bias)
    slot = torch.tensor([2], dtype=torch.int32, device=device)
    y_steps = torch.cat([
        selective_state_update.triton(
            step_pool, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D, slot,
            z=None if z is None else z[t : t + 1], dt_bias=dt_bias,
        )
        for t in range(L)
    ])
    assert_close(y_scan.cpu(), y_steps.cpu(), factor=3)
    assert_close(scan_pool.cpu(), step_pool.cpu(), factor=3)
    assert torch.equal(scan_pool[:2], pool[:2])

