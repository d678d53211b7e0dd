"""A few rows against a weight read once, bf16 or FP8 (column or block scales), against the
dequantized weight's product."""

import pytest
import torch

from mambastep.kernels.few_rows import FEW_ROWS_MAX, few_rows_linear, few_rows_linear_ref
from mambastep.kernels.fp8 import quantize_fp8
from support import assert_close, poisoned

BF16 = torch.bfloat16


@pytest.mark.parametrize("weights", ["bf16", "fp8-column", "fp8-block16"])
@pytest.mark.parametrize("M", [1, 2, 17, FEW_ROWS_MAX])
def test_few_rows_match_the_reference(device, M, weights):
    torch.manual_seed(M)
    N, K = 70, 200  # a ragged last column block and K tile
    x = torch.randn(M, K + 8, device=device).to(BF16)[:, 4:4 + K]  # row-strided
    w = torch.randn(N, K, device=device) / K**0.5
    w = w.to(BF16) if weights == "bf16" else quantize_fp8(w, 16 if weights.endswith("block16") else 0)
    out = poisoned((M, N), BF16, device)
    few_rows_linear.triton(x, w, out=out, config=(32, 64, 4, 2))
    assert_close(out.cpu(), few_rows_linear_ref(x.cpu(), w.to("cpu")), BF16, factor=0.25)


def test_too_many_rows_raise(device):
    with pytest.raises(ValueError, match="M <= 64"):
        few_rows_linear.triton(torch.zeros(65, 32, device=device), torch.zeros(16, 32, device=device))
