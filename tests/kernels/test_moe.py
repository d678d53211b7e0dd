"""The grouped-experts path (sorted pairs, grouped GEMMs, combine; a decode step's folded MoE)
against the dense all-experts reference, in Triton's interpreter on CPU and compiled on a GPU."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mambastep.kernels import moe
from mambastep.kernels.fp8 import quantize_fp8, quantize_rows
from mambastep.kernels.moe import block_m, moe_experts, moe_experts_ref, slot_count
from mambastep.kernels.moe_route import block_counts_ref, moe_route, moe_route_ref
from support import assert_close, poisoned


def experts(E, I, K, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    up = (torch.randn(E, I, K, generator=g) * K**-0.5).to(dtype).to(device)
    down = (torch.randn(E, D, I, generator=g) * I**-0.5).to(dtype).to(device)
    return up, down


def routing(T, E, k, seed=0, experts_used=None):
    """k distinct experts a token (ascending), drawn from ``experts_used`` (default: all), and
    positive weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(E) if experts_used is None else torch.tensor(experts_used)
    idx = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]].sort()[0] for _ in range(T)])
    return idx.to(torch.int32), torch.rand(T, k, generator=g) + 0.1


# up to kernels.moe.PAIR_TILES_MAX (48) pairs a tile each (FP8 ones up to PAIR_STREAM_MAX, 12, streamed),
# past it the sorted layout; the grouped test runs the few-pair cases in the sorted layout too
CASES = {
    "spread": dict(T=9, E=8, k=2),
    "every token to the same experts": dict(T=12, E=8, k=2, experts_used=[5, 2]),
    "experts with no token": dict(T=7, E=16, k=2, experts_used=[0, 3, 9, 15]),
    "one token": dict(T=1, E=8, k=3),
    "a few pairs, a tile each": dict(T=5, E=8, k=2),
    "a few pairs on the same experts": dict(T=6, E=8, k=2, experts_used=[3, 4]),
    # FP8 pairs' products stream K in tiles of up to 1024 (kernels.moe.PAIR_UP_BLOCK_K,
    # PAIR_DOWN_*): several tiles, the last ragged, and column blocks past N
    "two tokens, K in ragged tiles": dict(T=2, E=8, k=3, K=1100, I=600, D=72),
    "32-row tiles": dict(T=60, E=4, k=2),
    "64-row tiles": dict(T=112, E=4, k=2),
    "128-row tiles (prefill-sized)": dict(T=200, E=4, k=2),
    # 320 = 256 + 64 and 264 = 256 + 8 (bf16), 264 = 8 x 32 + 8 (fp32): the last column blocks
    # take narrower tiles
    "128-row tiles, narrow last column blocks": dict(T=200, E=4, k=2, I=320, D=264),
    "many pairs (aligned in two passes)": dict(T=600, E=4, k=2),
}


FEW_PAIRS = [name for name, c in CASES.items() if c["T"] * c["k"] <= moe.PAIR_TILES_MAX]


@pytest.mark.parametrize("case,layout",
                         [(name, "as chosen") for name in CASES] + [(name, "sorted") for name in FEW_PAIRS],
                         ids=[*CASES, *(f"{name}, sorted" for name in FEW_PAIRS)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_dense_reference(device, case, layout, dtype, monkeypatch):
    c = CASES[case]
    if layout == "sorted":  # a step of few pairs aligned as a wider step's are
        monkeypatch.setattr(moe, "PAIR_TILES_MAX", 0)
    T, E, k = c["T"], c["E"], c["k"]
    K, I, D = c.get("K", 32), c.get("I", 24), c.get("D", 32)
    idx, w = routing(T, E, k, experts_used=c.get("experts_used"))
    x = torch.randn(T, K).to(dtype)
    up, down = experts(E, I, K, D, dtype, "cpu")
    shared = torch.randn(T, D).to(dtype)
    ref = moe_experts_ref(x, idx, w, up, down, shared=shared)
    dev = [t.to(device) for t in (x, idx, w, up, down, shared)]
    out = poisoned((T, D), dtype, device)
    moe_experts.triton(*dev[:5], shared=dev[5], out=out)
    assert_close(out.cpu(), ref, dtype)
    # added into a residual stream in place
    residual = torch.randn(T, D).to(dtype)
    expect = moe_experts_ref(x, idx, w, up, down, shared=shared, residual=residual.clone())
    got = residual.to(device)
    moe_experts.triton(*dev[:5], shared=dev[5], residual=got)
    assert_close(got.cpu(), expect, dtype)


@pytest.mark.parametrize("case", ["one token", "a few pairs, a tile each", "two tokens, K in ragged tiles", "spread",
                                  "experts with no token", "128-row tiles, narrow last column blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_experts_equal_granite_math(device, case, dtype):
    """SwiGLU experts (Granite: up [E, 2I, K], the gate's rows first): the grouped path equals
    the dense reference, which equals HF's per-expert loop in fp32."""
    c = CASES[case]
    T, E, k = c["T"], c["E"], c["k"]
    K, I, D = c.get("K", 32), c.get("I", 24), c.get("D", 32)
    idx, w = routing(T, E, k, experts_used=c.get("experts_used"))
    x = torch.randn(T, K).to(dtype)
    up, _ = experts(E, 2 * I, K, D, dtype, "cpu")
    _, down = experts(E, I, K, D, dtype, "cpu", seed=1)
    ref = moe_experts_ref(x, idx, w, up, down, act="swiglu")
    out = poisoned((T, D), dtype, device)
    moe_experts.triton(*(t.to(device) for t in (x, idx, w, up, down)), out=out, act="swiglu")
    assert_close(out.cpu(), ref, dtype)
    if dtype == torch.float32:
        hf = torch.zeros(T, D)
        for t in range(T):
            for j in range(k):
                gate, up_half = (up[idx[t, j]] @ x[t]).chunk(2)
                hf[t] += w[t, j] * (down[idx[t, j]] @ (torch.nn.functional.silu(gate) * up_half))
        torch.testing.assert_close(ref, hf, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ["relu2", "swiglu"])
@pytest.mark.parametrize("block", [0, 16], ids=["fp8-column", "fp8-block16"])
@pytest.mark.parametrize("case", ["one token", "a few pairs, a tile each", "two tokens, K in ragged tiles", "spread",
                                  "128-row tiles, narrow last column blocks", "many pairs (aligned in two passes)"])
def test_fp8_experts_equal_the_dequantized_reference(device, case, block, act):
    """FP8 experts (per expert and column, or 16 x 16 blocks, ragged in I): the values enter the
    tensor cores in bf16 (or, for a token or two, CUDA cores' multiply-adds, SwiGLU in the up
    projections' kernel, the down projections and the combine one kernel) and their scales
    multiply the sums; the dense reference runs on the dequantized weights. With the shared
    expert's output, and added into a residual stream."""
    c = CASES[case]
    T, E, k = c["T"], c["E"], c["k"]
    K, I, D = c.get("K", 32), c.get("I", 24), c.get("D", 32)
    idx, w = routing(T, E, k, experts_used=c.get("experts_used"))
    x = torch.randn(T, K).to(torch.bfloat16)
    up, down = experts(E, I, K, D, torch.float32, "cpu")
    if act == "swiglu":
        up, _ = experts(E, 2 * I, K, D, torch.float32, "cpu", seed=2)
    up, down = quantize_fp8(up, block), quantize_fp8(down, block)
    dev = [t.to(device) for t in (x, idx, w, up, down)]
    ref = moe_experts_ref(x, idx, w, up, down, act=act)
    out = poisoned((T, D), torch.bfloat16, device)
    moe_experts.triton(*dev, out=out, act=act)
    assert_close(out.cpu(), ref, torch.bfloat16)
    shared, residual = torch.randn(T, D).to(torch.bfloat16), torch.randn(T, D)
    expect = moe_experts_ref(x, idx, w, up, down, shared=shared, residual=residual.clone(), act=act)
    got = residual.to(device)
    moe_experts.triton(*dev, shared=shared.to(device), residual=got, act=act)
    assert_close(got.cpu(), expect, torch.bfloat16)


@pytest.mark.parametrize("act", ["relu2", "swiglu"])
@pytest.mark.parametrize("block", [0, 32], ids=["fp8-column", "fp8-block32"])
@pytest.mark.parametrize("case", ["spread", "128-row tiles, narrow last column blocks",
                                  "many pairs (aligned in two passes)", "one token"])
def test_w8a8_experts_equal_the_reference_rounding_their_rows(device, case, block, act):
    """W8A8 (``w8a8=True``): the token rows and each pair's activations quantized per row, FP8
    on both sides of the tensor cores; equal to the dense reference that rounds the rows so, and
    within 10% (relative RMS) of the W8A16 reference (two e4m3 roundings of the activations, each
    about 3.6% of a value). A step of a few pairs streams the weights as before (no activations
    quantized): its result is the W8A16 one exactly."""
    torch.manual_seed(len(case) + block)
    c = CASES[case]
    T, E, k = c["T"], c["E"], c["k"]
    K, I, D = c.get("K", 32), c.get("I", 24), c.get("D", 32)
    idx, w = routing(T, E, k, experts_used=c.get("experts_used"))
    x = torch.randn(T, K).to(torch.bfloat16)
    up_n = 2 * I if act == "swiglu" else I
    up = quantize_fp8(experts(E, up_n, K, D, torch.float32, "cpu")[0], block)
    down = quantize_fp8(experts(E, I, K, D, torch.float32, "cpu", seed=1)[1], block)
    dev = [t.to(device) for t in (x, idx, w, up, down)]
    got = moe_experts.triton(*dev, act=act, w8a8=True).cpu()
    plain = moe_experts.triton(*dev, act=act).cpu()
    if T * k <= moe.PAIR_STREAM_MAX:
        assert torch.equal(got, plain)
        assert torch.equal(moe_experts_ref(x, idx, w, up, down, act=act, w8a8=True),
                           moe_experts_ref(x, idx, w, up, down, act=act))
        return
    assert_close(got, moe_experts_ref(x, idx, w, up, down, act=act, w8a8=True), torch.bfloat16)
    # the token rows quantized already (by the norm that made them): the same, to the bit; rows
    # that are not x's show they are read
    assert torch.equal(moe_experts.triton(*dev, act=act, w8a8=True, x_rows=quantize_rows.triton(dev[0])).cpu(), got)
    assert not torch.equal(moe_experts.triton(*dev, act=act, w8a8=True, x_rows=quantize_rows.triton(2 * dev[0])).cpu(),
                           got)
    w8a16 = moe_experts_ref(x, idx, w, up, down, act=act).float()
    assert ((got.float() - w8a16).norm() / w8a16.norm()).item() < 0.1


def test_w8a8_is_refused_where_it_does_not_run(device):
    """Asked of bf16 experts, of fp32 activations, or of FP8 blocks narrower than an FP8 tensor-core
    product's K tile (16: the GPU's compiler refused the kernel), W8A8 is an error that says so
    (the launcher and the reference alike), not a flag passed over; ``takes_w8a8`` says which run."""
    idx, w = routing(9, 8, 2)
    up, down = experts(8, 24, 32, 32, torch.bfloat16, "cpu")
    fp8_up, fp8_down = (quantize_fp8(t.float()) for t in (up, down))
    small_up, small_down = (quantize_fp8(t.float(), 16) for t in (up, down))
    assert moe.takes_w8a8(torch.bfloat16, fp8_up, fp8_down) and moe.takes_w8a8(torch.float16, fp8_up, fp8_down)
    assert not moe.takes_w8a8(torch.float32, fp8_up, fp8_down)
    assert not moe.takes_w8a8(torch.bfloat16, up, down)
    assert not moe.takes_w8a8(torch.bfloat16, small_up, small_down)
    for op in (moe_experts.triton, moe_experts_ref):
        with pytest.raises(ValueError, match="blocks of at least 32.*FP8 in blocks of 16 up"):
            op(torch.randn(9, 32).to(torch.bfloat16).to(device), idx.to(device), w.to(device), small_up.to(device),
               small_down.to(device), w8a8=True)
        with pytest.raises(ValueError, match="w8a8 needs FP8 experts.*torch.bfloat16 up"):
            op(torch.randn(9, 32).to(torch.bfloat16).to(device), idx.to(device), w.to(device), up.to(device),
               down.to(device), w8a8=True)
        with pytest.raises(ValueError, match="w8a8 needs FP8 experts.*torch.float32 x"):
            op(torch.randn(9, 32).to(device), idx.to(device), w.to(device), fp8_up.to(device), fp8_down.to(device),
               w8a8=True)


@pytest.mark.parametrize("case", ["spread", "128-row tiles (prefill-sized)"])
def test_grouped_gemms_without_the_tma_unit(device, case, monkeypatch):
    """The operands loaded through pointers, as on a GPU before Hopper, give the same result."""

    monkeypatch.setattr(moe, "_tma", lambda t: False)
    c = CASES[case]
    idx, w = routing(c["T"], c["E"], c["k"])
    x = torch.randn(c["T"], 32).to(torch.bfloat16)
    up, down = experts(c["E"], 24, 32, 32, torch.bfloat16, "cpu")
    ref = moe_experts_ref(x, idx, w, up, down)
    out = moe_experts.triton(*(t.to(device) for t in (x, idx, w, up, down)))
    assert_close(out.cpu(), ref, torch.bfloat16)


@pytest.mark.parametrize("T,routed_counts", [(5, False), (600, False), (9000, False), (5, True), (60, True), (600, True),
                                             (9000, True)],
                         ids=["one program", "two passes", "two passes, long blocks", "the routing's counts, few pairs",
                              "the routing's counts, a decode step's blocks", "the routing's counts",
                              "the routing's counts, many blocks"])
def test_pairs_take_their_expert_run_in_token_order(device, T, routed_counts):
    """The layout is a function of the routing: expert runs in expert order, each padded to the
    tile height, a run's pairs in token order; the slot table and its inverse agree. It is the
    same whether the alignment counts the pairs or takes the routing's counts."""

    E, k = 8, 2
    idx, _ = routing(T, E, k, seed=T, experts_used=[1, 2, 6])
    bm = block_m(T, k, E)
    block_counts = block_counts_ref(idx, E).to(device) if routed_counts else None
    slot_of_pair, token_of_slot, starts, counts = (t.cpu() for t in moe._align(idx.to(device), E, bm,
                                                                                     slot_count(T, k, E, bm),
                                                                                     block_counts=block_counts))
    flat = idx.flatten().long()
    assert counts.tolist() == torch.bincount(flat, minlength=E).tolist()
    padded = (counts + bm - 1) // bm * bm
    assert starts.tolist() == (torch.cumsum(padded, 0) - padded).tolist() + [int(padded.sum())]
    starts = starts[:E]
    order = torch.sort(flat, stable=True)[1]  # pairs by expert, then token
    rank = torch.arange(len(flat)) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    expect = torch.empty_like(slot_of_pair)
    expect[order] = (starts.long()[flat[order]] + rank).int()
    assert torch.equal(slot_of_pair, expect)
    assert torch.equal(token_of_slot[slot_of_pair.long()], torch.arange(len(flat)).int() // k)


def test_tile_height_follows_the_bucket():
    assert block_m(1, 6, 128) == 16 and block_m(256, 6, 128) == 16
    assert block_m(2048, 6, 128) == 128 and block_m(1024, 6, 128) == 32 and block_m(1365, 6, 128) == 64
    # P pairs, each used expert padded: the bound holds whatever the routing
    assert slot_count(1, 6, 128, 16) == 6 + 6 * 15
    assert slot_count(256, 6, 128, 16) == 1536 + 128 * 15


def test_a_narrow_last_column_block_takes_tiles_of_its_width():
    # Nemotron-3-Nano's experts at a 2048-token chunk: 1856 = 7 x 256 + 64, 2688 = 10 x 256 + 128
    assert moe._last_block_width(256, 1856) == 64 and moe._last_block_width(256, 2688) == 128
    # a width the tiles divide, a rest that only a whole tile covers, at least 16 columns, a
    # projection narrower than one tile
    assert moe._last_block_width(256, 512) == 0 and moe._last_block_width(256, 256 + 200) == 0
    assert moe._last_block_width(32, 264) == 16 and moe._last_block_width(256, 24) == 32


@settings(max_examples=12, deadline=None)
@given(T=st.integers(1, 24), E=st.sampled_from([4, 8, 16]), k=st.integers(1, 3), seed=st.integers(0, 1000),
       concentrated=st.booleans())
def test_random_routings_equal_the_dense_reference(T, E, k, seed, concentrated):
    """Any routing: spread, or piled on a few experts (leaving the rest empty)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    used = list(range(k)) if concentrated else None
    idx, w = routing(T, E, k, seed, experts_used=used)
    x = torch.randn(T, 16, generator=torch.Generator().manual_seed(seed))
    up, down = experts(E, 16, 16, 16, torch.float32, "cpu", seed)
    ref = moe_experts_ref(x, idx, w, up, down)
    out = moe_experts.triton(*(t.to(device) for t in (x, idx, w, up, down)))
    assert_close(out.cpu(), ref)


def test_runs_are_bit_identical(device):
    """No atomics: the same step gives the same bits."""
    T, E, k = 40, 16, 3
    idx, w = routing(T, E, k, seed=3)
    x = torch.randn(T, 32).to(torch.bfloat16)
    up, down = experts(E, 32, 32, 32, torch.bfloat16, "cpu")
    args = [t.to(device) for t in (x, idx, w, up, down)]
    first = moe_experts.triton(*args).clone()
    for _ in range(3):
        assert torch.equal(moe_experts.triton(*args), first)


def test_ops_dispatch_on_the_device():
    x = torch.randn(3, 16)
    gate, bias = torch.randn(4, 16), torch.zeros(4)
    idx, w = moe_route(x, gate, bias, top_k=2)
    assert torch.equal(idx, moe_route_ref(x, gate, bias, top_k=2)[0])
    up, down = experts(4, 8, 16, 16, torch.float32, "cpu")
    assert torch.equal(moe_experts(x, idx, w, up, down), moe_experts_ref(x, idx, w, up, down))
    with pytest.raises(ValueError, match="do not fit"):
        moe_route.triton(x, gate, bias, top_k=3, n_group=2, topk_group=1)
    # block counts of the wrong shape are refused by name, not read past their end
    with pytest.raises(ValueError, match="block_counts must be int32 \\[1, 4\\]"):
        moe_route.triton(x, gate, bias, top_k=2, block_counts=torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_counts must be int32"):
        moe_experts.triton(x, idx, w, up, down, block_counts=torch.zeros(2, 4, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True],
                         ids=["bf16", "fp8 (one token's down projections and combine one kernel)"])
@pytest.mark.parametrize("T", [1, 2, 8], ids=["pair tiles", "pair tiles, 2 rows", "sorted layout"])
def test_the_combine_waits_for_the_shared_expert_across_the_join(T, fp8):
    """Captured with programmatic launches, the combine depends on both streams' last kernels: it
    reads the shared expert's output only once the other stream has written it (here after a
    sleep of about a millisecond), and adds it into the residual as an unforked eager call does."""
    from mambastep.kernels.decode_linear import pdl_supported

    dev = torch.device("cuda")
    if not pdl_supported(dev):
        pytest.skip("programmatic dependent launch needs sm_90+ and a Triton that launches with it")
    E, K, I, D, k = 16, 256, 128, 256, 6
    idx, w = routing(T, E, k, seed=3)
    idx, w = idx.to(dev), w.to(dev)
    x = torch.randn(T, K, device=dev).to(torch.bfloat16)
    up, down = experts(E, I, K, D, torch.bfloat16, dev)
    if fp8:
        up, down = quantize_fp8(up.float()), quantize_fp8(down.float())
    shared_out = torch.randn(T, D, device=dev).to(torch.bfloat16)
    start = torch.randn(T, D, device=dev).to(torch.bfloat16)
    expect = moe_experts(x, idx, w, up, down, shared=shared_out, residual=start.clone())
    residual = start.clone()
    _replayed_beside_a_late_shared_expert(
        shared_out, lambda shared, ready: moe_experts(x, idx, w, up, down, shared=shared, residual=residual,
                                                      shared_ready=ready, pdl=True), lambda: residual.copy_(start))
    assert torch.equal(residual, expect)


def _replayed_beside_a_late_shared_expert(shared_out, call, reset):
    """``call(shared, ready)`` captured in a CUDA graph beside a side stream that writes the shared
    expert's output into ``shared`` after a sleep of about a millisecond (``ready``: that
    stream's event after it), compiled outside the capture; then ``shared`` poisoned, ``reset()``
    and the graph replayed once. Returns what the captured call returned."""
    dev = shared_out.device
    shared = torch.full_like(shared_out, float("nan"))
    side = torch.cuda.Stream(dev)

    def step():
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)
            shared.copy_(shared_out)
        ready = torch.cuda.Event()
        ready.record(side)
        return call(shared, ready)

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    shared.fill_(float("nan"))
    reset()
    graph.replay()
    torch.cuda.synchronize()
    return out
