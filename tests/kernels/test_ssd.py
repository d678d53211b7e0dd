import math

import pytest
import torch

from mambastep.kernels.ssd import SSDWorkspace, ssd_scan, ssd_scan_chunked_torch, ssd_scan_ref
from mambastep.kernels.ssd_short import ssd_short_scan
from mambastep.kernels.varlen import PAD_SLOT_ID, PrefillMetadata
from support import assert_close, poisoned

# Small shapes: on CPU the Triton kernels run in the interpreter.
H, N, CHUNK = 4, 16, 16
N_SLOTS = 8


def make_inputs(T, *, H=H, P=16, N=N, G=2, dtype=torch.float32, softplus=True, device="cpu",
                seed=0, state_dtype=torch.float32):
    """Random scan inputs; x, z, B, C and dt are views into one wide in_proj-like buffer."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    HP, GN = H * P, G * N
    # [z | x | B | C | dt | 3 spare columns] so every view has a row stride wider than its row
    wide = torch.empty(T, 2 * HP + 2 * GN + H + 3)
    wide[:, : 2 * HP + 2 * GN] = r(T, 2 * HP + 2 * GN)
    raw_dt = torch.rand(T, H, generator=g)
    # softplus maps [-4, -1] to dt' in 0.02..0.3; without softplus dt itself must be positive
    wide[:, 2 * HP + 2 * GN : 2 * HP + 2 * GN + H] = raw_dt * 3 - 4 if softplus else raw_dt * 0.3
    wide = wide.to(device=device, dtype=dtype)
    cols = iter([HP, HP, GN, GN, H])
    views, start = [], 0
    for width in cols:
        views.append(wide[:, start : start + width])
        start += width
    z, x, B, C, dt = views
    return dict(
        x=x.view(T, H, P), dt=dt, A=-(torch.rand(H, generator=g) + 0.2).to(device),
        B=B.view(T, G, N), C=C.view(T, G, N), D=r(H).to(device), z=z.view(T, H, P),
        dt_bias=(torch.rand(H, generator=g) - 0.5).to(device),
        ssm_state=r(N_SLOTS, H, P, N).to(device=device, dtype=state_dtype),
    )


def scan(fn, inp, meta, *, use_z=True, use_D=True, use_bias=True, softplus=True,
         dt_limit=(0.0, math.inf), workspace=None):
    """Run one scan implementation on a copy of the pool; returns (out, pool after)."""
    x = inp["x"]
    T, Hh, P = x.shape
    pool = inp["ssm_state"].clone()
    out = poisoned(x.shape, x.dtype, x.device)
    if fn is ssd_scan.triton and workspace is None:
        workspace = SSDWorkspace.allocate(meta.max_chunks, Hh, P, inp["B"].shape[2], meta.chunk_size, x.device,
                                          x.dtype, groups=inp["B"].shape[1])
    if workspace is not None:
        for buf in (workspace.dt, workspace.dA_cumsum, workspace.starts, workspace.cb):
            buf.fill_(float("nan"))
    res = fn(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"] if use_D else None, pool,
             meta, z=inp["z"] if use_z else None, dt_bias=inp["dt_bias"] if use_bias else None,
             dt_softplus=softplus, dt_limit=dt_limit, out=out, workspace=workspace)
    assert res is out
    return out, pool


def check_pool(pool, ref_pool, before, live_slots, dtype):
    """Live slots close to the reference; every other slot bit-identical to before."""
    live = sorted(set(live_slots))
    assert_close(pool[live].float(), ref_pool[live].float(), dtype)
    other = [s for s in range(pool.shape[0]) if s not in live]
    assert torch.equal(pool[other], before[other])


# (name, options): lens, slots and has_initial_state per sequence, plus scan options
CASES = {
    "T1": dict(lens=[1], slots=[3], init=[1], G=1, use_z=False, use_D=False, use_bias=False),
    "chunk_edges": dict(lens=[15, 16, 17], slots=[0, 5, 2], init=[1, 0, 1], G=2, P=12),
    "mixed_pack": dict(lens=[3, 33, 1, 20], slots=[6, 1, 4, 7], init=[0, 1, 1, 0], G=4, P=20,
                       pad_tokens=5, extra_seqs=2),
    "one_group_no_init": dict(lens=[31, 9], slots=[2, 0], init=[0, 0], G=1, use_z=False),
    "no_softplus_limit": dict(lens=[18, 7], slots=[1, 3], init=[1, 1], G=4, softplus=False,
                              dt_limit=(0.02, 0.2), use_D=False),
    "chunk8": dict(lens=[8, 13], slots=[4, 5], init=[1, 0], G=2, chunk=8, P=20, use_bias=False),
    # 10 and 5 chunks: the state chain walks each sequence's chunks in one loop
    "many_chunks": dict(lens=[150, 70], slots=[3, 6], init=[1, 0], G=2),
    # chunks longer than the state chain's dot (two of its tiles a chunk, the last one ragged)
    "chunk64": dict(lens=[100, 40], slots=[2, 7], init=[0, 1], G=2, chunk=64),
}


def run_case(fn, name, dtype, device, state_dtype=torch.float32):
    c = dict(CASES[name])
    lens, slots, init = c.pop("lens"), c.pop("slots"), c.pop("init")
    T = sum(lens) + c.pop("pad_tokens", 0)
    meta = PrefillMetadata.build(lens, slots, init, chunk_size=c.pop("chunk", CHUNK), max_tokens=T,
                                 max_seqs=len(lens) + c.pop("extra_seqs", 0), device=device)
    softplus = c.get("softplus", True)
    inp = make_inputs(T, P=c.pop("P", 16), G=c.pop("G"), dtype=dtype, softplus=softplus,
                      device=device, state_dtype=state_dtype)
    out, pool = scan(fn, inp, meta, **c)
    ref_out, ref_pool = scan(ssd_scan_ref, inp, meta, **c)
    return out, pool, ref_out, ref_pool, inp["ssm_state"], slots, sum(lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(name, dtype, device):
    out, pool, ref_out, ref_pool, before, slots, total = run_case(ssd_scan.triton, name, dtype, device)
    assert_close(out.float(), ref_out.float(), dtype)
    assert (out[total:] == 0).all()
    check_pool(pool, ref_pool, before, slots, dtype)


SHORT_CASES = [n for n in CASES if n not in ("many_chunks", "chunk64")]  # the ones of a few dozen tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", SHORT_CASES)
def test_short_scan_matches_reference(name, dtype, device):
    """The token-by-token scan of short steps, to the same oracle: skipped sequences, padding,
    the dt clamp, no D, no z."""
    out, pool, ref_out, ref_pool, before, slots, total = run_case(ssd_short_scan.triton, name, dtype, device)
    assert_close(out.float(), ref_out.float(), dtype)
    assert (out[total:] == 0).all()
    check_pool(pool, ref_pool, before, slots, dtype)


def test_short_scan_snapshots_into_its_own_slot(device):
    """A verify sequence's checkpoint: the state after its first tokens into its own slot, its
    final state nowhere; beside it a sequence that keeps its final state as usual."""
    lens, slots, at = [9, 4], [2, 6], 3
    inp = make_inputs(sum(lens), G=2, device=device)
    meta = PrefillMetadata.build(lens, slots, [1, 1], snapshots=([2, -1], [at, 0]), final_slots=[PAD_SLOT_ID, 6],
                                 chunk_size=CHUNK, device=device)
    out, pool = scan(ssd_short_scan.triton, inp, meta)
    ref_out, ref_pool = scan(ssd_scan_ref, inp, meta)
    assert_close(out, ref_out)
    assert_close(pool[[2, 6]], ref_pool[[2, 6]])
    head = {k: (v[:at] if v.dim() >= 2 and k != "ssm_state" else v) for k, v in inp.items()}
    _, head_pool = scan(ssd_scan_ref, head, PrefillMetadata.build([at], [2], [1], chunk_size=CHUNK, device=device))
    assert_close(pool[2], head_pool[2])
    rest = [0, 1, 3, 4, 5, 7]
    assert torch.equal(pool[rest], inp["ssm_state"][rest])


def test_triton_bf16_state_pool(device):
    out, pool, ref_out, ref_pool, before, slots, _ = run_case(
        ssd_scan.triton, "mixed_pack", torch.bfloat16, device, state_dtype=torch.bfloat16)
    assert pool.dtype == torch.bfloat16
    assert_close(out.float(), ref_out.float(), torch.bfloat16)
    check_pool(pool, ref_pool, before, slots, torch.bfloat16)


@pytest.mark.parametrize("dtype,chunk", [(torch.float32, 64), (torch.bfloat16, 128)], ids=["fp32", "bf16"])
def test_triton_multiple_row_blocks(dtype, chunk, device):
    # several row tiles per chunk (16 rows in fp32, 64 in bf16, the scan's K tiles 32 wide): the
    # blocks below the diagonal, and C B^T tiles of another shape than the scan's
    lens, slots = [chunk + 6, 5], [1, 2]
    meta = PrefillMetadata.build(lens, slots, [1, 0], chunk_size=chunk, device=device)
    inp = make_inputs(sum(lens), P=16, G=2, dtype=dtype, device=device)
    out, pool = scan(ssd_scan.triton, inp, meta)
    ref_out, ref_pool = scan(ssd_scan_ref, inp, meta)
    assert_close(out.float(), ref_out.float(), dtype)
    check_pool(pool, ref_pool, inp["ssm_state"], slots, dtype)


@pytest.mark.parametrize("P, odd_max", [(80, 128), (80, 0), (96, 128), (144, 0)],
                         ids=["whole chain", "64-wide chain", "32-wide tail", "two blocks and a ragged one"])
def test_triton_head_dim_64_does_not_divide(P, odd_max, device, monkeypatch):
    """A head dim that 64 does not divide (Nemotron-Nano-9B-v2's 80): the state chain's programs
    take it in one 128-wide block (the columns past P masked) or in 64-wide ones, the last
    ragged; the scan's program takes 64 columns and the narrow tail past them (16 of 80's, 32 of
    96's); past 128 the scan runs in 64-wide blocks, the last ragged."""
    import mambastep.kernels.ssd as ssd

    monkeypatch.setattr(ssd, "CHAIN_ODD_P_MAX", odd_max)
    lens, slots = [40, 7], [5, 1]
    meta = PrefillMetadata.build(lens, slots, [1, 0], chunk_size=32, device=device)
    inp = make_inputs(sum(lens), H=2, P=P, G=1, dtype=torch.bfloat16, device=device)
    out, pool = scan(ssd_scan.triton, inp, meta)
    ref_out, ref_pool = scan(ssd_scan_ref, inp, meta)
    assert_close(out.float(), ref_out.float(), torch.bfloat16)
    check_pool(pool, ref_pool, inp["ssm_state"], slots, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_chunked_torch_matches_reference(name, dtype):
    out, pool, ref_out, ref_pool, before, slots, total = run_case(ssd_scan_chunked_torch, name, dtype, "cpu")
    # both compute in fp32 from the same inputs; only the output cast differs by dtype
    assert_close(out.float(), ref_out.float(), dtype)
    assert (out[total:] == 0).all()
    check_pool(pool, ref_pool, before, slots, torch.float32)


def test_public_scan_on_cpu_is_chunked_torch():
    lens, slots = [20, 5], [0, 1]
    meta = PrefillMetadata.build(lens, slots, [1, 0], chunk_size=CHUNK)
    inp = make_inputs(sum(lens))
    out, pool = scan(ssd_scan, inp, meta)
    ref_out, ref_pool = scan(ssd_scan_chunked_torch, inp, meta)
    assert torch.equal(out, ref_out) and torch.equal(pool, ref_pool)


def test_workspace_of_another_dtype_is_refused():
    """The start states are kept in the activations' dtype: a bf16 scan given a workspace made
    for fp32 would read them as the wrong type, so it says so instead."""
    lens = [20]
    meta = PrefillMetadata.build(lens, [0], [0], chunk_size=CHUNK)
    inp = make_inputs(sum(lens), dtype=torch.bfloat16)
    ws = SSDWorkspace.allocate(meta.max_chunks, H, 16, N, CHUNK, "cpu", torch.float32, groups=2)
    with pytest.raises(ValueError, match="workspace.starts .* dtype torch.bfloat16"):
        scan(ssd_scan.triton, inp, meta, workspace=ws)


@pytest.mark.parametrize("impl", ["triton", "chunked_torch", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_padding_is_inert(impl, dtype, device):
    fn = {"triton": ssd_scan.triton, "chunked_torch": ssd_scan_chunked_torch, "ref": ssd_scan_ref}[impl]
    if impl != "triton":
        device = "cpu"
    a_lens, b_lens = [9, 20], [9, 7, 20]
    # the plain pack: two sequences, nothing spare
    meta_a = PrefillMetadata.build(a_lens, [2, 5], [1, 0], chunk_size=CHUNK, device=device)
    inp_a = make_inputs(29, dtype=dtype, device=device)
    # the same two with a skipped sequence between them, pad tokens after and spare sequences;
    # everything nobody should read is NaN
    T = 29 + 7 + 11
    meta_b = PrefillMetadata.build(b_lens, [2, PAD_SLOT_ID, 5], [1, 1, 0], chunk_size=CHUNK,
                                   max_tokens=T, max_seqs=6, device=device)
    inp_b = make_inputs(T, dtype=dtype, device=device)
    for k in ("x", "dt", "B", "C", "z"):
        inp_b[k].fill_(float("nan"))
        inp_b[k][:9] = inp_a[k][:9]
        inp_b[k][16:36] = inp_a[k][9:29]
    for k in ("A", "D", "dt_bias", "ssm_state"):
        inp_b[k] = inp_a[k]

    out_a, pool_a = scan(fn, inp_a, meta_a)
    out_b, pool_b = scan(fn, inp_b, meta_b)
    assert torch.equal(out_b[:9], out_a[:9])
    assert torch.equal(out_b[16:36], out_a[9:29])
    assert (out_b[9:16] == 0).all() and (out_b[36:] == 0).all()
    assert torch.equal(pool_b, pool_a)
    other = [s for s in range(N_SLOTS) if s not in (2, 5)]
    assert torch.equal(pool_a[other], inp_a["ssm_state"][other])


@pytest.mark.parametrize("impl", ["triton", "chunked_torch"])
def test_chunked_prefill_equals_one_scan(impl, device):
    fn = ssd_scan.triton if impl == "triton" else ssd_scan_chunked_torch
    device = device if impl == "triton" else "cpu"
    L, cut = 45, 20
    inp = make_inputs(L, G=2, device=device)
    whole_out, whole_pool = scan(fn, inp, PrefillMetadata.build([L], [3], [1], chunk_size=CHUNK, device=device))

    first = {k: (v[:cut] if v.dim() >= 2 and k != "ssm_state" else v) for k, v in inp.items()}
    out1, pool1 = scan(fn, first, PrefillMetadata.build([cut], [3], [1], chunk_size=CHUNK, device=device))
    second = {k: (v[cut:] if v.dim() >= 2 and k != "ssm_state" else v) for k, v in inp.items()}
    second["ssm_state"] = pool1
    out2, pool2 = scan(fn, second, PrefillMetadata.build([L - cut], [3], [1], chunk_size=CHUNK, device=device))

    assert_close(torch.cat([out1, out2]), whole_out)
    assert_close(pool2, whole_pool)


@pytest.mark.parametrize("impl", ["triton", "chunked_torch", "ref"])
def test_a_snapshot_holds_the_state_of_its_prefix(impl, device):
    """A sequence with a snapshot slot leaves there the state after its first tokens (a chunk
    start, or its end): to the bit what a scan of those tokens alone leaves in its own slot; the
    sequences' own slots and every other slot are as without the snapshots."""
    fn = {"triton": ssd_scan.triton, "chunked_torch": ssd_scan_chunked_torch, "ref": ssd_scan_ref}[impl]
    device = device if impl == "triton" else "cpu"
    lens, slots, init = [45, 30], [3, 5], [1, 0]
    inp = make_inputs(sum(lens), G=2, device=device)
    # sequence 0 at its second chunk's end (32 tokens), sequence 1 at its end; a spare sequence
    snapshots = ([6, 7], [2 * CHUNK, 30])
    meta = PrefillMetadata.build(lens, slots, init, snapshots=snapshots, chunk_size=CHUNK, max_seqs=3, device=device)
    out, pool = scan(fn, inp, meta)
    plain_out, plain_pool = scan(fn, inp, PrefillMetadata.build(lens, slots, init, chunk_size=CHUNK, max_seqs=3,
                                                                device=device))
    prefix = {k: (v[: 2 * CHUNK] if v.dim() >= 2 and k != "ssm_state" else v) for k, v in inp.items()}
    _, prefix_pool = scan(fn, prefix, PrefillMetadata.build([2 * CHUNK], [3], [1], chunk_size=CHUNK, device=device))
    assert torch.equal(out, plain_out)
    assert torch.equal(pool[6], prefix_pool[3]) and torch.equal(pool[7], plain_pool[5])
    rest = [0, 1, 2, 3, 4, 5]
    assert torch.equal(pool[rest], plain_pool[rest])


@pytest.mark.parametrize("impl", ["triton", "chunked_torch", "ref"])
def test_a_snapshot_anywhere_is_a_resumed_scan(impl, device):
    """A snapshot off the chunk grid cuts the grid there: the sequence's outputs and final state
    are those of a scan of its tokens before the row and one resumed from that state after it,
    and the snapshot is the state at the row. The speculative use: the snapshot goes to the
    sequence's own slot and its final state nowhere (the drafts after the row may be rejected);
    sequence 1 keeps both in its slot as usual."""
    fn = {"triton": ssd_scan.triton, "chunked_torch": ssd_scan_chunked_torch, "ref": ssd_scan_ref}[impl]
    device = device if impl == "triton" else "cpu"
    lens, slots, init, at = [45, 7], [3, 5], [1, 1], 21
    inp = make_inputs(sum(lens), G=2, device=device)
    meta = PrefillMetadata.build(lens, slots, init, snapshots=([3, -1], [at, 0]), final_slots=[PAD_SLOT_ID, 5],
                                 chunk_size=CHUNK, max_seqs=3, device=device)
    out, pool = scan(fn, inp, meta)

    def part(rows, slot, state):
        piece = {k: (v[rows] if v.dim() >= 2 and k != "ssm_state" else v) for k, v in inp.items()}
        piece["ssm_state"] = state
        return scan(fn, piece, PrefillMetadata.build([rows.stop - rows.start], [slot], [1], chunk_size=CHUNK,
                                                     device=device))

    # the Triton kernels run the same chunks to the bit; torch's products round by shape
    same = torch.equal if impl == "triton" else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    head_out, head_pool = part(slice(0, at), 3, inp["ssm_state"])
    tail_out, tail_pool = part(slice(at, 45), 3, head_pool)
    seq1_out, seq1_pool = part(slice(45, 52), 5, inp["ssm_state"])
    assert same(out[:45], torch.cat([head_out, tail_out]))
    assert same(pool[3], head_pool[3])
    assert same(out[45:], seq1_out) and same(pool[5], seq1_pool[5])
    rest = [0, 1, 2, 4, 6, 7]
    assert torch.equal(pool[rest], inp["ssm_state"][rest])


def test_a_snapshot_outside_its_sequence_is_refused():
    with pytest.raises(ValueError, match="sequence 1: a snapshot after 31 of its 30 tokens"):
        PrefillMetadata.build([45, 30], [3, 5], [1, 0], snapshots=([6, 7], [32, 31]), chunk_size=CHUNK)


def test_reference_matches_hf():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    L, chunk = 37, 16
    inp = make_inputs(L, G=2, P=12)
    meta = PrefillMetadata.build([L], [4], [1], chunk_size=chunk)
    limit = (0.03, 0.25)
    out, pool = scan(ssd_scan_ref, inp, meta, use_z=False, dt_limit=limit)
    hf_out, hf_state = mamba2_chunk_scan(
        inp["x"][None], inp["dt"][None], inp["A"], inp["B"][None], inp["C"][None], chunk,
        D=inp["D"], dt_bias=inp["dt_bias"], initial_states=inp["ssm_state"][4][None],
        dt_softplus=True, dt_limit=limit, return_final_states=True,
    )
    assert_close(out, hf_out[0])
    assert_close(pool[4], hf_state[0])


# Full model shapes on the GPU (Nemotron-H-8B: H=128, P=64, N=128, G=8; Nemotron-Nano-v2: P=80)
GPU_CONFIGS = [
    # P, N, G, chunk, x dtype, state dtype
    (64, 128, 8, 128, torch.bfloat16, torch.float32),
    (64, 128, 8, 256, torch.bfloat16, torch.bfloat16),
    (80, 128, 8, 128, torch.bfloat16, torch.float32),
    (64, 64, 1, 256, torch.bfloat16, torch.float32),
    (80, 64, 1, 128, torch.float32, torch.float32),
    (64, 128, 8, 256, torch.float32, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("P,N,G,chunk,dtype,state_dtype", GPU_CONFIGS)
def test_gpu_full_shapes_match_reference(P, N, G, chunk, dtype, state_dtype):
    dev = "cuda"
    lens, slots, init = [1, 127, 128, 129, 700], [7, 0, 3, 5, 1], [1, 0, 1, 0, 1]
    T = sum(lens) + 40
    meta = PrefillMetadata.build(lens, slots, init, chunk_size=chunk, max_tokens=T, max_seqs=8, device=dev)
    inp = make_inputs(T, H=128, P=P, N=N, G=G, dtype=dtype, device=dev, state_dtype=state_dtype)
    out, pool = scan(ssd_scan.triton, inp, meta)
    ref_out, ref_pool = scan(ssd_scan_ref, inp, meta)
    assert_close(out.float(), ref_out.float(), dtype)
    assert (out[sum(lens):] == 0).all()
    check_pool(pool, ref_pool, inp["ssm_state"], slots, dtype if state_dtype == torch.float32 else torch.bfloat16)


@pytest.mark.gpu
def test_gpu_long_prompts_match_chunked_torch():
    dev = "cuda"
    lens, slots = [2048] * 4, [0, 1, 2, 3]
    meta = PrefillMetadata.build(lens, slots, [1, 0, 1, 0], chunk_size=256, device=dev)
    inp = make_inputs(sum(lens), H=128, P=64, N=128, G=8, dtype=torch.bfloat16, device=dev)
    out, pool = scan(ssd_scan.triton, inp, meta)
    ref_out, ref_pool = scan(ssd_scan_chunked_torch, inp, meta)
    assert_close(out.float(), ref_out.float(), torch.bfloat16)
    check_pool(pool, ref_pool, inp["ssm_state"], slots, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_graph_replay_allocates_nothing_and_never_syncs():
    dev = "cuda"
    T, chunk, Hh, P, Nn, G = 512, 128, 128, 64, 128, 8
    meta = PrefillMetadata.build([100, 300], [0, 1], [1, 0], chunk_size=chunk, max_tokens=T,
                                 max_seqs=4, device=dev)
    inp = make_inputs(T, H=Hh, P=P, N=Nn, G=G, dtype=torch.bfloat16, device=dev)
    ws = SSDWorkspace.allocate(meta.max_chunks, Hh, P, Nn, chunk, dev, torch.bfloat16, groups=G)
    out = torch.empty(T, Hh, P, dtype=torch.bfloat16, device=dev)
    pool = inp["ssm_state"].clone()

    def step():
        ssd_scan.triton(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], pool, meta,
                        z=inp["z"], dt_bias=inp["dt_bias"], out=out, workspace=ws)

    step()  # compile outside the checks
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_allocated() == allocated

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    pool.copy_(inp["ssm_state"])
    graph.replay()
    replay_out, replay_pool = out.clone(), pool.clone()
    pool.copy_(inp["ssm_state"])
    step()
    assert torch.equal(replay_out, out) and torch.equal(replay_pool, pool)


def test_short_scan_writes_rows_where_out_rows_says(device):
    """``out_rows``: a live sequence's row t to out's row out_rows[t] (< 0: nowhere), the skipped
    sequence's and padding rows nowhere, nothing zeroed (poisoned rows stay), states as without."""
    lens, slots = [4, 3, 2], [2, PAD_SLOT_ID, 6]
    T = sum(lens) + 2
    inp = make_inputs(T, G=2, device=device)
    meta = PrefillMetadata.build(lens, slots, [1, 0, 1], chunk_size=CHUNK, max_tokens=T, max_seqs=4, device=device)
    rows = torch.tensor([-1, 0, 1, 2, 3, 4, 5, -1, 6, 7, 8], dtype=torch.int32, device=device)
    out = poisoned((10, H, 16), device=device)
    pool = inp["ssm_state"].clone()
    res = ssd_short_scan.triton(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], pool, meta,
                                dt_bias=inp["dt_bias"], out=out, out_rows=rows)
    ref_out, ref_pool = scan(ssd_scan_ref, inp, meta, use_z=False)
    assert res is out
    written = [(1, 0), (2, 1), (3, 2), (8, 6)]  # (layout row, out row) of the live sequences' rows
    for t, o in written:
        assert_close(out[o], ref_out[t])
    assert torch.isnan(out[[3, 4, 5, 7, 8, 9]]).all()
    assert_close(pool[[2, 6]], ref_pool[[2, 6]])
    for fn in (ssd_short_scan.triton, ssd_short_scan.reference):
        with pytest.raises(ValueError, match="out_rows needs out"):
            fn(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], pool, meta, out_rows=rows)
