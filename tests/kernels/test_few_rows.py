"""A few rows against a weight read once, bf16 or FP8 (column or block scales), against the
dequantized weight's product."""

import pytest
import torch

from mambastep.kernels.few_rows import FEW_ROWS_MAX, few_rows_linear, few_rows_linear_ref
from mambastep.kernels.fp8 import Fp8Rows, quantize_fp8, quantize_rows_ref
from support import assert_close, poisoned

BF16 = torch.bfloat16


@pytest.mark.parametrize("weights", ["bf16", "bf16-weight-rows", "fp8-column", "fp8-block16"])
@pytest.mark.parametrize("M", [1, 2, 17, FEW_ROWS_MAX])
def test_few_rows_match_the_reference(device, M, weights):
    """Each weight kind's tiles, and bf16 weights with their rows as the tensor cores' 64-row side
    (``weight_rows``)."""
    torch.manual_seed(M)
    N, K = 70, 200  # a ragged last column block and K tile
    x = torch.randn(M, K + 8, device=device).to(BF16)[:, 4:4 + K]  # row-strided
    w = torch.randn(N, K, device=device) / K**0.5
    w = w.to(BF16) if weights.startswith("bf16") else quantize_fp8(w, 16 if weights.endswith("block16") else 0)
    out = poisoned((M, N), BF16, device)
    weight_rows = weights == "bf16-weight-rows"
    few_rows_linear.triton(x, w, out=out, config=(64 if weight_rows else 32, 64, 4, 2), weight_rows=weight_rows)
    assert_close(out.cpu(), few_rows_linear_ref(x.cpu(), w.to("cpu")), BF16, factor=0.25)


@pytest.mark.parametrize("M", [3, 8, 17])
def test_quantized_rows_meet_fp8_weights_in_the_fp8_tensor_cores(device, M):
    """``rows`` (W8A8): the rows' FP8 values and the weight's go into the tensor cores as stored, the
    sums scaled by row and column: equal, within fp32 rounding, to the product of the dequantized
    rows and weight; a zero row gives zeros."""
    torch.manual_seed(M)
    N, K = 70, 200
    x = torch.randn(M, K).to(BF16)
    x[1] = 0
    rows = quantize_rows_ref(x)
    w = quantize_fp8(torch.randn(N, K) / K**0.5)
    out = poisoned((M, N), BF16, device)
    few_rows_linear.triton(x.to(device), w.to(device), out=out, config=(64, 64, 4, 2),
                           rows=Fp8Rows(rows.values.to(device), rows.scale.to(device)))
    ref = few_rows_linear_ref(x, w, rows=rows)
    assert_close(out.cpu(), ref, BF16, factor=0.25)
    assert (out[1].cpu() == 0).all()
    # the rows' rounding is the reference's: it differs from the unquantized rows' product
    assert not torch.equal(ref, few_rows_linear_ref(x, w))


def test_weight_rows_need_plain_weights_of_the_rows_dtype():
    x = torch.randn(4, 64).to(BF16)
    for w, a in ((quantize_fp8(torch.randn(32, 64)), x), (torch.randn(32, 64), x), (torch.randn(32, 64), x.float())):
        with pytest.raises(ValueError, match="weight_rows needs plain weights of x's dtype"):
            few_rows_linear.triton(a, w, weight_rows=True)


def test_quantized_rows_need_column_scaled_fp8_weights_and_their_shape():
    x = torch.randn(4, 64).to(BF16)
    rows = quantize_rows_ref(x)
    for w, what in ((torch.randn(32, 64).to(BF16), "FP8 weights scaled per column"),
                    (quantize_fp8(torch.randn(32, 64), 32), "FP8 weights scaled per column"),
                    (quantize_fp8(torch.randn(32, 64)), None)):
        if what is None:  # the shape checked too
            with pytest.raises(ValueError, match="few_rows_linear: rows"):
                few_rows_linear.triton(x, w, rows=quantize_rows_ref(x[:3]))
        else:
            with pytest.raises(ValueError, match=what):
                few_rows_linear.triton(x, w, rows=rows)


def test_too_many_rows_raise(device):
    with pytest.raises(ValueError, match="M <= 64"):
        few_rows_linear.triton(torch.zeros(65, 32, device=device), torch.zeros(16, 32, device=device))


def test_weight_rows_stages_keep_the_grid_resident(monkeypatch):
    """On an H100's 132 SMs of 228 KiB: the 8B's in_proj (290 programs of 64 weight rows) takes 3
    stages, where 4 would leave it two waves, its out_proj (64 programs) 6, Nano's in_proj (161) 5,
    an LM head (2048 programs, many waves whatever the stages) the table's; off CUDA the table's."""
    from mambastep.kernels import few_rows

    cuda = torch.device("cuda")
    stages = lambda M, N, fp8: few_rows.weight_rows_config(M, N, fp8, cuda)[3]  # noqa: E731
    monkeypatch.setattr(few_rows, "_shared_memory", lambda device: (132, 228 * 1024))
    for fp8 in (True, False):
        assert [stages(4, N, fp8) for N in (18560, 4096, 10304, 131072)] == [3, 6, 5, 4]
    assert stages(32, 4096, True) == 6  # 96 rows' K tiles of 256 bytes: 144 KiB, one a program an SM
    assert few_rows.weight_rows_config(4, 18560, True, torch.device("cpu")) == few_rows.WEIGHT_ROWS_CONFIG[True]
