"""The verify step's row moves (``kernels.replay``): exact copies, against their references."""

import pytest
import torch

from mambastep.kernels.replay import gather_rows, gather_rows_ref, scatter_rows, scatter_rows_ref
from support import poisoned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", [1, 37, 2100])
def test_gather_rows_reads_each_row_from_its_source(device, dtype, W):
    """Rows from ``a`` (src >= 0) and from ``b`` (src = -1 - row), row-strided sources, repeats."""
    a = torch.randn(6, W + 5, device=device).to(dtype)[:, 2 : 2 + W]
    b = torch.randn(4, W, device=device).to(dtype)
    src = torch.tensor([3, -1, -4, 0, 3, 5, -2, -1], dtype=torch.int32, device=device)
    out = poisoned((8, W), dtype, device)
    gather_rows.triton(a, b, src, out=out)
    expected = torch.stack([a[3], b[0], b[3], a[0], a[3], a[5], b[1], b[0]])
    assert torch.equal(out, expected)
    assert torch.equal(gather_rows_ref(a.cpu(), b.cpu(), src.cpu()), expected.cpu())
    # one source: a's rows only
    own = torch.tensor([5, 0, 2], dtype=torch.int64, device=device)
    assert torch.equal(gather_rows.triton(a, None, own), a[[5, 0, 2]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", [1, 1500])
def test_scatter_rows_writes_the_live_rows_and_leaves_the_rest(device, dtype, W):
    x = torch.randn(5, W + 3, device=device).to(dtype)[:, :W]
    dst = torch.tensor([2, -1, 0, -1, 5], dtype=torch.int32, device=device)
    out = torch.randn(7, W, device=device).to(dtype)
    expected = out.clone()
    expected[2], expected[0], expected[5] = x[0], x[2], x[4]
    ref = scatter_rows_ref(x.cpu(), dst.cpu(), out.cpu().clone())
    scatter_rows.triton(x, dst, out)
    assert torch.equal(out, expected) and torch.equal(ref, expected.cpu())


def test_row_moves_refuse_mismatched_rows():
    x = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="gather_rows: b must be"):
        gather_rows.triton(x, torch.zeros(2, 5), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="2 destinations for 3 rows"):
        scatter_rows.triton(x, torch.zeros(2, dtype=torch.int32), torch.zeros(4, 4))
