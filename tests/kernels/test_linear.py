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


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 8, 9, 300])
def test_fp8_weights_by_rows(M):
    """Up to 8 rows the FP8 values are read once and widened (skinny, then few-row products;
    W8A16: bf16 rounding of the sums only); past it the rows are quantized per token for the FP8
    tensor cores (within e4m3's rounding of each activation)."""
    torch.manual_seed(M)
    dev = torch.device("cuda")
    x = torch.randn(M, 256, device=dev).to(BF16)
    w = quantize_fp8(torch.randn(320, 256, device=dev) / 16)
    b = torch.randn(320, device=dev).to(BF16)
    out = linear(x, w, b)
    ref = fp8_linear_ref(x.cpu(), w.to("cpu"), b.cpu())
    if M <= 8:
        assert_close(out.cpu(), ref, BF16, factor=0.25)
    else:
        assert rel_err(out.cpu(), ref) < 0.06
