"""Skinny decode projections with fused prologues and epilogues, against the unfused references."""

import pytest
import torch

from mambastep.kernels import decode_linear
from mambastep.kernels.decode_linear import (
    MAX_ROWS, ConvTail, RopeTail, gated_norm_linear_ref, gated_norm_linear, norm_linear_ref, norm_linear,
)
from mambastep.kernels.activation import silu_mul_ref
from mambastep.kernels.fp8 import quantize_fp8
from mambastep.kernels.rope import rope, rope_inv_freq
from mambastep.kernels.varlen import PAD_SLOT_ID
from support import assert_close, poisoned

BF16 = torch.bfloat16


def _weights(N, K, device, bias):
    w = (torch.randn(N, K, device=device) / K**0.5).to(BF16)
    b = torch.randn(N, device=device).to(BF16) if bias else None
    return w, b


@pytest.fixture(params=[None, 16], ids=["tile", "loop"])
def tile_k(request):
    """Both ways through K at test sizes: the whole K as one tile (the table's choice), or K
    streamed in tiles of 16 columns (several of them, the last one ragged), as the large models'
    projections take it."""
    return request.param


def _cpu(t):
    return None if t is None else t.cpu().clone()


@pytest.mark.parametrize("M,K", [(1, 40), (3, 40)])
@pytest.mark.parametrize("round_first", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_linear_matches_reference(device, tile_k, M, K, round_first, bias):
    torch.manual_seed(M * K + bias)
    N = 37
    x = torch.randn(M + 2, K + 3, device=device)[:M, 1:1 + K]  # an fp32 residual, row-strided
    norm_w = torch.randn(K, device=device).to(BF16)
    w, b = _weights(N, K, device, bias)
    out = poisoned((M, N), BF16, device)
    norm_linear.triton(x, norm_w, 1e-5, w, bias=b, round_first=round_first, out=out, tile_k=tile_k)
    ref = norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-5, w.cpu(), bias=_cpu(b), round_first=round_first)
    assert_close(out.cpu(), ref, BF16, factor=0.25)


@pytest.mark.parametrize("M", [1, 3])
def test_unit_norm_is_folded_into_the_weight(device, M):
    """A norm weight folded into the projection's columns (``Model``'s fold_norms): the streamed
    product with ``unit_norm`` never reads the norm weight it is handed (NaNs here) and equals
    the checkpoint's norm and projection, to the rounding of the folded weight."""
    torch.manual_seed(40 + M)
    K, N = 72, 29
    x = torch.randn(M, K, device=device).to(BF16)
    norm_w = (1 + 0.3 * torch.randn(K, device=device)).to(BF16)
    w, b = _weights(N, K, device, True)
    folded = (w.float() * norm_w.float()).to(BF16)
    out = poisoned((M, N), BF16, device)
    nan_norm = torch.full((K,), float("nan"), device=device, dtype=BF16)
    norm_linear.triton(x, nan_norm, 1e-5, folded, bias=b, round_first=False, out=out, tile_k=16, unit_norm=True)
    ref = norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-5, w.cpu(), bias=b.cpu(), round_first=False)
    assert_close(out.cpu(), ref, BF16, factor=0.25)
    unfolded = norm_linear.triton(x, nan_norm, 1e-5, folded, bias=b, round_first=False, tile_k=16)
    assert unfolded.isnan().all()  # without the flag the weight is read


def test_logit_rows_and_fp32_out(device, tile_k):
    """Rows picked by index (the LM head over logit rows) and an fp32 destination."""
    torch.manual_seed(1)
    K, N = 48, 70
    x = torch.randn(6, K, device=device)
    norm_w = torch.randn(K, device=device).to(BF16)
    w, _ = _weights(N, K, device, False)
    rows = torch.tensor([4, 0, 5], device=device)
    out = poisoned((3, N), torch.float32, device)
    norm_linear.triton(x, norm_w, 1e-5, w, rows=rows, out=out, tile_k=tile_k)
    ref = norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-5, w.cpu(), rows=rows.cpu(), out=torch.empty(3, N))
    assert_close(out.cpu(), ref, BF16, factor=0.25)


@pytest.mark.parametrize("res_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("early", [False, True])
def test_residual_epilogue_adds_in_place(device, tile_k, res_dtype, early):
    """early: the residual read before the (programmatic launch) wait; the bias is, always."""
    torch.manual_seed(2)
    M, K, N = 4, 64, 24
    x = torch.randn(M, K, device=device).to(BF16)
    w, b = _weights(N, K, device, True)
    residual = torch.randn(M, N, device=device).to(res_dtype)
    res_ref = residual.cpu().clone()
    norm_linear.triton(x, None, 1e-5, w, bias=b, residual=residual, tile_k=tile_k, early=early)
    norm_linear_ref(x.cpu(), None, 1e-5, w.cpu(), bias=b.cpu(), residual=res_ref)
    assert_close(residual.cpu(), res_ref, res_dtype if res_dtype == BF16 else BF16, factor=0.25)


def test_relu2_epilogue(device, tile_k):
    torch.manual_seed(3)
    M, K, N = 2, 32, 40
    x = torch.randn(M, K, device=device).to(BF16)
    norm_w = torch.randn(K, device=device).to(BF16)
    w, _ = _weights(N, K, device, False)
    out = poisoned((M, N), BF16, device)
    norm_linear.triton(x, norm_w, 1e-5, w, relu2=True, out=out, round_first=False, tile_k=tile_k)
    ref = norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-5, w.cpu(), relu2=True, round_first=False)
    assert (out.cpu() >= 0).all()
    assert_close(out.cpu(), ref, BF16, factor=0.25)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("M,I", [(1, 20), (3, 9)])
def test_swiglu_epilogue(device, tile_k, M, I, fp8):
    """SwiGLU over [gate | up] rows: where K streams, in the projection's epilogue, each program
    pairing output column j's gate and up rows (I odd: a program's last pair past the edge;
    several programs); in one tile, ``silu_mul`` after the product."""
    torch.manual_seed(4 + M + I)
    K = 48
    x = torch.randn(M, K, device=device)
    norm_w = torch.randn(K, device=device).to(BF16)
    w, _ = _weights(2 * I, K, device, False)
    if fp8:
        w = quantize_fp8(w.float())
    out = poisoned((M, I), BF16, device)
    norm_linear.triton(x, norm_w, 1e-5, w, swiglu=True, out=out, tile_k=tile_k)
    ref = norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-5, w.to("cpu"), swiglu=True)
    assert ref.shape == (M, I)
    gate_up = norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-5, w.to("cpu"))
    assert torch.equal(ref, silu_mul_ref(gate_up))  # the reference is the two ops'
    # a product of two rounded products, each rounding differently where the sums' order does
    # (1.2% relative RMS over 3 x 9 FP8 outputs, streamed, on the H200)
    assert_close(out.cpu(), ref, BF16)


@pytest.mark.parametrize("M", [1, 4])
def test_conv_epilogue_updates_state_and_skips_pad_rows(device, tile_k, M):
    """in_proj with the conv decode update on the xBC columns: outputs and the mutated state."""
    torch.manual_seed(4 + M)
    K, lo, D, rest, S, W = 32, 20, 44, 6, 5, 4
    N = lo + D + rest
    x = torch.randn(M, K, device=device)
    norm_w = torch.randn(K, device=device).to(BF16)
    w, _ = _weights(N, K, device, False)
    conv_w = torch.randn(D, W, device=device).to(BF16)
    conv_b = torch.randn(D, device=device).to(BF16)
    # the pool layout: [S, K-1, D] stored, seen as [S, D, K-1]
    state = torch.randn(S, W - 1, D, device=device).to(BF16).transpose(1, 2)
    slots = torch.tensor([3, PAD_SLOT_ID, 0, 4][:M], dtype=torch.int32, device=device)
    state_ref = state.cpu().clone()
    out = poisoned((M, N), BF16, device)
    norm_linear.triton(x, norm_w, 1e-5, w, conv=ConvTail(state, conv_w, conv_b, slots, lo), out=out,
                       tile_k=tile_k)
    ref = norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-5, w.cpu(),
                          conv=ConvTail(state_ref, conv_w.cpu(), conv_b.cpu(), slots.cpu(), lo))
    assert_close(out.cpu(), ref, BF16, factor=0.25)
    assert_close(state.cpu(), state_ref, BF16, factor=0.25)
    untouched = [s for s in range(S) if s not in slots.tolist()]
    assert torch.equal(state.cpu()[untouched], state_ref[untouched])


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("lo,rotary,conv", [(32, 32, False), (48, 16, True), (20, 32, False)],
                         ids=["whole", "partial+conv", "unaligned"])
def test_rope_epilogue_rotates_queries_and_keys(device, monkeypatch, tile_k, M, lo, rotary, conv):
    """A QKV projection's query and key heads rotated in its epilogue, each row at its own
    position, beside the conv on other columns where asked: the reference's product, then
    ``rope``'s rotation. Where the kernel's column blocks tile the rotated dims (16 columns a
    program streamed, 2-4 in one tile) the rope kernel does not run; where they do not (an offset
    of 20 against 8 or 16 columns a program), it runs after the product."""
    torch.manual_seed(M + lo)
    K, Dh, qh, kh, S, W = 32, 32, 3, 2, 5, 4
    N = lo + (qh + kh + kh) * Dh  # conv columns (or any) first, then q, k, v
    x = torch.randn(M, K, device=device)
    norm_w = torch.randn(K, device=device).to(BF16)
    w, b = _weights(N, K, device, True)
    kv_lens = torch.tensor([7, 1, 300][:M], dtype=torch.int32, device=device)
    inv = rope_inv_freq(rotary, 1e4, device)
    tails, tails_ref = {}, {}
    if conv:
        state = torch.randn(S, lo, W - 1, device=device).to(BF16)
        conv_w = torch.randn(lo, W, device=device).to(BF16)
        slots = torch.tensor([3, 0, 4][:M], dtype=torch.int32, device=device)
        tails["conv"] = ConvTail(state, conv_w, None, slots, 0)
        tails_ref["conv"] = ConvTail(state.cpu().clone(), conv_w.cpu(), None, slots.cpu(), 0)
    launched = []
    monkeypatch.setattr(decode_linear.rotary, "rope", lambda *a, **k: launched.append(a) or rope(*a, **k))
    out = poisoned((M, N), BF16, device)
    norm_linear.triton(x, norm_w, 1e-5, w, bias=b, rope=RopeTail(inv, kv_lens, lo, qh, kh, Dh), out=out,
                       tile_k=tile_k, **tails)
    ref = norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-5, w.cpu(), bias=b.cpu(),
                          rope=RopeTail(inv.cpu(), kv_lens.cpu(), lo, qh, kh, Dh), **tails_ref)
    unrotated = norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-5, w.cpu(), bias=b.cpu())
    assert not torch.allclose(ref[:, lo:], unrotated[:, lo:])  # the rotation moved the heads
    assert_close(out.cpu(), ref, BF16, factor=0.25)
    if conv:
        assert_close(tails["conv"].state.cpu(), tails_ref["conv"].state, BF16, factor=0.25)
    block_n = decode_linear._config(M, N, K, x.device, tile_k).block_n
    assert bool(launched) == any(v % block_n for v in (lo, Dh, rotary))


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("G", [1, 2, 3])
@pytest.mark.parametrize("M", [1, 3])
def test_gated_norm_linear_into_residual(device, tile_k, G, M, early):
    """early: z and the residual read before the (programmatic launch) wait; same result."""
    torch.manual_seed(10 * G + M)
    K, N = 24 * G, 33
    wide = torch.randn(M, 2 * K + 5, device=device).to(BF16)
    y, z = wide[:, :K], wide[:, K + 5:]  # views into one projection row, as in the mixer
    norm_w = torch.randn(K, device=device).to(BF16)
    w, _ = _weights(N, K, device, False)
    residual = torch.randn(M, N, device=device)
    res_ref = residual.cpu().clone()
    gated_norm_linear.triton(y, z, norm_w, K // G, 1e-5, w, residual=residual, early=early, tile_k=tile_k)
    gated_norm_linear_ref(y.cpu(), z.cpu(), norm_w.cpu(), K // G, 1e-5, w.cpu(), residual=res_ref)
    assert_close(residual.cpu(), res_ref, BF16, factor=0.25)


@pytest.fixture(params=[0, 16], ids=["fp8-column", "fp8-block16"])
def fp8_block(request):
    """FP8 weights scaled per output column, or per 16 x 16 block (ragged at the edges here)."""
    return request.param


@pytest.mark.parametrize("M", [1, 3])
def test_fp8_weights_with_norm_and_conv(device, tile_k, fp8_block, M):
    """FP8 values streamed and scaled in registers: the norm prologue and the conv epilogue as
    with bf16 weights, against the dequantized weight's product, rounded to the activations'
    dtype (the norm weight's)."""
    torch.manual_seed(50 + M + fp8_block)
    K, lo, D, rest, S, W = 40, 12, 20, 5, 4, 4
    N = lo + D + rest
    x = torch.randn(M, K, device=device)
    norm_w = torch.randn(K, device=device).to(BF16)
    w = quantize_fp8(torch.randn(N, K, device=device) / K**0.5, fp8_block)
    conv_w = torch.randn(D, W, device=device).to(BF16)
    state = torch.randn(S, W - 1, D, device=device).to(BF16).transpose(1, 2)
    slots = torch.tensor([2, PAD_SLOT_ID, 0][:M], dtype=torch.int32, device=device)
    state_ref = state.cpu().clone()
    out = poisoned((M, N), BF16, device)
    norm_linear.triton(x, norm_w, 1e-5, w, conv=ConvTail(state, conv_w, None, slots, lo), out=out, tile_k=tile_k)
    ref = norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-5, w.to("cpu"),
                          conv=ConvTail(state_ref, conv_w.cpu(), None, slots.cpu(), lo))
    assert ref.dtype == BF16
    assert_close(out.cpu(), ref, BF16, factor=0.25)
    assert_close(state.cpu(), state_ref, BF16, factor=0.25)


@pytest.mark.parametrize("M", [1, 3])
def test_fp8_weights_gated_into_residual(device, tile_k, fp8_block, M):
    torch.manual_seed(60 + M + fp8_block)
    K, N, G = 48, 35, 2
    y, z = torch.randn(2, M, K, device=device).to(BF16)
    norm_w = torch.randn(K, device=device).to(BF16)
    w = quantize_fp8(torch.randn(N, K, device=device) / K**0.5, fp8_block)
    residual = torch.randn(M, N, device=device)
    res_ref = residual.cpu().clone()
    gated_norm_linear.triton(y, z, norm_w, K // G, 1e-5, w, residual=residual, tile_k=tile_k)
    gated_norm_linear_ref(y.cpu(), z.cpu(), norm_w.cpu(), K // G, 1e-5, w.to("cpu"), residual=res_ref)
    assert_close(residual.cpu(), res_ref, BF16, factor=0.25)


@pytest.mark.parametrize("row_tiles", [True, False], ids=["2-D tiles", "3-D tile"])
@pytest.mark.parametrize("weights", ["bf16", "fp8-column", "fp8-block16"])
@pytest.mark.parametrize("M", [1, 2])
def test_one_or_two_streamed_rows_in_either_tile(device, monkeypatch, M, row_tiles, weights):
    """One or two rows through K in tiles sum in 2-D tiles of the weight's layout
    (``ONE_ROW_TILES``, ``TWO_ROW_TILES``), or in the rows' 3-D one as more rows do: both equal
    the reference, with the norm prologue and into the residual."""
    monkeypatch.setattr(decode_linear, "ONE_ROW_TILES", row_tiles)
    monkeypatch.setattr(decode_linear, "TWO_ROW_TILES", row_tiles)
    torch.manual_seed(70 + 2 * M + row_tiles)
    K, N = 72, 37
    w = torch.randn(N, K, device=device) / K**0.5
    w = w.to(BF16) if weights == "bf16" else quantize_fp8(w, 16 if weights == "fp8-block16" else 0)
    x = torch.randn(M, K, device=device)
    norm_w = torch.randn(K, device=device).to(BF16)
    out = poisoned((M, N), BF16, device)
    norm_linear.triton(x, norm_w, 1e-5, w, out=out, tile_k=16)
    assert_close(out.cpu(), norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-5, w.to("cpu")), BF16, factor=0.25)
    h = torch.randn(M, K, device=device).to(BF16)
    residual = torch.randn(M, N, device=device)
    res_ref = residual.cpu().clone()
    norm_linear.triton(h, None, 1e-5, w, residual=residual, tile_k=16)
    norm_linear_ref(h.cpu(), None, 1e-5, w.to("cpu"), residual=res_ref)
    assert_close(residual.cpu(), res_ref, BF16, factor=0.25)


# on the GPU (slow in the interpreter) the one-row tiles of the presets' shapes too: a tall
# projection's, 16 columns a program (Nemotron-3-Nano's in_proj), 512-column tiles from K = 3072
# (its shared expert's down projection), a tall one whose K is not whole 1024-column tiles (9B-v2),
# a grid of 16 columns a program whose K is (Falcon-H1-7B's in_proj: 8 x 1024 tiles, 2 stages); and
# two rows' tiles in the joined tile: a tall projection over whole 1024-column K tiles (bf16 8 x 1024,
# FP8 32 x 256), many programs below K = 4096 (bf16 32 x 128: Nemotron-3-Nano's and Falcon-H1-7B's in_proj)
_GPU_SHAPES = [pytest.param(M, K, N, marks=pytest.mark.gpu)
               for M, K, N in ((1, 4096, 16400), (1, 2688, 10304), (1, 3712, 2688), (1, 4480, 22656), (1, 3072, 8728),
                               (2, 4096, 16400), (2, 2688, 10304), (2, 3072, 8728))]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("M,K,N", [(1, 2500, 20), (2, 4100, 20), (5, 2100, 24), *_GPU_SHAPES])
def test_default_config_at_large_k(device, M, K, N, fp8):
    """K past one tile takes the streamed path with the tile sizes the launcher picks (FP8
    weights' own at one row; bf16 rows' longer K tiles at 2-8, 5 of 8 rows masked in)."""
    torch.manual_seed(M)
    assert decode_linear._config(M, N, K, device, fp8=fp8).loop
    x = torch.randn(M, K, device=device)
    norm_w = torch.randn(K, device=device).to(BF16)
    w, _ = _weights(N, K, device, False)
    if fp8:
        w = quantize_fp8(w.float())
    out = poisoned((M, N), BF16, device)
    norm_linear.triton(x, norm_w, 1e-5, w, out=out)
    ref = norm_linear_ref(x.cpu(), norm_w.cpu(), 1e-5, w.to("cpu"))
    assert_close(out.cpu(), ref, BF16, factor=0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("K,N,normed", [(2048, 16384, True), (2048, 8512, True), (8192, 2048, False),
                                        (3072, 1536, False)])
def test_granite_one_row_tiles(device, K, N, normed):
    """One row at Granite-4.0-H's shapes, in the tiles the table picks there: K = 2048 as one
    register tile at any grid short of vocabulary-wide (micro's up_proj and in_proj), and short
    grids (down_proj, out_proj) 4 columns a program."""
    torch.manual_seed(K + N)
    cfg = decode_linear._config(1, N, K, device)
    assert (cfg.loop, cfg.block_n) == ((False, 8) if K == 2048 else (True, 4))
    x = torch.randn(1, K, device=device)
    norm_w = torch.randn(K, device=device).to(BF16) if normed else None
    w, _ = _weights(N, K, device, False)
    out = poisoned((1, N), BF16, device)
    norm_linear.triton(x, norm_w, 1e-5, w, out=out)
    ref = norm_linear_ref(x.cpu(), _cpu(norm_w), 1e-5, w.cpu())
    assert_close(out.cpu(), ref, BF16, factor=0.25)


def test_bad_inputs_raise(device):
    w, _ = _weights(8, 16, device, False)
    x = torch.randn(MAX_ROWS + 1, 16, device=device)
    with pytest.raises(ValueError, match="at most"):
        norm_linear.triton(x, None, 1e-5, w)
    with pytest.raises(ValueError, match="weight"):
        norm_linear.triton(x[:2, :8], None, 1e-5, w)
    with pytest.raises(ValueError, match="one epilogue"):
        norm_linear.triton(x[:2], None, 1e-5, w, relu2=True, residual=torch.zeros(2, 8, device=device))
    with pytest.raises(ValueError, match="even"):
        norm_linear.triton(x[:2], None, 1e-5, w[:7], swiglu=True)
    with pytest.raises(ValueError, match="divide"):
        gated_norm_linear.triton(x[:2], x[:2], w[0], 5, 1e-5, w)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    for fn in (norm_linear.triton, norm_linear_ref):  # the CPU path refuses what the kernel does
        with pytest.raises(ValueError, match="rope: an epilogue"):
            fn(x[:2], None, 1e-5, w, rope=RopeTail(rope_inv_freq(4, 1e4, device), lens, 0, 1, 1, 4),
               residual=torch.zeros(2, 8, device=device))
        with pytest.raises(ValueError, match="rope: heads over columns"):
            fn(x[:2], None, 1e-5, w, rope=RopeTail(rope_inv_freq(4, 1e4, device), lens, 4, 1, 1, 4))


@pytest.mark.gpu
def test_pdl_chain_in_a_graph_equals_plain_launches(tile_k):
    """A block-like chain (norm + projection, projection + residual add, norm + projection +
    relu2, gated norm + projection + residual add, norm + projection, norm + SwiGLU projection,
    projection + residual add), each kernel reading its predecessor's output, captured in a CUDA
    graph with programmatic dependent launch as the decode step runs it: bit for bit what plain
    launches give, on both ways through K (streamed, the gated norm is a kernel of its own in the
    chain)."""
    from mambastep.kernels.decode_linear import pdl_supported

    dev = torch.device("cuda")
    if not pdl_supported(dev):
        pytest.skip("programmatic dependent launch needs sm_90+ and a Triton that launches with it")
    torch.manual_seed(6)
    K = 256
    w = [_weights(K, K, dev, False)[0] for _ in range(5)]
    gate_up = _weights(2 * K, K, dev, False)[0]
    norm_w = torch.randn(K, device=dev).to(BF16)
    z = torch.randn(1, K, device=dev).to(BF16)
    start = torch.randn(1, K, device=dev)
    h = torch.empty(1, K, device=dev, dtype=BF16)

    def run(pdl):
        residual = start.clone()

        def block():
            norm_linear.triton(residual, norm_w, 1e-5, w[0], out=h, pdl=pdl, tile_k=tile_k)
            # the residual is two or more kernels back here, as o_proj's and the MLP's are
            norm_linear.triton(h, None, 1e-5, w[1], residual=residual, pdl=pdl, tile_k=tile_k, early=True)
            norm_linear.triton(residual, norm_w, 1e-5, w[2], relu2=True, out=h, pdl=pdl, tile_k=tile_k)
            gated_norm_linear.triton(h, z, norm_w, K // 2, 1e-5, w[3], residual=residual, pdl=pdl,
                                     tile_k=tile_k)
            norm_linear.triton(residual, norm_w, 1e-5, w[4], out=h, pdl=pdl, tile_k=tile_k)
            norm_linear.triton(residual, norm_w, 1e-5, gate_up, swiglu=True, out=h, pdl=pdl, tile_k=tile_k)
            norm_linear.triton(h, None, 1e-5, w[1], residual=residual, pdl=pdl, tile_k=tile_k, early=True)

        block()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            block()
        residual.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        return residual.clone(), h.clone()

    (res_pdl, h_pdl), (res_plain, h_plain) = run(True), run(False)
    assert torch.equal(res_pdl, res_plain)
    assert torch.equal(h_pdl, h_plain)
