import pytest
import torch

from mambastep.kernels.activation import relu2_ref, relu2_triton
from mambastep.kernels.decode_ids import fill_decode_ids_ref, fill_decode_ids_triton
from mambastep.kernels.embedding import embed_rows_ref, embed_rows_triton
from support import assert_close, poisoned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2047, 5000])
def test_relu2_matches_reference(device, dtype, n):
    x = torch.randn(n, device=device).to(dtype)
    out = poisoned((n,), dtype, device)
    relu2_triton(x, out)
    assert_close(out.cpu(), relu2_ref(x.cpu()), dtype)
    relu2_triton(x, x)  # in place
    assert torch.equal(x, out)


def test_fill_decode_ids(device):
    slot_tokens = torch.tensor([10, 11, 12, 13, 99], device=device)
    slots = torch.tensor([2, -1, 0, 3, -1], dtype=torch.int32, device=device)
    ids = torch.tensor([-1, 0, 7, -1, -1], device=device)
    expect = fill_decode_ids_ref(ids.clone().cpu(), slots.cpu(), slot_tokens.cpu())
    assert expect.tolist() == [12, 0, 7, 13, 0]
    assert fill_decode_ids_triton(ids, slots, slot_tokens).cpu().tolist() == expect.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [24, 768, 1500])
def test_embed_rows(device, dtype, D):
    table = torch.randn(50, D, device=device).to(torch.bfloat16)
    ids = torch.tensor([3, 0, 49, 3], device=device)
    out = poisoned((4, D), dtype, device)
    embed_rows_triton(ids, table, out)
    expect = table.cpu()[ids.cpu()].to(dtype)
    assert torch.equal(out.cpu(), expect)
    assert torch.equal(embed_rows_ref(ids.cpu(), table.cpu(), torch.empty(4, D, dtype=dtype)), expect)


def test_embed_rows_takes_drawn_tokens(device):
    """A row whose id is -1 takes the token its slot drew last step, as fill_decode_ids would;
    a padding row (slot -1) takes token 0; ids stay as they are."""
    table = torch.randn(20, 24, device=device).to(torch.bfloat16)
    drawn = torch.tensor([10, 11, 12, 13, 19], device=device)
    slots = torch.tensor([2, -1, 0, 3, -1], dtype=torch.int32, device=device)
    ids = torch.tensor([-1, 0, 7, -1, -1], device=device)
    out = poisoned((5, 24), torch.float32, device)
    embed_rows_triton(ids, table, out, slots=slots, drawn=drawn)
    expect = table.cpu()[torch.tensor([12, 0, 7, 13, 0])].float()
    assert torch.equal(out.cpu(), expect)
    assert ids.cpu().tolist() == [-1, 0, 7, -1, -1]
    ref = embed_rows_ref(ids.cpu(), table.cpu(), torch.empty(5, 24), slots=slots.cpu(), drawn=drawn.cpu())
    assert torch.equal(ref, expect)
