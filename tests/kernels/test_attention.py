import pytest
import torch
from transformers import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHAttention

from mambastep.kernels import PAD_SLOT_ID, PrefillMetadata
from mambastep.kernels.attention import (
    FP8_KV_DTYPE, decode_attention, decode_attention_ref, decode_workspace, prefill_attention, prefill_attention_ref,
    write_kv,
)
from support import assert_close, poisoned

DTYPES = [torch.float32, torch.bfloat16]
# (query heads, KV heads): grouped, plain multi-head, multi-query
HEADS = [(4, 2), (4, 4), (4, 1)]
S, MAX_CTX, DH = 5, 200, 16


def _pool(kvh, dtype, device, slots=S, max_ctx=MAX_CTX, dh=DH):
    """Random K and V caches [slots, max_ctx, KVH, Dh]: every slot and position holds data."""
    shape = (slots, max_ctx, kvh, dh)
    return torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)


def _qkv(rows, h, kvh, dtype, device, dh=DH):
    """q, k, v as strided views of one projection buffer [rows, (H + 2 KVH) * Dh + pad]."""
    buf = torch.randn(rows, (h + 2 * kvh) * dh + 3, device=device).to(dtype)
    q = buf[:, : h * dh].view(rows, h, dh)
    k = buf[:, h * dh : (h + kvh) * dh].view(rows, kvh, dh)
    v = buf[:, (h + kvh) * dh : (h + 2 * kvh) * dh].view(rows, kvh, dh)
    return q, k, v


def _assert_cache(cache, before, writes):
    """``cache`` equals ``before`` bit for bit except at ``writes``: {(slot, pos): row [KVH, Dh]}."""
    expect = before.clone()
    for (slot, pos), row in writes.items():
        expect[slot, pos] = row
    assert torch.equal(cache.cpu(), expect.cpu())


# Row lengths include the new token: one token, one position either side of a 64-position split
# edge, the whole context; -1 slots are pad rows whose lengths are stale garbage.
DECODE_SLOTS = [0, 2, PAD_SLOT_ID, 3, 4, 1, PAD_SLOT_ID]
DECODE_LENS = [1, 65, 7, MAX_CTX, 64, 130, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,kvh", HEADS)
def test_decode_matches_reference(device, dtype, h, kvh):
    torch.manual_seed(0)
    B = len(DECODE_SLOTS)
    q, k, v = _qkv(B, h, kvh, dtype, device)
    kc, vc = _pool(kvh, dtype, device)
    kc0, vc0 = kc.cpu().clone(), vc.cpu().clone()
    slots = torch.tensor(DECODE_SLOTS, dtype=torch.int32, device=device)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=device)
    out = poisoned((B, h, DH), dtype, device)
    # stale NaN partials: splits past a row's length must be neither written nor read
    ws = poisoned(decode_workspace(B, h, DH, MAX_CTX).shape, torch.float32, device)
    decode_attention.triton(q, k, v, kc, vc, slots, lens, scale=DH**-0.5, out=out, workspace=ws)

    kr, vr = kc0.clone(), vc0.clone()
    ref = decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), kr, vr, slots.cpu(), lens.cpu(), scale=DH**-0.5)
    assert_close(out.cpu(), ref, dtype)
    pad = torch.tensor(DECODE_SLOTS) == PAD_SLOT_ID
    assert (out.cpu()[pad] == 0).all()
    live = [(b, s, n) for b, (s, n) in enumerate(zip(DECODE_SLOTS, DECODE_LENS)) if s != PAD_SLOT_ID]
    _assert_cache(kc, kc0, {(s, n - 1): k[b].cpu() for b, s, n in live})
    _assert_cache(vc, vc0, {(s, n - 1): v[b].cpu() for b, s, n in live})
    assert torch.equal(kc.cpu(), kr) and torch.equal(vc.cpu(), vr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_short_rows_in_a_long_pool(device, dtype):
    """A pool past 32 x 64 positions has static splits of several tiles; a row's splits follow
    its own length (one tile a split for short rows), and splits past it stay unread (NaN)."""
    torch.manual_seed(2)
    h, kvh, max_ctx = 4, 2, 4160
    slots = torch.tensor([0, 1, PAD_SLOT_ID, 2, 3], dtype=torch.int32, device=device)
    lens = torch.tensor([1, 130, 9, 2000, max_ctx], dtype=torch.int32, device=device)
    B = slots.shape[0]
    q, k, v = _qkv(B, h, kvh, dtype, device)
    kc, vc = _pool(kvh, dtype, device, slots=4, max_ctx=max_ctx)
    kr, vr = kc.cpu().clone(), vc.cpu().clone()
    out = poisoned((B, h, DH), dtype, device)
    ws = poisoned(decode_workspace(B, h, DH, max_ctx).shape, torch.float32, device)
    decode_attention.triton(q, k, v, kc, vc, slots, lens, scale=DH**-0.5, out=out, workspace=ws)
    ref = decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), kr, vr, slots.cpu(), lens.cpu(), scale=DH**-0.5)
    assert_close(out.cpu(), ref, dtype)
    assert (out.cpu()[2] == 0).all()


def test_decode_odd_head_dim_and_sliced_workspace(device):
    # Dh = 20 (masked to a 32-wide tile) and a workspace allocated for a larger batch, sliced
    torch.manual_seed(1)
    dh, h, kvh, B = 20, 4, 2, 3
    q, k, v = _qkv(B, h, kvh, torch.float32, device, dh=dh)
    kc, vc = _pool(kvh, torch.float32, device, dh=dh)
    kr, vr = kc.cpu().clone(), vc.cpu().clone()
    slots = torch.tensor([4, PAD_SLOT_ID, 1], dtype=torch.int32, device=device)
    lens = torch.tensor([150, 3, 33], dtype=torch.int32, device=device)
    ws = poisoned(decode_workspace(8, h, dh, MAX_CTX).shape, torch.float32, device)
    out = poisoned((B, h, dh), torch.float32, device)
    decode_attention.triton(q, k, v, kc, vc, slots, lens, scale=dh**-0.5, out=out, workspace=ws[:B])
    ref = decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), kr, vr, slots.cpu(), lens.cpu(), scale=dh**-0.5)
    assert_close(out.cpu(), ref)
    assert torch.equal(kc.cpu(), kr) and torch.equal(vc.cpu(), vr)


# (length, slot, context): a continuation crossing a 64-token block edge, a short one from 0,
# a long one spanning three blocks, a one-token chunk deep into its slot, and a sequence with
# tokens but the skip slot. Then padding tokens and unused sequences.
PREFILL_SEQS = [(70, 1, 10), (5, 3, 0), (130, 0, 3), (1, 4, 60), (4, PAD_SLOT_ID, 0)]
PREFILL_TOKENS, PREFILL_MAX_SEQS = 230, 7


def _prefill_meta(seqs, device, max_tokens=PREFILL_TOKENS, max_seqs=PREFILL_MAX_SEQS):
    lens, slots, ctx = zip(*seqs)
    return PrefillMetadata.build(lens, slots, context_lens=ctx, chunk_size=16, max_tokens=max_tokens,
                                 max_seqs=max_seqs, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,kvh", HEADS)
def test_prefill_matches_reference(device, dtype, h, kvh):
    torch.manual_seed(2)
    T = PREFILL_TOKENS
    meta = _prefill_meta(PREFILL_SEQS, device)
    q, k, v = _qkv(T, h, kvh, dtype, device)
    kc, vc = _pool(kvh, dtype, device)
    kc0, vc0 = kc.cpu().clone(), vc.cpu().clone()
    out = poisoned((T, h, DH), dtype, device)
    prefill_attention.triton(q, k, v, kc, vc, meta, scale=DH**-0.5, out=out)

    kr, vr = kc0.clone(), vc0.clone()
    ref = prefill_attention_ref(q.cpu(), k.cpu(), v.cpu(), kr, vr, meta.to("cpu"), scale=DH**-0.5)
    assert_close(out.cpu(), ref, dtype)
    writes_k, writes_v, t0 = {}, {}, 0
    for n, slot, ctx in PREFILL_SEQS:
        if slot == PAD_SLOT_ID:
            assert (out.cpu()[t0 : t0 + n] == 0).all()
        else:
            writes_k.update({(slot, ctx + j): k[t0 + j].cpu() for j in range(n)})
            writes_v.update({(slot, ctx + j): v[t0 + j].cpu() for j in range(n)})
        t0 += n
    assert (out.cpu()[t0:] == 0).all()
    _assert_cache(kc, kc0, writes_k)
    _assert_cache(vc, vc0, writes_v)
    assert torch.equal(kc.cpu(), kr) and torch.equal(vc.cpu(), vr)


def test_write_kv_skips_padding(device):
    torch.manual_seed(3)
    meta = _prefill_meta([(3, 2, 5), (2, PAD_SLOT_ID, 0)], device, max_tokens=8, max_seqs=3)
    _, k, v = _qkv(8, 2, 2, torch.float32, device)
    kc, vc = _pool(2, torch.float32, device)
    kc0, vc0 = kc.cpu().clone(), vc.cpu().clone()
    write_kv.triton(k, v, kc, vc, meta)
    _assert_cache(kc, kc0, {(2, 5 + j): k[j].cpu() for j in range(3)})
    _assert_cache(vc, vc0, {(2, 5 + j): v[j].cpu() for j in range(3)})


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_equals_one_prefill(device, dtype):
    # one 90-token prompt in slot 1, against chunks of 50 and 40 tokens in slot 3 of the same pool
    torch.manual_seed(4)
    h, kvh, L, cut = 4, 2, 90, 50
    q, k, v = _qkv(L, h, kvh, dtype, device)
    kc, vc = _pool(kvh, dtype, device)
    whole = prefill_attention.triton(q, k, v, kc, vc, _prefill_meta([(L, 1, 0)], device, L, 1), scale=DH**-0.5)
    first = prefill_attention.triton(q[:cut], k[:cut], v[:cut], kc, vc, _prefill_meta([(cut, 3, 0)], device, cut, 1),
                                     scale=DH**-0.5)
    # the second chunk is packed after a short unrelated sequence, with padding behind it
    meta = _prefill_meta([(3, 0, 0), (L - cut, 3, cut)], device, max_tokens=L - cut + 8, max_seqs=3)
    q2, k2, v2 = _qkv(L - cut + 8, h, kvh, dtype, device)
    q2[3 : 3 + L - cut], k2[3 : 3 + L - cut], v2[3 : 3 + L - cut] = q[cut:], k[cut:], v[cut:]
    second = prefill_attention.triton(q2, k2, v2, kc, vc, meta, scale=DH**-0.5)
    chunked = torch.cat([first, second[3 : 3 + L - cut]])
    # the same math on the same operands, split at other places: far inside the tolerance
    assert_close(chunked.cpu(), whole.cpu(), dtype, factor=0.25)
    assert torch.equal(kc[3, :L], kc[1, :L]) and torch.equal(vc[3, :L], vc[1, :L])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_then_decode_equals_longer_prefill(device, dtype):
    torch.manual_seed(5)
    h, kvh, L, steps = 4, 2, 66, 3
    q, k, v = _qkv(L + steps, h, kvh, dtype, device)
    kc, vc = _pool(kvh, dtype, device)
    full = prefill_attention.triton(q, k, v, kc, vc, _prefill_meta([(L + steps, 0, 0)], device, L + steps, 1),
                                    scale=DH**-0.5)
    prefill_attention.triton(q[:L], k[:L], v[:L], kc, vc, _prefill_meta([(L, 2, 0)], device, L, 1), scale=DH**-0.5)
    slots = torch.tensor([PAD_SLOT_ID, 2], dtype=torch.int32, device=device)
    for i in range(steps):
        t = L + i
        lens = torch.tensor([5, t + 1], dtype=torch.int32, device=device)
        rows = torch.tensor([0, t], device=device)  # row 0 is a pad row: its inputs are ignored
        out = decode_attention.triton(q[rows], k[rows], v[rows], kc, vc, slots, lens, scale=DH**-0.5)
        assert_close(out[1].cpu(), full[t].cpu(), dtype, factor=0.25)
        assert (out[0] == 0).all()
    assert torch.equal(kc[2, : L + steps], kc[0, : L + steps])


def _hf_attention(h, kvh, dh, hidden=32):
    cfg = NemotronHConfig(hidden_size=hidden, num_attention_heads=h, num_key_value_heads=kvh, head_dim=dh,
                          layers_block_type=["attention"], vocab_size=16)
    cfg._attn_implementation = "eager"
    return NemotronHAttention(cfg, 0).eval()


def _project(attn, x):
    """q, k, v of HF's projections for tokens x [T, hidden], as [T, heads, Dh]."""
    dh = attn.head_dim
    return attn.q_proj(x).view(len(x), -1, dh), attn.k_proj(x).view(len(x), -1, dh), attn.v_proj(x).view(len(x), -1, dh)


@pytest.mark.parametrize("h,kvh", HEADS)
@torch.no_grad()
def test_references_match_hf(h, kvh):
    torch.manual_seed(6)
    dh, L = 8, 12
    attn = _hf_attention(h, kvh, dh)
    x = torch.randn(L, 32)
    causal = torch.full((L, L), float("-inf")).triu(1)[None, None]
    hf, _ = attn(x[None], attention_mask=causal)

    # two prompts packed into one prefill: this one in slot 1, a distractor in slot 0
    q, k, v = _project(attn, x)
    other = [torch.randn(4, n, dh) for n in (h, kvh, kvh)]
    meta = PrefillMetadata.build([4, L], [0, 1], chunk_size=4, max_tokens=L + 6, max_seqs=3)
    pack = lambda a, b: torch.cat([a, b, torch.zeros(2, *b.shape[1:])])  # noqa: E731
    kc, vc = torch.zeros(2, 16, kvh, dh), torch.zeros(2, 16, kvh, dh)
    y = prefill_attention_ref(pack(other[0], q), pack(other[1], k), pack(other[2], v), kc, vc, meta, scale=dh**-0.5)
    assert_close(attn.o_proj(y[4 : 4 + L].reshape(L, -1)), hf[0])

    # the same prompt: prefill of L - 1 tokens into slot 1, then its last token as a decode
    kc.zero_(), vc.zero_()
    meta = PrefillMetadata.build([L - 1], [1], chunk_size=4)
    prefill_attention_ref(q[:-1], k[:-1], v[:-1], kc, vc, meta, scale=dh**-0.5)
    slots, lens = torch.tensor([1], dtype=torch.int32), torch.tensor([L], dtype=torch.int32)
    y = decode_attention_ref(q[-1:], k[-1:], v[-1:], kc, vc, slots, lens, scale=dh**-0.5)
    assert_close(attn.o_proj(y.reshape(1, -1)), hf[0, -1:])


def test_public_ops_dispatch_to_reference_on_cpu():
    torch.manual_seed(7)
    q, k, v = _qkv(2, 4, 2, torch.float32, "cpu")
    kc, vc = _pool(2, torch.float32, "cpu")
    slots, lens = torch.tensor([1, PAD_SLOT_ID], dtype=torch.int32), torch.tensor([9, 1], dtype=torch.int32)
    kr, vr = kc.clone(), vc.clone()
    out = decode_attention(q, k, v, kc, vc, slots, lens, scale=0.25)
    assert torch.equal(out, decode_attention_ref(q, k, v, kr, vr, slots, lens, scale=0.25))
    meta = _prefill_meta([(2, 0, 4)], "cpu", max_tokens=2, max_seqs=1)
    out = prefill_attention(q, k, v, kc, vc, meta, scale=0.25)
    assert torch.equal(out, prefill_attention_ref(q, k, v, kr, vr, meta, scale=0.25))
    write_kv(k, v, kc, vc, meta)
    assert torch.equal(kc, kr)


@pytest.mark.gpu
def test_decode_in_a_pdl_chain_equals_plain_launches():
    """As the fused decode step runs it: the qkv projection, the decode attention and the o_proj
    with its residual add, each reading its predecessor's output, captured in a CUDA graph as
    programmatic dependents; bit for bit what plain launches give, the cache written alike."""
    from mambastep.kernels.decode_linear import norm_linear, pdl_supported

    if not pdl_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90+ and a Triton that launches with it")
    torch.manual_seed(9)
    h, kvh, dh, ctx, D = 32, 2, 128, 512, 1024
    qkv_w = torch.randn((h + 2 * kvh) * dh, D, device="cuda").mul_(0.03).to(torch.bfloat16)
    o_w = torch.randn(D, h * dh, device="cuda").mul_(0.03).to(torch.bfloat16)
    norm_w = torch.randn(D, device="cuda").to(torch.bfloat16)
    start = torch.randn(1, D, device="cuda")
    cache0 = _pool(kvh, torch.bfloat16, "cuda", slots=3, max_ctx=ctx, dh=dh)
    slots = torch.tensor([2], dtype=torch.int32, device="cuda")
    lens = torch.tensor([300], dtype=torch.int32, device="cuda")

    def run(pdl):
        residual, kc, vc = start.clone(), cache0[0].clone(), cache0[1].clone()
        qkv = torch.empty(1, qkv_w.shape[0], dtype=torch.bfloat16, device="cuda")
        out = torch.empty(1, h, dh, dtype=torch.bfloat16, device="cuda")
        ws = decode_workspace(1, h, dh, ctx, device="cuda")

        def block():
            norm_linear.triton(residual, norm_w, 1e-5, qkv_w, out=qkv, pdl=pdl)
            q, k, v = (qkv[:, a * dh : b * dh].view(1, -1, dh) for a, b in ((0, h), (h, h + kvh), (h + kvh, h + 2 * kvh)))
            decode_attention.triton(q, k, v, kc, vc, slots, lens, scale=dh**-0.5, out=out, workspace=ws, pdl=pdl)
            norm_linear.triton(out.view(1, -1), None, 1e-5, o_w, residual=residual, pdl=pdl)

        block()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            block()
        residual.copy_(start)
        kc.copy_(cache0[0])
        vc.copy_(cache0[1])
        graph.replay()
        torch.cuda.synchronize()
        return residual, kc, vc

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


# Nemotron-H-8B attention: 32 query heads, 8 KV heads of 128, bf16, a 4096-token context.
@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64])
def test_decode_full_shape_gpu(B):
    torch.manual_seed(8)
    h, kvh, dh, ctx = 32, 8, 128, 4096
    q, k, v = _qkv(B, h, kvh, torch.bfloat16, "cuda", dh=dh)
    kc, vc = _pool(kvh, torch.bfloat16, "cuda", slots=B + 2, max_ctx=ctx, dh=dh)
    kr, vr = kc.clone(), vc.clone()
    slots = torch.randperm(B + 2, device="cuda")[:B].int()
    lens = torch.randint(1, ctx + 1, (B,), device="cuda", dtype=torch.int32)
    lens[0] = ctx
    if B > 1:
        lens[1], slots[-1] = 1, PAD_SLOT_ID
    out = poisoned((B, h, dh), torch.bfloat16, "cuda")
    ws = poisoned(decode_workspace(B, h, dh, ctx).shape, torch.float32, "cuda")
    decode_attention.triton(q, k, v, kc, vc, slots, lens, scale=dh**-0.5, out=out, workspace=ws)
    ref = decode_attention_ref(q, k, v, kr, vr, slots, lens, scale=dh**-0.5)
    assert_close(out, ref, torch.bfloat16)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.gpu
def test_prefill_full_shape_gpu():
    torch.manual_seed(9)
    h, kvh, dh, ctx = 32, 8, 128, 4096
    seqs = [(500, 0, 0), (500, 3, 1000), (500, 1, 3596), (500, 2, 37)]
    meta = _prefill_meta(seqs, "cuda", max_tokens=2048, max_seqs=8)
    q, k, v = _qkv(2048, h, kvh, torch.bfloat16, "cuda", dh=dh)
    kc, vc = _pool(kvh, torch.bfloat16, "cuda", slots=5, max_ctx=ctx, dh=dh)
    kr, vr = kc.clone(), vc.clone()
    out = poisoned((2048, h, dh), torch.bfloat16, "cuda")
    prefill_attention.triton(q, k, v, kc, vc, meta, scale=dh**-0.5, out=out)
    ref = prefill_attention_ref(q, k, v, kr, vr, meta, scale=dh**-0.5)
    assert_close(out, ref, torch.bfloat16)
    assert (out[2000:] == 0).all()
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


KV_SCALE = (2.0**-4, 2.0**-5)  # a key and a value scale: powers of two, so values on the e4m3 grid stay on it


def _fp8_pool(kvh, device, **kw):
    """An FP8 pool over KV_SCALE, and the scales as the kernels take them."""
    scale = torch.tensor(KV_SCALE, device=device)
    kc, vc = _pool(kvh, torch.float32, device, **kw)
    return (kc * 8).to(FP8_KV_DTYPE), (vc * 8).to(FP8_KV_DTYPE), scale


def _on_grid(x, scale):
    """x moved onto the e4m3 grid times ``scale``: stored exactly, whatever the rounding, so these
    tests compare attention and leave rounding to ``test_fp8_cache_rounds_to_nearest_as_torch``."""
    return ((x.float() / scale).to(FP8_KV_DTYPE).float() * scale).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cache_decode_and_prefill_match_the_reference(device, dtype):
    """An FP8 KV cache over a key and a value scale: tokens are stored divided by them
    (saturated), attended to multiplied back, the new token's too, as the reference does; the
    rest of the cache is left as it was."""
    torch.manual_seed(6)
    h, kvh = 4, 2
    kc, vc, kv_scale = _fp8_pool(kvh, device)
    kr, vr = kc.cpu().clone(), vc.cpu().clone()
    meta = _prefill_meta(PREFILL_SEQS, device)
    q, k, v = _qkv(PREFILL_TOKENS, h, kvh, dtype, device)
    k.copy_(_on_grid(k * 4, KV_SCALE[0])), v.copy_(_on_grid(v * 2, KV_SCALE[1]))
    k[0, 0, 0] = 1e4  # saturates at 448 x its scale
    out = poisoned((PREFILL_TOKENS, h, DH), dtype, device)
    prefill_attention.triton(q, k, v, kc, vc, meta, scale=DH**-0.5, out=out, kv_scale=kv_scale)
    ref = prefill_attention_ref(q.cpu(), k.cpu(), v.cpu(), kr, vr, meta.to("cpu"), scale=DH**-0.5,
                                kv_scale=kv_scale.cpu())
    assert_close(out.cpu(), ref, dtype)
    assert torch.equal(kc.cpu().float(), kr.float()) and torch.equal(vc.cpu().float(), vr.float())
    assert kr[1, 10, 0, 0].float() == 448.0

    B = len(DECODE_SLOTS)
    q, k, v = _qkv(B, h, kvh, dtype, device)
    k.copy_(_on_grid(k * 4, KV_SCALE[0])), v.copy_(_on_grid(v * 2, KV_SCALE[1]))
    slots = torch.tensor(DECODE_SLOTS, dtype=torch.int32, device=device)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=device)
    out = poisoned((B, h, DH), dtype, device)
    decode_attention.triton(q, k, v, kc, vc, slots, lens, scale=DH**-0.5, out=out, kv_scale=kv_scale)
    ref = decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), kr, vr, slots.cpu(), lens.cpu(), scale=DH**-0.5,
                               kv_scale=kv_scale.cpu())
    assert_close(out.cpu(), ref, dtype)
    assert torch.equal(kc.cpu().float(), kr.float()) and torch.equal(vc.cpu().float(), vr.float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cache_rounds_to_nearest_as_torch(device, dtype):
    """Keys and values off the grid, over scales that are not powers of two: stored bit for bit
    as torch rounds them (to nearest, saturated), in prefill and decode alike (on CPU, through
    the interpreter as tests/conftest.py makes it round)."""
    torch.manual_seed(8)
    kc, vc, _ = _fp8_pool(2, device)
    kv_scale = torch.tensor([0.021, 0.033], device=device)
    kr, vr = kc.cpu().clone(), vc.cpu().clone()
    meta = _prefill_meta(PREFILL_SEQS, device)
    q, k, v = _qkv(PREFILL_TOKENS, 4, 2, dtype, device)
    prefill_attention.triton(q, k * 5, v * 3, kc, vc, meta, scale=DH**-0.5, kv_scale=kv_scale)
    prefill_attention_ref(q.cpu(), k.cpu() * 5, v.cpu() * 3, kr, vr, meta.to("cpu"), scale=DH**-0.5,
                          kv_scale=kv_scale.cpu())
    q, k, v = _qkv(len(DECODE_SLOTS), 4, 2, dtype, device)
    slots = torch.tensor(DECODE_SLOTS, dtype=torch.int32, device=device)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=device)
    decode_attention.triton(q, k * 5, v * 3, kc, vc, slots, lens, scale=DH**-0.5, kv_scale=kv_scale)
    decode_attention_ref(q.cpu(), k.cpu() * 5, v.cpu() * 3, kr, vr, slots.cpu(), lens.cpu(), scale=DH**-0.5,
                         kv_scale=kv_scale.cpu())
    assert torch.equal(kc.cpu().float(), kr.float()) and torch.equal(vc.cpu().float(), vr.float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_cache_prefill_then_decode_equals_longer_prefill(device, dtype):
    """A decode step attends to its new token as the cache will hold it, the same as a prefill
    of the same tokens stores and reads back."""
    torch.manual_seed(7)
    h, kvh, L, steps = 4, 2, 66, 3
    q, k, v = _qkv(L + steps, h, kvh, dtype, device)
    k.copy_(_on_grid(k * 4, KV_SCALE[0])), v.copy_(_on_grid(v * 2, KV_SCALE[1]))
    kc, vc, kv_scale = _fp8_pool(kvh, device)
    full = prefill_attention.triton(q, k, v, kc, vc, _prefill_meta([(L + steps, 0, 0)], device, L + steps, 1),
                                    scale=DH**-0.5, kv_scale=kv_scale)
    prefill_attention.triton(q[:L], k[:L], v[:L], kc, vc, _prefill_meta([(L, 2, 0)], device, L, 1), scale=DH**-0.5,
                             kv_scale=kv_scale)
    slots = torch.tensor([2], dtype=torch.int32, device=device)
    for i in range(steps):
        t = L + i
        out = decode_attention.triton(q[t : t + 1], k[t : t + 1], v[t : t + 1], kc, vc, slots,
                                      torch.tensor([t + 1], dtype=torch.int32, device=device), scale=DH**-0.5,
                                      kv_scale=kv_scale)
        assert_close(out[0].cpu(), full[t].cpu(), dtype, factor=0.25)
    assert torch.equal(kc[2, : L + steps].cpu().float(), kc[0, : L + steps].cpu().float())


def test_fp8_cache_and_its_scales_are_asked_for_together(device):
    q, k, v = _qkv(2, 4, 2, torch.bfloat16, device)
    kc, vc, kv_scale = _fp8_pool(2, device)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=device)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="FP8 KV cache needs kv_scale"):
        decode_attention(q, k, v, kc, vc, slots, lens, scale=0.25)
    bf_k, bf_v = _pool(2, torch.bfloat16, device)
    with pytest.raises(ValueError, match="kv_scale is for an FP8 KV cache; this one is torch.bfloat16"):
        decode_attention(q, k, v, bf_k, bf_v, slots, lens, scale=0.25, kv_scale=kv_scale)
    with pytest.raises(ValueError, match=r"kv_scale must have shape \[2\]"):
        write_kv(k, v, kc, vc, _prefill_meta([(2, 0, 0)], device, 2, 1), kv_scale=kv_scale[:1])
