import pytest
import torch

from mambastep.kernels.embedding import embed_rows, embed_rows_ref
from support import poisoned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [24, 768, 1500])
def test_embed_rows(device, dtype, D):
    table = torch.randn(50, D, device=device).to(torch.bfloat16)
    ids = torch.tensor([3, 0, 49, 3], device=device)
    out = poisoned((4, D), dtype, device)
    embed_rows.triton(ids, table, out)
    expect = table.cpu()[ids.cpu()].to(dtype)
    assert torch.equal(out.cpu(), expect)
    assert torch.equal(embed_rows_ref(ids.cpu(), table.cpu(), torch.empty(4, D, dtype=dtype)), expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_rows_scaled(device, dtype):
    """Granite's embedding multiplier: each row times the scale, rounded to the table's dtype as
    HF's product in that dtype, then cast to the residual's."""
    table = torch.randn(50, 40, device=device).to(torch.bfloat16)
    ids = torch.tensor([7, 49, 0], device=device)
    out = poisoned((3, 40), dtype, device)
    embed_rows.triton(ids, table, out, scale=12.0)
    expect = (table.cpu()[ids.cpu()] * 12.0).to(dtype)
    assert torch.equal(out.cpu(), expect)
    assert torch.equal(embed_rows_ref(ids.cpu(), table.cpu(), torch.empty(3, 40, dtype=dtype), scale=12.0), expect)


@pytest.mark.parametrize("prefill_rows", [0, 3])
def test_embed_rows_takes_drawn_tokens(device, prefill_rows):
    """Packed [prefill | decode] rows: a decode row whose id is -1 takes the token its slot drew
    last step; a padding decode row (slot -1) takes token 0; prefill rows keep their ids, even
    where a decode row's slot index would point; ids stay as they are."""
    table = torch.randn(20, 24, device=device).to(torch.bfloat16)
    drawn = torch.tensor([10, 11, 12, 13, 19], device=device)
    slots = torch.tensor([2, -1, 0, 3, -1], dtype=torch.int32, device=device)
    prefill = [5, 6, 1][:prefill_rows]
    ids = torch.tensor(prefill + [-1, 0, 7, -1, -1], device=device)
    T = len(ids)
    out = poisoned((T, 24), torch.float32, device)
    embed_rows.triton(ids, table, out, slots=slots, drawn=drawn)
    expect = table.cpu()[torch.tensor(prefill + [12, 0, 7, 13, 0])].float()
    assert torch.equal(out.cpu(), expect)
    assert ids.cpu().tolist() == prefill + [-1, 0, 7, -1, -1]
    ref = embed_rows_ref(ids.cpu(), table.cpu(), torch.empty(T, 24), slots=slots.cpu(), drawn=drawn.cpu())
    assert torch.equal(ref, expect)


def test_embed_rows_checks_its_arguments():
    table, ids = torch.randn(20, 8), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="together"):
        embed_rows(ids, table, torch.empty(2, 8), slots=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="last B rows"):
        embed_rows(ids, table, torch.empty(2, 8), slots=torch.zeros(3, dtype=torch.int32), drawn=torch.zeros(4))
