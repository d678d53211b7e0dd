import pytest
import torch

from mambastep.kernels.activation import relu2, relu2_ref, silu_mul, silu_mul_ref
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
