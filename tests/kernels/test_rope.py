"""Rotary position embedding over packed prefill and decode tokens against HF's rotate_half math."""

import pytest
import torch

from mambastep.kernels import PrefillMetadata
from mambastep.kernels.rope import rope, rope_inv_freq, rope_ref, token_positions
from support import assert_close


def hf_rotary(x, positions, rotary_dim, theta):
    """HF's Bamba / Falcon-H1 rotation of x [T, heads, Dh] at positions [T] (fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def _step(device, lens=(5, 1, 12), ctx=(0, 7, 30), decode_lens=(3, 41, 1), pad_tokens=4):
    meta = PrefillMetadata.build(list(lens), [0, 1, 2], context_lens=list(ctx), chunk_size=4,
                                 max_tokens=sum(lens) + pad_tokens, max_seqs=4, device=device)
    return meta, torch.tensor(decode_lens, dtype=torch.int32, device=device)


def test_token_positions_follow_the_metadata():
    meta, kv_lens = _step("cpu")
    expect = [0, 1, 2, 3, 4, 7, *range(30, 42), -1, -1, -1, -1, 2, 40, 0]
    assert token_positions(meta, kv_lens).tolist() == expect
    assert token_positions(None, kv_lens).tolist() == [2, 40, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, rotary_dim, theta", [(8, 4, 10000.0), (128, 64, 10000.0), (128, 128, 1e11),
                                                         (48, 24, 500000.0)])
@pytest.mark.parametrize("prefill", [True, False])
def test_rope_matches_hf(device, dtype, head_dim, rotary_dim, theta, prefill):
    """Partial (Bamba: half of each head) and full rotary (Falcon-H1, theta 1e11), a rotated
    width that is no power of two; q and k strided views of one projection; padding left as is."""
    meta, kv_lens = _step(device)
    meta = meta if prefill else None
    T = (meta.max_tokens if meta is not None else 0) + kv_lens.shape[0]
    H, KVH = 4, 2
    qkv = torch.randn(T, (H + 2 * KVH) * head_dim, device=device).to(dtype)
    q = qkv[:, : H * head_dim].view(T, H, head_dim)
    k = qkv[:, H * head_dim : (H + KVH) * head_dim].view(T, KVH, head_dim)
    v_before = qkv[:, (H + KVH) * head_dim :].clone()
    positions = token_positions(meta, kv_lens.cpu())
    live = positions >= 0
    expect_q, expect_k = (hf_rotary(x.cpu().float(), positions.clamp(min=0), rotary_dim, theta) for x in (q, k))
    before_q = q.cpu().clone()
    inv_freq = rope_inv_freq(rotary_dim, theta, device)
    rope.triton(q, k, inv_freq, meta, kv_lens)
    assert_close(q.cpu()[live], expect_q[live], dtype)
    assert_close(k.cpu()[live], expect_k[live], dtype)
    assert torch.equal(q.cpu()[~live], before_q[~live])  # padding tokens untouched
    assert torch.equal(qkv[:, (H + KVH) * head_dim :], v_before)  # v untouched
    q2, k2 = before_q.clone(), expect_k.to(dtype).clone()
    rope_ref(q2, k2, inv_freq.cpu(), None if meta is None else meta.to("cpu"), kv_lens.cpu())
    assert_close(q2[live], expect_q[live], dtype)
