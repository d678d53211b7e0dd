"""FP8 weights: quantizing, dequantizing, concatenating, and the linear over them."""

import pytest
import torch

from mambastep.kernels import fp8
from mambastep.kernels.fp8 import (
    FP8_MAX, Fp8Rows, Fp8Weight, fp8_linear, fp8_linear_ref, quantize_fp8, quantize_rows, quantize_rows_ref,
)
from support import assert_close, rel_err

BF16 = torch.bfloat16


@pytest.mark.parametrize("block", [0, 16, 128])
def test_quantize_round_trips_within_fp8_precision(block):
    """Every column (or block) scaled so its largest magnitude is FP8_MAX: the dequantized weight
    is within e4m3's rounding (3 mantissa bits) of the original, and an all-zero slice is exact."""
    torch.manual_seed(block)
    w = torch.randn(3, 37, 70)
    w[0, :5] = 0  # zero columns (and blocks)
    q = quantize_fp8(w, block)
    assert q.values.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    assert q.scale.shape == ((3, 37) if not block else (3, -(-37 // block), -(-70 // block)))
    assert q.values.float().abs().amax() <= FP8_MAX
    back = q.dequantize()
    assert torch.equal(back[0, :5], w[0, :5])
    assert ((back - w).abs() <= w.abs() * 2**-4 + q.expanded_scale() * 2**-9).all()


def test_cat_keeps_each_parts_scales():
    torch.manual_seed(1)
    parts = [quantize_fp8(torch.randn(n, 32) * (i + 1)) for i, n in enumerate((16, 8, 8))]
    merged = Fp8Weight.cat(parts)
    assert torch.equal(merged.dequantize(), torch.cat([p.dequantize() for p in parts]))
    blocks = [quantize_fp8(torch.randn(n, 32), 16) for n in (16, 32, 8)]
    assert torch.equal(Fp8Weight.cat(blocks).dequantize(), torch.cat([p.dequantize() for p in blocks]))
    with pytest.raises(ValueError, match="whole 16-row blocks"):
        Fp8Weight.cat([quantize_fp8(torch.randn(8, 32), 16), blocks[0]])


@pytest.mark.parametrize("K", [40, 5000])
def test_quantize_rows_dynamic_and_static(device, K):
    """Per token: each row's maximum maps to FP8_MAX (an all-zero row to zeros); static: one scale,
    the large rows saturated; the kernel as the reference, the values bit for bit."""
    torch.manual_seed(3)
    x = (torch.randn(4, K) * torch.tensor([[1.0], [10.0], [0.1], [0.0]])).to(BF16)
    q, s = quantize_rows.triton(x.to(device), None)
    rq, rs = quantize_rows_ref(x)
    assert torch.equal(s.cpu(), rs) and s.shape == (4, 1) and (q.cpu().float()[3] == 0).all()
    assert torch.equal(q.cpu().float(), rq.float())
    assert_close((rq.float() * rs)[:3], x[:3].float(), BF16, factor=4)
    static = torch.tensor(0.01)
    q, s = quantize_rows.triton(x.to(device), static.to(device))
    rq, rs = quantize_rows_ref(x, static)
    assert (s.cpu() == 0.01).all() and rq.float().abs().amax() == FP8_MAX
    assert torch.equal(q.cpu().float(), rq.float())


def test_quantize_rows_equals_its_reference_over_normed_rows(device):
    """Rows as a block norm hands them on (Nemotron-3-Nano's width, a weight spreading the
    columns' scales): the kernel's FP8 values are the reference's, each one, and so are the
    reference's own run on the device (torch on CUDA divides by a Python number through its
    reciprocal: the reference divides by a tensor, docs/experiments.md); the message names the
    elements that differ."""
    from mambastep.kernels.norm import rms_norm_ref

    torch.manual_seed(5)
    T, D = 6, 2688
    x = (torch.randn(T, D) * torch.tensor([[1.0], [30.0], [0.01], [3.0], [2.0], [1.0]])).to(BF16)
    h = rms_norm_ref(x, torch.randn(D).to(BF16), 1e-5)
    rq, rs = quantize_rows_ref(h)
    # the kernel, and the reference's torch ops on the device, against the reference on the CPU
    for what, (q, s) in (("kernel", quantize_rows.triton(h.to(device))), ("reference on the device",
                                                                          quantize_rows_ref(h.to(device)))):
        assert torch.equal(s.cpu(), rs), what
        diff = (q.cpu().float() != rq.float()).nonzero().tolist()
        assert not diff, f"{what} against the CPU's (row, column: value / scale, it, the CPU's): " + "; ".join(
            f"{r}, {c}: {(h[r, c].float() / rs[r, 0]).item():.9g}, {q[r, c].float().item()}, {rq[r, c].float().item()}"
            for r, c in diff[:8])


@pytest.mark.parametrize("M, K", [(600, 40), (600, 1856), (520, 5000)], ids=["short rows", "one tile", "two passes"])
def test_quantize_rows_in_one_pass_or_two_and_the_rows_in_use(device, M, K, monkeypatch):
    """A row of one tile is read once, a longer one twice; each row's scale is its own.
    ``row_end`` (a device scalar) bounds the rows written: those before it are the reference's,
    those past it keep what the launcher's buffers held (poisoned here)."""
    torch.manual_seed(4)
    x = (torch.randn(M, K) * torch.rand(M, 1) * 4).to(BF16)
    x[7] = 0.0
    rq, rs = quantize_rows_ref(x)
    q, s = quantize_rows.triton(x.to(device), None)
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu().float(), rq.float())

    class PoisonedEmpty:  # the fp8 module's torch, its new buffers poisoned
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*shape, dtype=None, device=None):
            return torch.full(shape, -1.0 if dtype == torch.float32 else 3.0, device=device).to(dtype)

    monkeypatch.setattr(fp8, "torch", PoisonedEmpty())
    end = 333
    q, s = quantize_rows.triton(x.to(device), None, torch.tensor(end, dtype=torch.int32, device=device))
    assert torch.equal(s.cpu()[:end], rs[:end]) and (s.cpu()[end:] == -1.0).all()
    assert (q.cpu().float()[end:] == 3.0).all()
    assert torch.equal(q.cpu().float()[:end], rq.float()[:end])


@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("M", [1, 37, 512])
def test_fp8_tensor_core_product_against_the_reference(M, static):
    """bf16 activations against column-scaled FP8 weights run on FP8 tensor cores, activations
    quantized per token (or with a static scale that covers them): within FP8 activation
    rounding of the W8A16 reference."""
    torch.manual_seed(M)
    dev = torch.device("cuda")
    K, N = 256, 336
    x = torch.randn(M, K, device=dev).to(BF16)
    w = quantize_fp8(torch.randn(N, K, device=dev) / K**0.5)
    if static:
        w = w._replace(input_scale=x.float().abs().amax() / FP8_MAX)
    b = torch.randn(N, device=dev).to(BF16)
    out = fp8_linear(x, w, b)
    ref = fp8_linear_ref(x.cpu(), w.to("cpu"), b.cpu())
    assert out.dtype == BF16 and out.shape == (M, N)
    assert rel_err(out.cpu(), ref) < 0.06  # e4m3 rounds each activation by up to 2^-4


def test_rows_are_checked_once_for_every_kernel_that_reads_or_writes_them():
    """``Fp8Rows.check``, which the norms, relu2, the FP8 product and the experts call: row-strided
    values pass; a wrong dtype, shape or layout of either tensor is named in one line."""
    e4m3 = torch.float8_e4m3fn
    Fp8Rows(torch.empty(4, 24, dtype=e4m3)[:, :16], torch.empty(4, 1)).check("op: rows", 4, 16)
    bad = {
        "values float32": Fp8Rows(torch.empty(4, 16), torch.empty(4, 1)),
        "values [4, 8]": Fp8Rows(torch.empty(4, 8, dtype=e4m3), torch.empty(4, 1)),
        "values column-strided": Fp8Rows(torch.empty(16, 4, dtype=e4m3).t(), torch.empty(4, 1)),
        "scales bf16": Fp8Rows(torch.empty(4, 16, dtype=e4m3), torch.empty(4, 1, dtype=BF16)),
        "scales [1, 4]": Fp8Rows(torch.empty(4, 16, dtype=e4m3), torch.empty(1, 4)),
        "scales strided": Fp8Rows(torch.empty(4, 16, dtype=e4m3), torch.empty(4, 2)[:, :1]),
    }
    for what, rows in bad.items():
        with pytest.raises(ValueError, match=r"^op: rows must be float8_e4m3fn values \[4, 16\]"):
            rows.check("op: rows", 4, 16)


@pytest.mark.gpu
def test_fp8_product_takes_its_rows_quantized_already_where_its_scales_are_dynamic():
    """``rows`` (x quantized by its producer) give the product it would have made itself, to the
    bit; rows that are not x's show that they are read. With a static input scale they are not."""
    torch.manual_seed(6)
    dev = torch.device("cuda")
    x = torch.randn(40, 256, device=dev).to(BF16)
    w = quantize_fp8(torch.randn(336, 256, device=dev) / 16)
    assert fp8.takes_rows(BF16, w) and not fp8.takes_rows(torch.float32, w)
    assert torch.equal(fp8_linear(x, w, rows=quantize_rows(x)), fp8_linear(x, w))
    other = quantize_rows(2 * x)
    assert not torch.equal(fp8_linear(x, w, rows=other), fp8_linear(x, w))
    static = w._replace(input_scale=x.float().abs().amax() / FP8_MAX)
    assert not fp8.takes_rows(BF16, static)
    assert torch.equal(fp8_linear(x, static, rows=other), fp8_linear(x, static))


@pytest.mark.gpu
def test_fp8_block_scaled_wide_product_is_exact_to_the_dequantized_weight():
    torch.manual_seed(4)
    dev = torch.device("cuda")
    x = torch.randn(64, 256, device=dev).to(BF16)
    w = quantize_fp8(torch.randn(200, 256, device=dev), 128)
    assert_close(fp8_linear(x, w).cpu(), fp8_linear_ref(x.cpu(), w.to("cpu")), BF16, factor=0.25)
