"""Compile kernels for Hopper (sm_90) without a GPU (the MoE kernels, with their TMA tiles, the
skinny projections' streamed path, the attention over a bf16 or FP8 cache, a Mamba2 prefill
chunk's scan and conv, a verify step's row moves, the per-token FP8 quantizer and the kernels
that quantize what they write): every launch a call makes is caught, its arguments turned into
the signature and specialisation the JIT would give them, and the kernel compiled to a cubin
instead of run, and ptxas asked what registers it takes. Run in a process of its own (the
interpreter must be off): ``python tests/kernels/hopper_compile.py``; prints a line per kernel
variant, exits 1 if any fails to compile or spills registers (a variant that spills is slow on
the GPU, which a CPU run would never show). ``test_hopper_compile.py`` runs it. With
``--loops``, each variant's largest loop (its K loop) is read from the SASS too: instructions,
byte-wide shared-memory loads and the most frequent opcodes (docs/experiments.md: how a tile's
layout fed the FP8 weights a byte a load)."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

TARGET = GPUTarget("cuda", 90, 32)
LOOPS = "--loops" in sys.argv
OPTIONS = ("num_warps", "num_stages", "launch_pdl")
compiled: set = set()
failed: list[str] = []


def _aligned(v) -> bool:
    """Whether the JIT would mark the argument divisible by 16 (pointers and integers)."""
    if isinstance(v, torch.Tensor):
        return v.data_ptr() % 16 == 0
    return isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0


def _compile_instead(self, *args, grid, warmup, **kwargs):
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTIONS}
    if "UPCAST" in kwargs:
        # the SSD kernels' dots upcast bf16 operands only for the interpreter (CPU tensors, as
        # here); compile the variant a GPU runs
        kwargs["UPCAST"] = False
    bound = dict(zip([p.name for p in self.params], args), **kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(self.params):
        v = bound[p.name] if p.name in bound else p.default
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", v
            continue
        if isinstance(v, int) and not isinstance(v, bool) and v == 1 and not p.do_not_specialize:
            signature[p.name], constexprs[p.name] = "constexpr", 1  # the JIT's specialisation of 1
            continue
        signature[p.name] = "i1" if isinstance(v, bool) else mangle_type(v)
        if _aligned(v) and not p.do_not_specialize:
            attrs[(i,)] = [["tt.divisibility", 16]]
    key = (self.fn.__name__, str(signature), str(constexprs), str(options))
    if key in compiled:
        return None
    compiled.add(key)
    name = f"{self.fn.__name__} {options} {', '.join(f'{k}={v}' for k, v in constexprs.items())}"
    try:
        kernel = triton.compile(ASTSource(fn=self, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=TARGET, options=options)
    except Exception as e:  # noqa: BLE001 - every failure is reported by name
        failed.append(name)
        print("FAIL", name, f"{type(e).__name__}: {e}", flush=True)
        return None
    regs, spilled = _registers(kernel.asm["ptx"])
    if spilled:
        failed.append(name)
    shared = kernel.metadata.shared
    print("FAIL" if spilled else "ok  ",
          f"{regs:3d} registers, {spilled} bytes spilled, {shared // 1024:3d} KiB shared:", name, flush=True)
    if LOOPS:
        print("     ", _loop_mix(kernel.asm["cubin"]), flush=True)
    return None


def _loop_mix(cubin: bytes) -> str:
    """The kernel's largest loop in its SASS (the longest span a backward branch closes): its
    instructions, its byte-wide shared-memory loads (``LDS.U8``: a tile read a byte at a time)
    and its most frequent opcodes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(sass) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    spans = [(labels[m.group(1)], i) for i, line in enumerate(sass)
             if (m := re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)) and labels.get(m.group(1), i) < i]
    if not spans:
        return "no loop"
    lo, hi = max(spans, key=lambda span: span[1] - span[0])
    ops = [m.group(2) for line in sass[lo:hi + 1]
           if (m := re.search(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line))]
    counts = collections.Counter(op.split(".")[0] for op in ops)
    top = ", ".join(f"{op} {n}" for op, n in counts.most_common(8))
    return f"loop: {len(ops)} instructions, {ops.count('LDS.U8')} LDS.U8; {top}"


def _registers(ptx: str) -> tuple[int, int]:
    """Registers a thread uses and bytes it spills, as ptxas reports them for sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        done = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True)
    report = done.stdout + done.stderr
    regs = max(int(n) for n in re.findall(r"Used (\d+) registers", report))
    spilled = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))
    return regs, spilled


def launch_moe() -> None:
    """Every MoE path: routing of a few rows and of more, on tensor cores (TF32 x 3, or one and
    three bf16 terms of the router, the top-k counting its blocks' pairs); the pair tiles, 16-row
    grouped tiles with the one-program align, and 128-row TMA tiles with the two-pass align (or the
    routing's counts and one pass), the up projection's last column block in narrower tiles (320 =
    256 + 64); bf16 SwiGLU experts of one and two tokens, FP8 ones (the pair stream), and W8A8 ones
    in the sorted layout (FP8 scaled per column, in 128 x 128 blocks and in the narrowest blocks
    it takes, 32); each with and without PDL."""
    from mambastep.kernels import moe, moe_route as route
    from mambastep.kernels.fp8 import quantize_fp8

    D, E, I = 256, 16, 320
    gate, bias = torch.randn(E, D), torch.zeros(E)
    up = torch.empty(E, I, D, dtype=torch.bfloat16)
    down = torch.empty(E, D, I, dtype=torch.bfloat16)
    for T, k in ((1, 6), (16, 6), (64, 6), (40, 2), (1200, 2)):  # pairs, pairs, 16-row, 16-row, 128-row tiles
        x = torch.randn(T, D).to(torch.bfloat16)
        for pdl in (False, True):
            route.moe_route.triton(x, gate, bias, top_k=k, pdl=pdl)
            counts = route.block_counts_buffer(T, E, "cpu")
            for terms in (route.router_terms(gate), route.router_terms(gate.to(torch.bfloat16).float())):
                route.moe_route.triton(x, gate, bias, top_k=k, gate_terms=terms, block_counts=counts, pdl=pdl)
            # as the model routes: padding rows as the first live one
            route.moe_route.triton(x, gate, bias, top_k=k, block_counts=counts, pdl=pdl,
                                   route_as=torch.zeros(T, dtype=torch.int32))
            idx = torch.stack([torch.randperm(E)[:k].sort()[0] for _ in range(T)]).to(torch.int32)
            for block_counts in (None, route.block_counts_ref(idx, E)):
                moe.moe_experts.triton(x, idx, torch.rand(T, k), up, down, residual=torch.empty_like(x),
                                       block_counts=block_counts, pdl=pdl)
    # bf16 SwiGLU experts of one and two tokens (Granite's): pair tiles, silu_mul after them
    for T in (1, 2):
        x = torch.randn(T, D).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E)[:6].sort()[0] for _ in range(T)]).to(torch.int32)
        gate_up = torch.empty(E, 2 * I, D, dtype=torch.bfloat16)
        moe.moe_experts.triton(x, idx, torch.rand(T, 6), gate_up, down, residual=torch.empty_like(x), pdl=True,
                               act="swiglu")
    # FP8 experts of one and two tokens: the pair stream, scaled per column and in 128 x 128 blocks
    for block in (0, 128):
        fp8_up, fp8_down = (quantize_fp8(torch.randn(E, n, kk) * 0.02, block) for n, kk in ((I, D), (D, I)))
        fp8_gate_up = quantize_fp8(torch.randn(E, 2 * I, D) * 0.02, block)
        for T in (1, 2):
            x = torch.randn(T, D).to(torch.bfloat16)
            idx = torch.stack([torch.randperm(E)[:6].sort()[0] for _ in range(T)]).to(torch.int32)
            for pdl in (False, True):
                moe.moe_experts.triton(x, idx, torch.rand(T, 6), fp8_up, fp8_down, residual=torch.empty_like(x),
                                       pdl=pdl)
            moe.moe_experts.triton(x, idx, torch.rand(T, 6), fp8_gate_up, fp8_down, residual=torch.empty_like(x),
                                   pdl=True, act="swiglu")
        # W8A8 in the sorted layout: FP8 rows on both sides of the tensor cores (16- and 128-row tiles)
        for T, k in ((64, 6), (1200, 2)):
            x = torch.randn(T, D).to(torch.bfloat16)
            idx = torch.stack([torch.randperm(E)[:k].sort()[0] for _ in range(T)]).to(torch.int32)
            moe.moe_experts.triton(x, idx, torch.rand(T, k), fp8_up, fp8_down, residual=torch.empty_like(x),
                                   pdl=True, w8a8=True)
            moe.moe_experts.triton(x, idx, torch.rand(T, k), fp8_gate_up, fp8_down, residual=torch.empty_like(x),
                                   pdl=True, act="swiglu", w8a8=True)
    # W8A8 over 32 x 32 block scales: a K tile of 32, the shortest an FP8 tensor-core product takes
    fp8_up, fp8_down = (quantize_fp8(torch.randn(E, n, kk) * 0.02, 32) for n, kk in ((I, D), (D, I)))
    for T, k in ((64, 6), (1200, 2)):
        x = torch.randn(T, D).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(E)[:k].sort()[0] for _ in range(T)]).to(torch.int32)
        moe.moe_experts.triton(x, idx, torch.rand(T, k), fp8_up, fp8_down, residual=torch.empty_like(x), pdl=True,
                               w8a8=True)


def launch_skinny() -> None:
    """The streamed skinny projections as a Nemotron decode step chains them (PDL): in_proj with
    the block norm (Nemotron-3-Nano's 16-column tiles, Nemotron-Nano-9B-v2's 16 x 512), with the
    conv epilogue too, out_proj, o_proj adding into the residual, a relu2 up projection, the shared
    expert's down projection (512-column tiles from K = 3072); Granite-4.0-H-micro's up, down and in_proj;
    up projections with SwiGLU in their epilogue; two bf16 rows in the 8B's and Nano's tall tiles;
    Falcon-H1-7B's joint in_proj (the conv update and the rotary embedding in its epilogue) and
    Bamba-9B's QKV (half of each head rotated)."""
    from mambastep.kernels.decode_linear import ConvTail, RopeTail, norm_linear
    from mambastep.kernels.rope import rope_inv_freq

    for N, K, norm, relu2 in ((10304, 2688, True, False), (2688, 4096, False, False), (3712, 2688, True, True),
                              (2688, 3712, False, False), (22656, 4480, True, False)):
        x = torch.randn(1, K).to(torch.bfloat16)
        w = torch.empty(N, K, dtype=torch.bfloat16)
        norm_linear.triton(x, torch.ones(K, dtype=torch.bfloat16) if norm else None, 1e-5, w, relu2=relu2,
                           out=torch.empty(1, N, dtype=torch.bfloat16), pdl=True)
    # Nano's in_proj with the conv update of its xBC columns in the epilogue (the conv state as the
    # pool keeps it, [S, K-1, D] seen as [S, D, K-1]), and o_proj's residual read before its wait
    D, W, lo = 6144, 4, 4096
    bf16 = dict(dtype=torch.bfloat16)
    conv = ConvTail(torch.empty(2, W - 1, D, **bf16).transpose(1, 2), torch.empty(D, W, **bf16),
                    torch.empty(D, **bf16), torch.zeros(1, dtype=torch.int32), lo)
    norm_linear.triton(torch.randn(1, 2688), torch.ones(2688, **bf16), 1e-5, torch.empty(10304, 2688, **bf16),
                       conv=conv, out=torch.empty(1, 10304, **bf16), pdl=True)
    norm_linear.triton(torch.randn(1, 4096).to(torch.bfloat16), None, 1e-5, torch.empty(2688, 4096, **bf16),
                       residual=torch.empty(1, 2688), pdl=True, early=True)
    # Granite-4.0-H-micro's up_proj (K = 2048, one register tile) and down_proj (a short grid:
    # 4 columns a program)
    norm_linear.triton(torch.randn(1, 2048), torch.ones(2048, **bf16), 1e-5, torch.empty(16384, 2048, **bf16),
                       out=torch.empty(1, 16384, **bf16), pdl=True, unit_norm=True)
    norm_linear.triton(torch.randn(1, 8192).to(torch.bfloat16), None, 1e-5, torch.empty(2048, 8192, **bf16),
                       residual=torch.empty(1, 2048), pdl=True, early=True)
    # SwiGLU in the up projections' epilogue: micro's (one register tile), Tiny's shared expert,
    # Bamba-9B's (K streamed)
    for N, K in ((16384, 2048), (2048, 1536), (28672, 4096)):
        norm_linear.triton(torch.randn(1, K), torch.ones(K, **bf16), 1e-5, torch.empty(N, K, **bf16), swiglu=True,
                           out=torch.empty(1, N // 2, **bf16), pdl=True)
    # and its in_proj, one register tile with the conv update in the epilogue
    conv = ConvTail(torch.empty(2, W - 1, 4352, **bf16).transpose(1, 2), torch.empty(4352, W, **bf16),
                    torch.empty(4352, **bf16), torch.zeros(1, dtype=torch.int32), 4096)
    norm_linear.triton(torch.randn(1, 2048), torch.ones(2048, **bf16), 1e-5, torch.empty(8512, 2048, **bf16),
                       conv=conv, out=torch.empty(1, 8512, **bf16), pdl=True, unit_norm=True)
    # two bf16 rows in the joined tile's own tiles: the 8B's in_proj and up (8 x 1024, a tall
    # projection over whole 1024-column K tiles), Nano's in_proj with the conv update (32 x 128)
    for N in (18560, 21504):
        norm_linear.triton(torch.randn(2, 4096), torch.ones(4096, **bf16), 1e-5, torch.empty(N, 4096, **bf16),
                           relu2=N == 21504, out=torch.empty(2, N, **bf16), pdl=True, unit_norm=True)
    conv = ConvTail(torch.empty(2, W - 1, D, **bf16).transpose(1, 2), torch.empty(D, W, **bf16),
                    torch.empty(D, **bf16), torch.zeros(2, dtype=torch.int32), lo)
    norm_linear.triton(torch.randn(2, 2688), torch.ones(2688, **bf16), 1e-5, torch.empty(10304, 2688, **bf16),
                       conv=conv, out=torch.empty(2, 10304, **bf16), pdl=True, unit_norm=True)
    # Falcon-H1-7B's joint in_proj at one row and two (in_proj's 6680 columns, the conv on 3584
    # of them, then 12 query and 2 key heads of 128 rotated) and Bamba-9B's QKV (64 of 128 rotated)
    for M in (1, 2):
        conv = ConvTail(torch.empty(2, W - 1, 3584, **bf16).transpose(1, 2), torch.empty(3584, W, **bf16),
                        torch.empty(3584, **bf16), torch.zeros(M, dtype=torch.int32), 3072)
        rope = RopeTail(rope_inv_freq(128, 1e11), torch.ones(M, dtype=torch.int32), 6680, 12, 2, 128)
        norm_linear.triton(torch.randn(M, 3072), torch.ones(3072, **bf16), 1e-5, torch.empty(8728, 3072, **bf16),
                           conv=conv, rope=rope, out=torch.empty(M, 8728, **bf16), pdl=True, unit_norm=True)
    rope = RopeTail(rope_inv_freq(64, 1e4), torch.ones(1, dtype=torch.int32), 0, 32, 8, 128)
    norm_linear.triton(torch.randn(1, 4096), torch.ones(4096, **bf16), 1e-5, torch.empty(6144, 4096, **bf16),
                       rope=rope, out=torch.empty(1, 6144, **bf16), pdl=True, unit_norm=True)
    from mambastep.kernels.fp8 import Fp8Weight, quantize_fp8

    # FP8 weights scaled per column, one row (a 2-D tile) and two: Nano's in_proj with the norm and
    # the conv update, its out_proj into the residual, the 8B's down projection (K = 21504)
    for M in (1, 2):
        conv = ConvTail(torch.empty(2, W - 1, D, **bf16).transpose(1, 2), torch.empty(D, W, **bf16),
                        torch.empty(D, **bf16), torch.zeros(M, dtype=torch.int32), lo)
        norm_linear.triton(torch.randn(M, 2688), torch.ones(2688, **bf16), 1e-5,
                           quantize_fp8(torch.randn(10304, 2688) * 0.02), conv=conv,
                           out=torch.empty(M, 10304, **bf16), pdl=True)
        norm_linear.triton(torch.randn(M, 4096).to(torch.bfloat16), None, 1e-5,
                           quantize_fp8(torch.randn(2688, 4096) * 0.02), residual=torch.empty(M, 2688), pdl=True,
                           early=True)
        norm_linear.triton(torch.randn(M, 21504).to(torch.bfloat16), None, 1e-5,
                           Fp8Weight(torch.empty(4096, 21504, dtype=torch.float8_e4m3fn), torch.ones(4096)),
                           residual=torch.empty(M, 4096), pdl=True, early=True)


def launch_decode_attention() -> None:
    """The attention kernels at Nemotron-3-Nano's heads (32 query, 2 KV, 128 wide): decode,
    launched as the fused decode step chains them (PDL), as the first kernels of a forked stream
    (only the second a programmatic dependent) and plain, and a packed prefill; over a bf16 cache
    and an FP8 one."""
    from mambastep.kernels.attention import FP8_KV_DTYPE, decode_attention, prefill_attention
    from mambastep.kernels.varlen import PrefillMetadata

    H, KVH, Dh, S, ctx, T = 32, 2, 128, 2, 512, 128
    bf16 = dict(dtype=torch.bfloat16)
    meta = PrefillMetadata.build([100, 28], [0, 1], [0, 3], chunk_size=128, max_tokens=T, max_seqs=2)
    for cache_dtype, kv_scale in ((torch.bfloat16, None), (FP8_KV_DTYPE, torch.ones(2))):
        cache = [torch.empty(S, ctx, KVH, Dh, dtype=cache_dtype) for _ in range(2)]
        for pdl, first_pdl in ((False, True), (True, True), (True, False)):
            decode_attention.triton(torch.empty(1, H, Dh, **bf16), torch.empty(1, KVH, Dh, **bf16),
                                    torch.empty(1, KVH, Dh, **bf16), *cache, torch.zeros(1, dtype=torch.int32),
                                    torch.ones(1, dtype=torch.int32), scale=Dh**-0.5, pdl=pdl, kv_scale=kv_scale,
                                    first_pdl=first_pdl)
        prefill_attention.triton(torch.empty(T, H, Dh, **bf16), torch.empty(T, KVH, Dh, **bf16),
                                 torch.empty(T, KVH, Dh, **bf16), *cache, meta, scale=Dh**-0.5, kv_scale=kv_scale)


def launch_prefill() -> None:
    """A Mamba2 prefill chunk at Nemotron's head shapes (P 64, and Nano-9B-v2's 80: one chain
    block, the scan's 64 columns and 16-column tail in one program; N 128, chunks of 128, bf16):
    the SSD scan's kernels and the causal conv over packed tokens, two sequences, one from a
    state."""
    from mambastep.kernels.conv1d import conv1d_varlen
    from mambastep.kernels.ssd import SSDWorkspace, ssd_scan
    from mambastep.kernels.varlen import PrefillMetadata

    T, H, N, G, D, K = 256, 4, 128, 2, 256, 4
    meta = PrefillMetadata.build([200, 56], [0, 1], [1, 0], chunk_size=128, max_tokens=T, max_seqs=2)
    bf16 = dict(dtype=torch.bfloat16)
    B, C = torch.empty(T, G, N, **bf16), torch.empty(T, G, N, **bf16)
    for P in (64, 80):
        x, z = torch.empty(T, H, P, **bf16), torch.empty(T, H, P, **bf16)
        ws = SSDWorkspace.allocate(meta.max_chunks, H, P, N, 128, "cpu", torch.bfloat16, groups=G)
        ssd_scan.triton(x, torch.empty(T, H, **bf16), torch.empty(H), B, C, torch.empty(H), torch.empty(2, H, P, N),
                        meta, z=z, dt_bias=torch.empty(H), out=torch.empty_like(x), workspace=ws)
    # the conv state as the state pool keeps it, [S, K-1, D] seen as [S, D, K-1]
    conv1d_varlen.triton(torch.empty(T, D, **bf16), torch.empty(D, K, **bf16), torch.empty(D, **bf16),
                         torch.empty(2, K - 1, D, **bf16).transpose(1, 2), meta)


def launch_quantize() -> None:
    """The per-token FP8 quantizer of W8A8 products: rows of one tile (a decode step's and a
    prefill chunk's, Nemotron-3-Nano's widths) and longer ones (two passes), a static scale, and
    the rows in use bounded on the device."""
    from mambastep.kernels.fp8 import quantize_rows

    end = torch.tensor(1000, dtype=torch.int32)
    for M, K in ((64, 2688), (2048, 2688), (2048, 1856), (600, 5000)):
        x = torch.randn(M, K).to(torch.bfloat16)
        quantize_rows.triton(x)
        quantize_rows.triton(x, torch.tensor(0.01))
        quantize_rows.triton(x, row_end=end)
    # the kernels that write their outputs quantized, a decode step's rows: the gated norm's each
    # held whole (Nano's 8 groups of 512), relu2's in 1024-column chunks (the 8B's 21504 columns,
    # out written and not)
    from mambastep.kernels.activation import relu2
    from mambastep.kernels.fp8 import Fp8Rows
    from mambastep.kernels.norm import gated_rms_norm, rms_norm

    bf16 = dict(dtype=torch.bfloat16)
    gated_rms_norm.triton(torch.empty(64, 4096, **bf16), torch.empty(64, 4096, **bf16), torch.empty(4096, **bf16), 512,
                          1e-5, rows=Fp8Rows.empty(64, 4096, "cpu"))
    for rows_only in (False, True):
        relu2.triton(torch.empty(4, 21504, **bf16), rows=Fp8Rows.empty(4, 21504, "cpu"), rows_only=rows_only)
    # a prefill chunk's rows: Nemotron-Nano-9B-v2's 8 groups of 1280 (split: the norm a group a
    # program, then the groups quantized), its 15680 columns and its block norm's 4480, walked
    gated_rms_norm.triton(torch.empty(512, 10240, **bf16), torch.empty(512, 10240, **bf16),
                          torch.empty(10240, **bf16), 1280, 1e-5, rows=Fp8Rows.empty(512, 10240, "cpu"))
    relu2.triton(torch.empty(512, 15680, **bf16), rows=Fp8Rows.empty(512, 15680, "cpu"), rows_only=True)
    rms_norm.triton(torch.empty(512, 4480, **bf16), torch.empty(4480, **bf16), 1e-5, residual=torch.empty(512, 4480),
                    rows=Fp8Rows.empty(512, 4480, "cpu"))


def launch_few_rows() -> None:
    """The few-row products at Nemotron-H-8B's in_proj width: bf16 weights, FP8 ones widened
    (W8A16, scaled per column and in 128 x 128 blocks), and with the weight's rows as the tensor
    cores' 64-row side FP8 ones beside quantized rows (W8A8) and bf16 ones; at 3, 8 and 64 rows, the
    last two in 3, 4 and 6 stages (what ``weight_rows_config`` gives a wide grid on a GPU, the
    table's, a short grid's)."""
    from mambastep.kernels.few_rows import few_rows_linear
    from mambastep.kernels.fp8 import quantize_fp8, quantize_rows_ref

    N, K = 18560, 4096
    w = torch.empty(N, K, dtype=torch.bfloat16)
    fp8, fp8_block = quantize_fp8(torch.randn(N, K) * 0.02), quantize_fp8(torch.randn(N, K) * 0.02, 128)
    for M in (3, 8, 64):
        x = torch.randn(M, K).to(torch.bfloat16)
        few_rows_linear.triton(x, w)
        few_rows_linear.triton(x, fp8)
        few_rows_linear.triton(x, fp8_block)
        for stages in (3, 4, 6):
            few_rows_linear.triton(x, fp8, rows=quantize_rows_ref(x), config=(64, 256, 4, stages))
            few_rows_linear.triton(x, w, weight_rows=True, config=(64, 128, 4, stages))


def launch_replay() -> None:
    """A verify step's row moves at Nemotron-H-8B's widths (bf16): the layout's gather from the
    packed rows and the record, and the outputs taken back with the drafts' rows kept; a short
    step's fused conv over the layout and the scan writing straight to the packed rows."""
    from mambastep.kernels.replay import gather_rows, replay_conv, take_rows
    from mambastep.kernels.ssd_short import ssd_short_scan
    from mambastep.kernels.varlen import PrefillMetadata

    inner, W, T, E, H, P, N, G, K = 8192, 10368, 16, 24, 128, 64, 128, 8, 4
    D = W - H
    bf16 = dict(dtype=torch.bfloat16)
    src, own = torch.zeros(E, dtype=torch.int32), torch.zeros(T, dtype=torch.int32)
    proj = torch.empty(T, inner + W, **bf16)[:, inner:]
    gather_rows.triton(proj, torch.empty(8, W, **bf16), src, out=torch.empty(E, W, **bf16))
    take_rows.triton(torch.empty(E, inner, **bf16), own, torch.empty(T, inner, **bf16), proj, own,
                     torch.empty(8, W, **bf16))
    meta = PrefillMetadata.build([3, 3], [0, 1], [1, 1], chunk_size=128, max_tokens=E, max_seqs=8)
    rows = replay_conv.triton(proj, torch.empty(8, W, **bf16), src, own, own, torch.empty(D, K, **bf16),
                              torch.empty(D, **bf16), torch.empty(2, K - 1, D, **bf16).transpose(1, 2), meta,
                              torch.empty(T, inner, **bf16))
    x = rows[:, :inner].view(E, H, P)
    B, C = rows[:, inner : D - G * N].view(E, G, N), rows[:, D - G * N : D].view(E, G, N)
    ssd_short_scan.triton(x, rows[:, D:], torch.empty(H), B, C, torch.empty(H), torch.empty(2, H, P, N), meta,
                          dt_bias=torch.empty(H), out=torch.empty(T, H, P, **bf16), out_rows=src)


if __name__ == "__main__":
    JITFunction.run = _compile_instead
    launch_moe()
    launch_skinny()
    launch_decode_attention()
    launch_prefill()
    launch_replay()
    launch_quantize()
    launch_few_rows()
    print(f"{len(compiled)} kernel variants, {len(failed)} failed to compile for sm_90 or spilled")
    sys.exit(1 if failed or not compiled else 0)
