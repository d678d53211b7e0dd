"""The verify step's row moves (``kernels.replay``): exact copies, against their references."""

import pytest
import torch

from mambastep.kernels.replay import gather_rows, gather_rows_ref, take_rows, take_rows_ref
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", [1, 1500])
def test_take_rows_takes_the_outputs_back_and_keeps_the_live_rows(device, dtype, W):
    """One launch: out[i] = y[own[i]] (out's rows all written), record[keep[i]] = x[i] where keep
    is live (the rest of the record as it was); widths apart."""
    y = torch.randn(9, W, device=device).to(dtype)
    own = torch.tensor([2, 3, 4, 8, 0], dtype=torch.int32, device=device)
    out = poisoned((5, W), dtype, device)
    x = torch.randn(5, W + 40, device=device).to(dtype)[:, 3 : 3 + W + 7]
    keep = torch.tensor([2, -1, 0, -1, 5], dtype=torch.int32, device=device)
    record = torch.randn(7, W + 7, device=device).to(dtype)
    expected = record.clone()
    expected[2], expected[0], expected[5] = x[0], x[2], x[4]
    ref_out, ref_record = torch.empty(5, W, dtype=dtype), record.cpu().clone()
    take_rows_ref(y.cpu(), own.cpu(), ref_out, x.cpu(), keep.cpu(), ref_record)
    take_rows.triton(y, own, out, x, keep, record)
    assert torch.equal(out, y[own.long()]) and torch.equal(record, expected)
    assert torch.equal(ref_out, y.cpu()[own.long().cpu()]) and torch.equal(ref_record, expected.cpu())


def test_row_moves_refuse_mismatched_rows():
    x = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="gather_rows: b must be"):
        gather_rows.triton(x, torch.zeros(2, 5), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="2 destinations and 3 rows for 3 rows of out"):
        take_rows.triton(x, torch.zeros(3, dtype=torch.int32), torch.zeros(3, 4), x, torch.zeros(2, dtype=torch.int32),
                         torch.zeros(4, 4))
