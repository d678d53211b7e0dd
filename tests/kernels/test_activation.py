import pytest
import torch

from mambastep.kernels.activation import relu2, relu2_ref
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
