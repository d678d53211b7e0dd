import pytest
import torch

from mambastep.kernels.activation import relu2, relu2_ref, silu_mul, silu_mul_ref
from mambastep.kernels.fp8 import Fp8Rows, quantize_rows, quantize_rows_ref
from support import assert_close, poisoned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2047, 5000])
def test_relu2_matches_reference(device, dtype, n):
    x = torch.randn(n, device=device).to(dtype)
    out = poisoned((n,), dtype, device)
    relu2.triton(x, out)
    assert_close(out.cpu(), relu2_ref(x.cpu()), dtype)
    relu2.triton(x, x)  # in place
    assert torch.equal(x, out)


@pytest.mark.parametrize("rows_only", [False, True], ids=["out-too", "rows-only"])
@pytest.mark.parametrize("M, I", [(3, 40), (6, 1856), (4, 5000)])
def test_relu2_writes_its_rows_quantized_as_the_quantizer_would(device, M, I, rows_only):
    """``rows``: relu2 as without them (in place too) and each row quantized bit for bit as
    ``quantize_rows`` makes it of the output (a row all below zero: zeros); poisoned buffers. In
    chunks of 1024 columns, a program each (1856 and 5000 columns: a part chunk last); with
    ``rows_only`` the in-place input is left as it was."""
    torch.manual_seed(7)
    x = (torch.randn(M, I) * torch.linspace(0.01, 30.0, M)[:, None]).to(torch.bfloat16)
    x[1] = -x[1].abs()
    for act in (relu2.triton, relu2_ref):
        h = x.clone().to(device)
        rows = Fp8Rows(torch.full((M, I + 8), 3.0, device=device).to(torch.float8_e4m3fn)[:, :I],  # row-strided
                       torch.full((M, 1), -1.0, device=device))
        act(h, out=h, rows=rows, rows_only=rows_only)
        assert torch.equal(h.cpu(), x if rows_only and act is relu2.triton else relu2_ref(x))
        q, s = (quantize_rows.triton if act is relu2.triton else quantize_rows_ref)(relu2_ref(x).to(device))
        assert torch.equal(rows.scale.cpu(), s.cpu()) and torch.equal(rows.values.cpu().float(), q.cpu().float())
        assert (rows.values[1].cpu().float() == 0).all()
    with pytest.raises(ValueError, match="relu2: rows must be"):
        relu2.triton(x, rows=Fp8Rows.empty(M, I + 1, "cpu"))


def test_op_dispatches_on_the_device():
    """The public op runs the reference on CPU tensors; the launcher and the reference are reachable."""
    x = torch.randn(8)
    assert torch.equal(relu2(x), relu2_ref(x))
    assert relu2.reference is relu2_ref and callable(relu2.triton)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, I", [(1, 1), (3, 48), (5, 1500)])
def test_silu_mul_matches_reference_and_hf(device, dtype, T, I):
    """silu(gate) * up over [gate | up] rows, as HF's SwiGLU MLPs compute it (row-strided input)."""
    x = torch.randn(T, 2 * I + 3, device=device).to(dtype)[:, : 2 * I]
    out = poisoned((T, I), dtype, device)
    silu_mul.triton(x, out)
    ref = silu_mul_ref(x.cpu())
    assert_close(out.cpu(), ref, dtype)
    gate, up = x.cpu().chunk(2, dim=-1)
    assert_close(ref, torch.nn.functional.silu(gate) * up, dtype)
