"""Kernel benchmarks: the device copy bandwidth (the memory ceiling), the selective state update
as achieved bandwidth against it, and the chunked SSD scan as time and TFLOP/s beside the plain
torch chunked implementation, at Nemotron-H-8B mamba shapes; the fused skinny projections of
the decode path beside norm + cuBLAS, at Mamba2-130M and Nemotron-H-8B shapes; and token
sampling per mode beside its torch ops, over a 50288-token vocabulary."""

from __future__ import annotations

import datetime
import sys

import torch
from tqdm import tqdm

# Nemotron-H-8B mamba mixer shapes (shared/DESIGN.md).
H, P, N, G, CHUNK = 128, 64, 128, 8, 128


def stamp() -> dict:
    """What every benchmark result starts with: the date, the device and torch's version."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return {"date": datetime.date.today().isoformat(), "device": device, "torch": torch.__version__}


def median_ms(fn, warmup_ms=25, rep_ms=100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def matmul_rate(n: int = 8192, settle_s: float = 2.0) -> tuple[float, float]:
    """bf16 matrix-multiply rate in FLOP/s (cuBLAS, n x n x n), the yardstick of compute floors:
    (sustained, from idle).

    The first is timed after ``settle_s`` seconds of GEMMs back to back, by when the board's
    power limit holds the SM clock where it stays (on one H200, from a second on: 1500-1545 MHz
    of 1980 at 688 W of 700). A benchmark's back-to-back prefill steps run under the same limit,
    so their FLOP floor uses this rate. The second is the first 125 ms from where the device
    stood, the rate a short burst gets; it depends on what ran before and on the machine
    (689-784 TFLOP/s on H200s whose sustained rate was 652-707; docs/experiments.md)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * n**3
    idle = flops / (median_ms(lambda: a @ b) * 1e-3)
    return flops / (median_ms(lambda: a @ b, warmup_ms=settle_s * 1e3) * 1e-3), idle


def bench_state_update(batch: int, state_dtype: torch.dtype, bandwidth: float) -> dict:
    from mambastep.kernels.state_update import selective_state_update

    dtype = torch.bfloat16
    dev = "cuda"
    # rotate over enough slots that the state pool is far larger than L2
    slots_total = max(4 * batch, 64)
    state = torch.randn(slots_total, H, P, N, device=dev).to(state_dtype)
    x = torch.randn(batch, H, P, device=dev, dtype=dtype)
    z = torch.randn(batch, H, P, device=dev, dtype=dtype)
    dt = torch.randn(batch, H, device=dev, dtype=dtype)
    A = -torch.rand(H, device=dev) - 0.5
    B = torch.randn(batch, G, N, device=dev, dtype=dtype)
    C = torch.randn(batch, G, N, device=dev, dtype=dtype)
    D = torch.randn(H, device=dev)
    dt_bias = torch.randn(H, device=dev)
    out = torch.empty_like(x)
    perms = [torch.randperm(slots_total, device=dev)[:batch].int() for _ in range(4)]
    it = iter(range(1 << 62))

    def step():
        slot_idx = perms[next(it) % len(perms)]
        selective_state_update(state, x, dt, A, B, C, D, slot_idx, z=z, dt_bias=dt_bias, out=out)

    ms = median_ms(step)
    es = state.element_size()
    nbytes = 2 * batch * H * P * N * es + batch * (3 * H * P + H + 2 * G * N) * x.element_size()
    return {
        "op": "state_update", "batch": batch, "state_dtype": str(state_dtype).removeprefix("torch."),
        "ms": ms, "GB/s": nbytes / (ms * 1e-3) / 1e9, "of_copy_bw": nbytes / (ms * 1e-3) / bandwidth,
    }


def _ssd_inputs(n_seqs: int, seq_len: int, dtype=torch.bfloat16):
    from mambastep.kernels.varlen import PrefillMetadata

    dev = "cuda"
    T = n_seqs * seq_len
    x = torch.randn(T, H, P, device=dev, dtype=dtype)
    dt = torch.randn(T, H, device=dev, dtype=dtype)
    A = -torch.rand(H, device=dev) - 0.5
    B = torch.randn(T, G, N, device=dev, dtype=dtype) / N**0.5
    C = torch.randn(T, G, N, device=dev, dtype=dtype) / N**0.5
    D = torch.randn(H, device=dev)
    z = torch.randn(T, H, P, device=dev, dtype=dtype)
    dt_bias = torch.randn(H, device=dev) - 2
    state = torch.randn(n_seqs, H, P, N, device=dev, dtype=dtype)
    meta = PrefillMetadata.build(
        [seq_len] * n_seqs, list(range(n_seqs)), [1] * n_seqs, chunk_size=CHUNK, device=dev
    )
    return dict(x=x, dt=dt, A=A, B=B, C=C, D=D, ssm_state=state, meta=meta, z=z, dt_bias=dt_bias)


def ssd_flops(tokens: int, chunk: int = CHUNK) -> float:
    """Matrix FLOPs of the chunked scan per token and head: C B^T and its product with x over a
    chunk (2 L N + 2 L P), the chunk state and the state-to-output product (2 P N each)."""
    return tokens * H * (2 * chunk * (N + P) + 4 * P * N)


def bench_ssd(n_seqs: int, seq_len: int) -> dict:
    from mambastep.kernels.ssd import SSDWorkspace, ssd_scan, ssd_scan_chunked_torch

    args = _ssd_inputs(n_seqs, seq_len)
    meta = args["meta"]
    ws = SSDWorkspace.allocate(meta.max_chunks, H, P, N, CHUNK, "cuda", args["x"].dtype, groups=G)
    out = torch.empty_like(args["x"])
    tri_ms = median_ms(lambda: ssd_scan.triton(**args, out=out, workspace=ws))
    torch_ms = median_ms(lambda: ssd_scan_chunked_torch(**args), warmup_ms=10, rep_ms=50)
    flops = ssd_flops(n_seqs * seq_len)
    return {
        "op": "ssd_scan", "shape": f"{n_seqs}x{seq_len}", "ms": tri_ms, "TFLOP/s": flops / tri_ms / 1e9,
        "torch_ms": torch_ms, "speedup": torch_ms / tri_ms,
    }


# Decode projections: (name, N, K, prologue: the block norm, the gated norm of G groups, or none)
SKINNY = (
    ("130M in_proj", 3352, 768, "norm"), ("130M out_proj", 768, 1536, "gated 1"), ("130M LM head", 50288, 768, "norm"),
    ("8B in_proj", 18560, 4096, "norm"), ("8B out_proj", 4096, 8192, "gated 8"), ("8B up_proj", 21504, 4096, "norm"),
    ("8B down_proj", 4096, 21504, "none"), ("8B LM head", 131072, 4096, "norm"),
)


def chain_us(fn, copies: int, reps: int = 48) -> float:
    """Per-call time of ``fn(i)`` replayed as a CUDA graph of ``reps`` back-to-back calls (as the
    decode step issues them), weights rotating over ``copies`` so L2 never holds them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i % copies)
    return median_ms(graph.replay) * 1e3 / reps


def bench_skinny(name: str, N: int, K: int, prologue: str, rows: int) -> dict:
    """One projection with its norm: norm kernel(s) + cuBLAS, against the fused skinny kernel
    without and with programmatic dependent launch."""
    from mambastep.kernels.decode_linear import gated_norm_linear, norm_linear
    from mambastep.kernels.norm import gated_rms_norm, rms_norm

    bf16, dev = torch.bfloat16, "cuda"
    copies = max(2, -(-256 * 2**20 // (N * K * 2)))
    weights = [torch.randn(N, K, device=dev).mul_(0.02).to(bf16) for _ in range(copies)]
    norm_w = torch.ones(K, device=dev, dtype=bf16)
    h = torch.empty(rows, K, device=dev, dtype=bf16)
    out = torch.empty(rows, N, device=dev, dtype=bf16)
    if prologue == "norm":
        x = torch.randn(rows, K, device=dev)

        def unfused(i):
            rms_norm(x, norm_w, 1e-5, out=h)
            torch.matmul(h, weights[i].t(), out=out)

        def fused(pdl):
            return lambda i: norm_linear(x, norm_w, 1e-5, weights[i], out=out, pdl=pdl)
    elif prologue == "none":  # a plain projection into the residual stream (down_proj, o_proj)
        y = torch.randn(rows, K, device=dev, dtype=bf16)
        residual = torch.randn(rows, N, device=dev)

        def unfused(i):
            torch.matmul(y, weights[i].t(), out=out)
            residual.add_(out)

        def fused(pdl):
            return lambda i: norm_linear(y, None, 1e-5, weights[i], residual=residual, pdl=pdl)
    else:  # Mamba2's gated norm before out_proj, and the residual add after it
        group = K // int(prologue.split()[1])
        y, z = (torch.randn(rows, K, device=dev, dtype=bf16) for _ in range(2))
        residual = torch.randn(rows, N, device=dev)

        def unfused(i):
            gated_rms_norm(y, z, norm_w, group, 1e-5, out=h)
            torch.matmul(h, weights[i].t(), out=out)
            residual.add_(out)

        def fused(pdl):
            return lambda i: gated_norm_linear(y, z, norm_w, group, 1e-5, weights[i], residual=residual, pdl=pdl)
    return {"op": "skinny", "name": name, "N": N, "K": K, "rows": rows, "unfused_us": chain_us(unfused, copies),
            "fused_us": chain_us(fused(False), copies), "fused_pdl_us": chain_us(fused(True), copies)}


def bench_sampling(rows: int, mode: str) -> dict:
    """One sampling call (``kernels.sample.sample``) against the same draw in torch ops."""
    from mambastep.kernels.sample import sample, sample_torch

    dev, V = "cuda", 50288
    logits = torch.randn(rows, V, device=dev) * 3
    params = (torch.full((rows,), 0.0 if mode == "greedy" else 0.8, device=dev),
              torch.zeros(rows, dtype=torch.int32, device=dev),
              torch.full((rows,), 0.95 if mode == "filtered" else 1.0, device=dev),
              torch.arange(rows, device=dev) * 7, torch.arange(rows, device=dev) + 100)
    out = torch.empty(rows, dtype=torch.int64, device=dev)
    return {"op": "sampling", "rows": rows, "mode": mode,
            "torch_us": chain_us(lambda i: sample_torch(logits, *params, mode=mode, out=out), 1, reps=8),
            "us": chain_us(lambda i: sample(logits, *params, mode=mode, out=out), 1, reps=8)}


def run() -> dict:
    torch.manual_seed(0)
    bw = copy_bandwidth()
    cases = [("state_update", b, dt) for dt in (torch.bfloat16, torch.float32) for b in (1, 8, 64, 256)]
    cases += [("ssd", n, l) for n, l in ((1, 223), (8, 2048), (64, 512))]
    cases += [("skinny", shape, r) for shape in SKINNY for r in (1, 2)]
    cases += [("sampling", r, m) for r in (1, 64, 256) for m in ("greedy", "sample", "filtered")]
    rows = []
    for kind, a, b in tqdm(cases, desc="kernel benchmarks", file=sys.stderr):
        if kind == "skinny":
            rows.append(bench_skinny(*a, rows=b))
        elif kind == "sampling":
            rows.append(bench_sampling(a, b))
        else:
            rows.append(bench_state_update(a, b, bw) if kind == "state_update" else bench_ssd(a, b))
    return {
        **stamp(), "copy_GB/s": bw / 1e9, "rows": rows,
    }


def _table(columns: list[str], rows, line) -> list[str]:
    """A markdown table: the header, then ``line(r)``'s cells for each of ``rows``."""
    out = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    return out + ["| " + " | ".join(line(r)) + " |" for r in rows]


def tables(result: dict) -> str:
    """The result's three tables in markdown, each under a line saying what it measures."""
    rows = result["rows"]

    def scan_line(r):
        if r["op"] == "state_update":
            return ["state update", f"B={r['batch']} {r['state_dtype']} state", f"{r['ms']:.4f}",
                    f"{r['GB/s']:.0f} GB/s ({100 * r['of_copy_bw']:.0f}% of copy)", "", ""]
        return ["SSD scan", f"{r['shape']} tokens", f"{r['ms']:.3f}", f"{r['TFLOP/s']:.1f} TFLOP/s",
                f"{r['torch_ms']:.2f} ms", f"{r['speedup']:.1f}x"]

    out = [f"{result['device']}, {result['date']}, torch {result['torch']}, "
           f"copy bandwidth {result['copy_GB/s']:.0f} GB/s (read + write)", "",
           f"Mamba2 kernels at Nemotron-H-8B shapes: H={H} P={P} N={N} G={G} chunk={CHUNK}, bf16 inputs", ""]
    out += _table(["op", "case", "time (ms)", "achieved", "baseline (torch)", "speed-up"],
                  [r for r in rows if r["op"] in ("state_update", "ssd_scan")], scan_line)
    out += ["", "Decode projections with their norms, per call in a CUDA graph of back-to-back calls (us)", ""]
    out += _table(["projection", "rows", "norm + cuBLAS", "fused", "fused, PDL", "speed-up"],
                  [r for r in rows if r["op"] == "skinny"],
                  lambda r: [f"{r['name']} {r['N']}x{r['K']}", str(r["rows"]), f"{r['unfused_us']:.2f}",
                             f"{r['fused_us']:.2f}", f"{r['fused_pdl_us']:.2f}",
                             f"{r['unfused_us'] / r['fused_pdl_us']:.2f}x"])
    out += ["", "Sampling, one call over 50288 logits a row, in a CUDA graph (us); filtered: top-p 0.95", ""]
    out += _table(["rows", "mode", "torch ops", "mambastep", "speed-up"], [r for r in rows if r["op"] == "sampling"],
                  lambda r: [str(r["rows"]), r["mode"], f"{r['torch_us']:.1f}", f"{r['us']:.1f}",
                             f"{r['torch_us'] / r['us']:.1f}x"])
    return "\n".join(out)


def print_table(result: dict) -> None:
    print("\n" + tables(result))
