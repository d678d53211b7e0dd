"""A block projection's entry: each weight kind and row count to its product, all equal to the
dequantized weight's product."""

import pytest
import torch

from mambastep.kernels.fp8 import fp8_linear_ref, quantize_fp8
from mambastep.kernels.linear import linear
from support import assert_close, rel_err

BF16 = torch.bfloat16


def test_plain_weights_take_f_linear():
    torch.manual_seed(2)
    x, w = torch.randn(5, 32), torch.randn(24, 32)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    q = quantize_fp8(w)
    assert torch.allclose(linear(x, q), x @ q.dequantize().T, atol=1e-5)


def test_fp8_products_take_quantized_rows_past_the_skinny_rows(monkeypatch):
    """``takes_rows``: on CUDA, FP8 weights scaled per column take their rows quantized past
    ``SKINNY_MAX_ROWS`` (the few-row products W8A8), or past ``FEW_ROWS_FP8_MAX`` where the few-row
    products widen the weights (``FEW_ROWS_W8A8`` off); never on the CPU or for plain weights."""
    from mambastep.kernels import linear as lin

    cuda, w = torch.device("cuda"), quantize_fp8(torch.randn(32, 64))
    assert [M for M in range(1, 12) if lin.takes_rows(M, BF16, cuda, w)] == list(range(3, 12))
    assert not lin.takes_rows(8, BF16, torch.device("cpu"), w)
    assert not lin.takes_rows(8, BF16, cuda, torch.randn(32, 64).to(BF16))
    monkeypatch.setattr(lin, "FEW_ROWS_W8A8", False)
    assert [M for M in range(1, 12) if lin.takes_rows(M, BF16, cuda, w)] == list(range(9, 12))


@pytest.mark.gpu
def test_plain_weights_take_the_few_row_product_up_to_its_rows_over_enough_columns(monkeypatch):
    """Up to ``FEW_ROWS_PLAIN_MAX`` rows (8, as by default), bf16 weights of at least
    ``FEW_ROWS_PLAIN_MIN_N`` columns (320 here) take the few-row product with the weight's rows as
    the 64-row side, its bias added; fewer columns, up to ``SHORT_SKINNY_MAX`` rows (4, as by
    default), the skinny decode projection; the rest cuBLAS."""
    from mambastep.kernels import linear as lin
    from mambastep.kernels.decode_linear import norm_linear
    from mambastep.kernels.few_rows import few_rows_linear

    monkeypatch.setattr(lin, "FEW_ROWS_PLAIN_MAX", 8)
    monkeypatch.setattr(lin, "FEW_ROWS_PLAIN_MIN_N", 320)
    monkeypatch.setattr(lin, "SHORT_SKINNY_MAX", 4)
    dev = torch.device("cuda")
    for N in (320, 256):
        w, b = torch.randn(N, 256, device=dev).to(BF16), torch.randn(N, device=dev).to(BF16)
        for M in (1, 4, 5, 8, 9):
            x = torch.randn(M, 256, device=dev).to(BF16)
            if M <= 8 and N >= 320:
                want = few_rows_linear(x, w, weight_rows=True).add_(b)
            elif M <= 4:
                want = norm_linear(x, None, 0.0, w, bias=b)
            else:
                want = torch.nn.functional.linear(x, w, b)
            assert torch.equal(linear(x, w, b), want)
            assert_close(linear(x, w, b).cpu(), torch.nn.functional.linear(x.float(), w.float(), b.float()).cpu(), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [3, 8, 64])
def test_few_fp8_rows_are_quantized_once_whoever_quantizes_them(M):
    """At 3-64 rows the product is the few-row W8A8 one whether x's maker handed it the rows or it
    made them itself: the same outputs either way."""
    from mambastep.kernels.fp8 import quantize_rows

    torch.manual_seed(M)
    dev = torch.device("cuda")
    x = torch.randn(M, 256, device=dev).to(BF16)
    w = quantize_fp8(torch.randn(320, 256, device=dev) / 16)
    assert torch.equal(linear(x, w), linear(x, w, rows=quantize_rows(x)))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [3, 8, 64, 65])
def test_fp8_weights_with_a_static_input_scale_quantize_their_rows_at_it(M):
    """A ModelOpt weight's static ``input_scale``: from 3 rows every row is quantized at it (not
    per token, and rows handed over are not read) for the FP8 tensor cores, the few-row W8A8
    product to 64 rows, then cuBLAS; within e4m3's rounding of each activation of the product of
    the dequantized weight."""
    from mambastep.kernels.few_rows import few_rows_linear
    from mambastep.kernels.fp8 import Fp8Weight, quantize_rows

    torch.manual_seed(M)
    dev = torch.device("cuda")
    x = torch.randn(M, 256, device=dev).to(BF16)
    q = quantize_fp8(torch.randn(320, 256, device=dev) / 16)
    w = Fp8Weight(q.values, q.scale, q.block, torch.tensor(x.float().abs().amax().item() / 448.0, device=dev))
    out = linear(x, w, rows=quantize_rows(x))
    static = quantize_rows(x, w.input_scale)
    if M <= 64:
        assert torch.equal(out, few_rows_linear(x, w, rows=static))
    assert torch.equal(out, linear(x, w))
    assert rel_err(out.cpu(), fp8_linear_ref(x.cpu(), w.to("cpu"))) < 0.06


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 8, 9, 64, 65, 300])
def test_fp8_weights_by_rows(M):
    """Up to 2 rows the FP8 values are read once and widened (skinny products; W8A16: bf16
    rounding of the sums only); past it the rows are quantized per token for the FP8 tensor cores
    (few-row tiles to 64 rows, then cuBLAS; within e4m3's rounding of each activation)."""
    torch.manual_seed(M)
    dev = torch.device("cuda")
    x = torch.randn(M, 256, device=dev).to(BF16)
    w = quantize_fp8(torch.randn(320, 256, device=dev) / 16)
    b = torch.randn(320, device=dev).to(BF16)
    out = linear(x, w, b)
    ref = fp8_linear_ref(x.cpu(), w.to("cpu"), b.cpu())
    if M <= 2:
        assert_close(out.cpu(), ref, BF16, factor=0.25)
    else:
        assert rel_err(out.cpu(), ref) < 0.06
