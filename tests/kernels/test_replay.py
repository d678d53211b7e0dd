"""The verify step's row moves (``kernels.replay``): exact copies, against their references."""

import pytest
import torch

from mambastep.kernels.replay import (gather_rows, gather_rows_ref, replay_conv, replay_conv_ref, take_rows,
                                      take_rows_ref)
from mambastep.kernels.varlen import PrefillMetadata
from support import assert_close, poisoned


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
    meta = PrefillMetadata.build([3], [0], chunk_size=4)
    i = torch.zeros(3, dtype=torch.int32)
    conv = dict(weight=torch.zeros(3, 4), bias=None, conv_state=torch.zeros(1, 3, 3), meta=meta)
    with pytest.raises(ValueError, match="replay_conv: record must be \\[2, 4\\]"):
        replay_conv.triton(x, torch.zeros(2, 5), i, i, i, y=torch.zeros(3, 4), **conv)
    with pytest.raises(ValueError, match="y \\[3, at most 4\\]"):
        replay_conv.triton(x, torch.zeros(2, 4), i, i, i, y=torch.zeros(3, 6), **conv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K, D, bias", [(4, 300, True), (2, 40, False)])
def test_replay_conv_is_the_gather_the_conv_and_the_keep(device, dtype, K, D, bias):
    """One launch against the three it replaces (the reference): a verify layout (slot 3 replays
    its record rows 9, 10 and keeps its drafts there again, slot 1 replays row 3, slot 0 starts
    without a window, a skipped sequence, padding), the conv states' snapshot and final windows,
    the record's keep after its reads, y's rows that no live sequence holds zeroed, nothing
    else written (poisoned)."""
    H, Wy, S, stride = 5, 24, 5, 3
    W = D + H
    meta = PrefillMetadata.build([5, 2, 2, 1], [3, 1, 0, -1], [1, 1, 0, 0], snapshots=([3, -1, 0, -1], [3, 0, 1, 0]),
                                 final_slots=[-1, 1, -1, -1], chunk_size=4, max_tokens=16, max_seqs=5, device=device)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    src = i32([-10, -11, 0, 1, 2, -4, 3, 4, 5, 6] + [0] * 6)
    own, keep = i32([2, 3, 4, 6, 7, 8, 9, 10]), i32([-1, 9, 10, -1, -1, 0, -1, -1])
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, W + 6, generator=g).to(dtype).to(device)[:, 3 : 3 + W]
    record = torch.randn(S * stride, W, generator=g).to(dtype).to(device)
    state = torch.randn(S, K - 1, D, generator=g).to(dtype).to(device).transpose(1, 2)
    w = (torch.randn(D, K, generator=g) / K**0.5).to(dtype).to(device)
    b = torch.randn(D, generator=g).to(dtype).to(device) if bias else None
    y = poisoned((8, Wy), dtype, device)
    before = record.clone()
    ref_record, ref_state, ref_y = record.cpu().clone(), state.cpu().clone(), y.cpu().clone()
    cpu_b = None if b is None else b.cpu()
    ref = replay_conv_ref(a.cpu(), ref_record, src.cpu(), keep.cpu(), own.cpu(), w.cpu(), cpu_b, ref_state,
                          meta.to("cpu"), ref_y, out=poisoned((16, W), dtype))
    out = replay_conv.triton(a, record, src, keep, own, w, b, state, meta, y, out=poisoned((16, W), dtype, device))
    live = 9  # layout rows of live sequences; the skipped one's and padding rows are left
    assert_close(out[:live, :D].cpu(), ref[:live, :D], dtype)
    assert torch.equal(out[:live, D:].cpu(), ref[:live, D:]) and torch.isnan(out[live:]).all()
    assert torch.equal(record.cpu(), ref_record) and torch.equal(state.cpu(), ref_state)
    assert (y[6:] == 0).all() and torch.isnan(y[:6]).all() and torch.equal(y.cpu().isnan(), ref_y.isnan())
    # slot 3's replayed rows were read before its drafts' rows took their place in the record
    assert torch.equal(out[:2, D:], before[[9, 10], D:]) and torch.equal(record[[9, 10]], a[[1, 2]])


@pytest.mark.parametrize("K", [4, 3])
def test_replay_conv_over_a_layout_the_runtime_fills_with_long_sequences(device, K):
    """Sequences longer than a program's block of rows (``runtime.replay``'s layout: slot 2
    replays 6 kept rows before its 1 + 8 own, slot 0 replays 8 before 1 + 4), the checkpoint
    after the replayed rows and the last token, padding past them: as the reference."""
    import numpy as np

    from mambastep.graphs import Bucket
    from mambastep.runtime.plan import StepPlan
    from mambastep.runtime.step_buffers import StepBuffers

    buffers = StepBuffers(max_decode=4, max_prefill_tokens=32, max_prefill_seqs=4, chunk_size=4, max_drafts=8,
                          record_stride=8)
    bucket = Bucket(0, 32, 8)
    i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
    plan = StepPlan(prefill_tokens=np.arange(1, 15), prefill_lens=i32([9, 5]), prefill_slots=i32([2, 0]),
                    prefill_context=i32([40, 60]), snapshot_slots=i32([2, 0]), snapshot_tokens=i32([1, 1]),
                    final_slots=i32([-1, -1]), prefill_logits=i32([9, 5]), replay_lens=i32([6, 8]))
    buffers.fill(plan, bucket)
    host = buffers._replay(buffers.arena.np, bucket)
    meta = host.meta.to(device)
    src, own, keep = (torch.as_tensor(v).to(device) for v in (host.src, host.own, host.record))
    D, H, Wy, Tp, E = 70, 3, 33, 32, src.shape[0]
    W = D + H
    g = torch.Generator().manual_seed(1)
    a = torch.randn(Tp, W, generator=g).to(device)
    record = torch.randn(3 * 8, W, generator=g).to(device)
    state = torch.randn(3, D, K - 1, generator=g).to(device)
    w, b = torch.randn(D, K, generator=g).to(device), torch.randn(D, generator=g).to(device)
    y = poisoned((Tp, Wy), device=device)
    refs = [t.cpu().clone() for t in (record, state, y)]
    ref = replay_conv_ref(a.cpu(), refs[0], src.cpu(), keep.cpu(), own.cpu(), w.cpu(), b.cpu(), refs[1],
                          meta.to("cpu"), refs[2], out=poisoned((E, W)))
    out = replay_conv.triton(a, record, src, keep, own, w, b, state, meta, y, out=poisoned((E, W), device=device))
    live = 6 + 9 + 8 + 5
    assert_close(out[:live].cpu(), ref[:live])
    assert torch.isnan(out[live:]).all()
    assert torch.equal(record.cpu(), refs[0]) and torch.equal(state.cpu(), refs[1])
    assert (y[14:] == 0).all() and torch.isnan(y[:14]).all() and torch.equal(y.cpu().isnan(), refs[2].isnan())
