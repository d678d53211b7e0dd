"""The router (``kernels.moe_route``): logits, sigmoid and softmax top-k, group limits, block
counts, against HF's math, in Triton's interpreter on CPU and compiled on a GPU."""

import pytest
import torch

from mambastep.kernels import moe_route as route
from mambastep.kernels.moe_route import moe_route, moe_route_ref
from support import poisoned


@pytest.mark.parametrize("E,k,n_group,topk_group", [(8, 2, 1, 1), (16, 3, 4, 2), (128, 6, 1, 1)])
@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_hf_math(device, E, k, n_group, topk_group, T, dtype):
    g = torch.Generator().manual_seed(T + E)
    D = 40
    x = torch.randn(T, D, generator=g).to(dtype).to(device)
    gate = (torch.randn(E, D, generator=g) * 0.3).to(device)
    bias = (torch.randn(E, generator=g) * 0.05).to(device)
    kw = dict(top_k=k, n_group=n_group, topk_group=topk_group, norm_topk=True, scale=2.5)
    idx, w = moe_route.triton(x, gate, bias, **kw)
    ref_idx, ref_w = moe_route_ref(x.cpu(), gate.cpu(), bias.cpu(), **kw)
    assert torch.equal(idx.cpu(), ref_idx)  # the same experts, in ascending order
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-5, atol=1e-6)
    assert torch.allclose(w.sum(-1).cpu(), torch.full((T,), 2.5), rtol=1e-5)


BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("T,E,D,dtype,k", [
    # a decode step's few rows: the split logits kernel, wide enough rows for several chunks of D
    # with a ragged last one
    (1, 16, 700, BF16, 3), (3, 16, 700, BF16, 3), (16, 16, 700, BF16, 3),
    # more rows: the tensor-core kernel, split over D (three chunks, the last ragged) and tiled
    # over rows (a ragged last tile)
    (17, 16, 600, FP32, 6), (17, 16, 600, BF16, 6), (100, 128, 600, FP32, 6), (100, 128, 600, BF16, 6),
])
def test_router_logits_kernels_match_hf(device, T, E, D, dtype, k):
    """Both logits kernels give HF's experts and weights."""
    _assert_route_matches_hf(device, T, E, D, dtype, k, seed=T + E)


def _assert_route_matches_hf(device, T, E, D, dtype, k, seed):
    """The kernels' experts for random rows equal HF's, and their weights to fp32's accuracy."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype).to(device)
    gate = (torch.randn(E, D, generator=g) * 0.1).to(device)
    bias = (torch.randn(E, generator=g) * 0.05).to(device)
    kw = dict(top_k=k, n_group=1, topk_group=1, norm_topk=True, scale=2.5)
    idx, w = moe_route.triton(x, gate, bias, **kw)
    ref_idx, ref_w = moe_route_ref(x.cpu(), gate.cpu(), bias.cpu(), **kw)
    assert torch.equal(idx.cpu(), ref_idx)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-5, atol=1e-6)


def test_router_terms_sum_to_the_fp32_gate():
    """A bf16 router is one term; fp32 weights take up to three, and their fp32 sum is exact."""
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(16, 300, generator=g) * 0.1
    terms = route.router_terms(gate)
    assert terms.dtype == BF16 and terms.shape == (3, 16, 300)
    assert torch.equal(terms.float().sum(0), gate)
    assert route.router_terms(gate.to(BF16).float()).shape == (1, 16, 300)


@pytest.mark.parametrize("bf16_gate", [False, True], ids=["fp32 router, three terms", "bf16 router, one term"])
@pytest.mark.parametrize("T", [17, 100])
def test_router_logits_from_bf16_terms_match_hf(device, T, bf16_gate):
    """bf16 rows against the router's bf16 terms give HF's experts and weights, and the top-k
    kernel counts each block of tokens' pairs per expert."""
    g = torch.Generator().manual_seed(T)
    E, D, k = 128, 600, 6
    x = torch.randn(T, D, generator=g).to(BF16)
    gate = torch.randn(E, D, generator=g) * 0.1
    if bf16_gate:
        gate = gate.to(BF16).float()
    bias = torch.randn(E, generator=g) * 0.05
    kw = dict(top_k=k, n_group=1, topk_group=1, norm_topk=True, scale=2.5)
    counts = poisoned((-(-T // route.ROUTE_BLOCK_T), E), torch.int32, device)
    idx, w = moe_route.triton(x.to(device), gate.to(device), bias.to(device), **kw,
                              gate_terms=route.router_terms(gate).to(device), block_counts=counts)
    ref_idx, ref_w = moe_route_ref(x, gate, bias, **kw)
    assert torch.equal(idx.cpu(), ref_idx)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-5, atol=1e-6)
    assert torch.equal(counts.cpu(), route.block_counts_ref(ref_idx, E))


@pytest.mark.parametrize("programs", [2, 4], ids=["one chunk", "two chunks"])
def test_router_logits_split_capped_by_the_program_count(device, monkeypatch, programs):
    """Where the row tiles alone are about ``ROUTER_PROGRAMS`` programs (long prefill chunks),
    D is split into fewer chunks than its length allows; the logits' chunks still add up to HF's
    choice."""
    monkeypatch.setattr(route, "ROUTER_PROGRAMS", programs)  # 100 rows are two tiles of rows
    x = torch.zeros(100, 600, dtype=BF16, device=device)
    assert route._router_dot(x, torch.zeros(128, 600, device=device))[1] == programs // 2
    _assert_route_matches_hf(device, 100, 128, 600, BF16, 6, seed=programs)


def test_route_without_normalisation_keeps_the_scores(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 24, generator=g).to(device)
    gate, bias = (0.1 * torch.randn(8, 24, generator=g)).to(device), torch.zeros(8, device=device)
    _, w = moe_route.triton(x, gate, bias, top_k=2, norm_topk=False, scale=1.0)
    _, ref = moe_route_ref(x.cpu(), gate.cpu(), bias.cpu(), top_k=2, norm_topk=False)
    torch.testing.assert_close(w.cpu(), ref)
    assert (w < 1).all() and not torch.allclose(w.sum(-1), torch.ones(4, device=device))  # scores as they are


@pytest.mark.parametrize("E,k", [(8, 3), (64, 6), (72, 10)])
@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_route_matches_hf_granite(device, E, k, T, dtype):
    """Granite's router: the top-k of the logits in the model's dtype, weighted by their softmax,
    rounded so too, as HF's GraniteMoeHybrid computes them (both logits kernels: T <= 16 and past).
    In bf16 two logits may round to one value at the k-th place, and which of the two experts
    wins is then the sort's choice (torch's CPU top-k takes the later one): the chosen logits and
    weights are compared, not the expert ids."""
    g = torch.Generator().manual_seed(T + E)
    D = 40
    x = torch.randn(T, D, generator=g).to(dtype)
    gate = (torch.randn(E, D, generator=g) * 0.3).to(dtype)
    idx, w = moe_route.triton(x.to(device), gate.float().to(device), None, top_k=k, scoring="softmax")
    idx, w = idx.cpu().long(), w.cpu()
    assert (idx.diff(dim=-1) > 0).all()  # k distinct experts, in ascending order
    logits = torch.nn.functional.linear(x, gate).float()  # HF: in the model's dtype, then float
    top, hf_idx = logits.topk(k, dim=-1)
    hf_w = top.softmax(dim=-1).to(dtype).float()
    assert torch.equal(logits.gather(1, idx).sort(dim=-1).values, top.sort(dim=-1).values)
    torch.testing.assert_close(w.sort(dim=-1).values, hf_w.sort(dim=-1).values, rtol=1e-5, atol=1e-6)
    if dtype == torch.float32:  # no ties: the same experts
        assert torch.equal(idx, hf_idx.sort(dim=-1).values)
    with pytest.raises(ValueError, match="a softmax router takes no groups and no routed scale"):
        moe_route.triton(x.to(device), gate.float().to(device), None, top_k=k, scoring="softmax", scale=2.5)
    ref_idx, ref_w = moe_route_ref(x, gate.float(), None, top_k=k, scoring="softmax")
    assert torch.equal(logits.gather(1, ref_idx.long()).sort(dim=-1).values, top.sort(dim=-1).values)


@pytest.mark.parametrize("T,scoring", [(5, "sigmoid"), (16, "sigmoid"), (40, "sigmoid"), (16, "softmax")])
def test_rows_routed_as_another_take_its_experts_and_add_none(device, T, scoring):
    """route_as: a bucket's padding rows choose as a live row (here rows past the first three
    choose as row 1, with the block counts to match), over both logits kernels; the live rows
    are routed as without it."""
    g = torch.Generator().manual_seed(T)
    E, D, k = 16, 48, 3
    x = torch.randn(T, D, generator=g).to(device)
    gate = (torch.randn(E, D, generator=g) * 0.3).to(device)
    bias = None if scoring == "softmax" else (torch.randn(E, generator=g) * 0.05).to(device)
    route_as = torch.tensor([0, 1, 2] + [1] * (T - 3), dtype=torch.int32, device=device)
    counts = route.block_counts_buffer(T, E, device)
    idx, w = moe_route.triton(x, gate, bias, top_k=k, scoring=scoring, route_as=route_as, block_counts=counts)
    plain_idx, plain_w = moe_route.triton(x, gate, bias, top_k=k, scoring=scoring)
    ref_idx, ref_w = moe_route_ref(x.cpu(), gate.cpu(), None if bias is None else bias.cpu(), top_k=k, scoring=scoring,
                                   route_as=route_as.cpu())
    assert torch.equal(idx.cpu(), ref_idx)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=1e-5, atol=1e-6)
    assert torch.equal(idx[:3], plain_idx[:3]) and torch.equal(w[:3], plain_w[:3])
    assert (idx[3:] == idx[1]).all() and idx.unique().numel() == idx[:3].unique().numel()
    assert torch.equal(counts.cpu(), route.block_counts_ref(idx.cpu(), E))
    with pytest.raises(ValueError, match=r"route_as must be int32 \[%d\]" % T):
        moe_route.triton(x, gate, bias, top_k=k, scoring=scoring, route_as=route_as[:-1])
