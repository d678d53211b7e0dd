"""A decode step's rows (one by default; up to ``MAX_ROWS``, 8) through a preset's skinny
projections (``kernels.decode_linear``): the tile table's choice (``decode_linear._config``)
beside a sweep of others, at each distinct weight shape of the preset's blocks and its LM head.
The tool to retune the table for a family, or to check it: what it finds goes to
docs/experiments.md and, where it wins in a whole step (``bench profile --timeline``), into the
table's rules.

Each shape is timed as the fused decode step runs it: the rows, launched with programmatic
dependent launch, in a CUDA graph of calls over copies of the weight that together pass the L2
(at least ``CYCLE_BYTES``), so every call reads its weight from HBM; the median of ``REPLAYS``
replays, per call. A projection that reads the hidden state (K = hidden) takes the block norm's
prologue, its weight folded in (a unit norm, as the model folds it), the others add into a
residual row. A SwiGLU MLP's up projection (the gate's rows, then the up's; a dense MLP's or a
shared expert's) is timed with its SwiGLU, as the step runs it: in the epilogue where K streams,
else ``silu_mul`` launched after a one-tile product, so the sweep weighs that launch too.
Mamba2's conv epilogue and gated norm are not modelled: in_proj is timed as a plain normed
product, out_proj after its norm. With ``quantization="fp8"``, the preset quantized at load (its
FP8 projections' tiles; the bf16 ones beside them).

Beside the sweep, each shape's product alone as a layer-by-layer step runs it (a step whose rows
the fused path does not take): through ``kernels.linear.linear``, and through cuBLAS, the
evidence for ``linear``'s choice by rows and columns. And the weight-rows product
(``kernels.few_rows``: the weight's rows as the tensor cores' 64-row side) in its table's
configuration and a sweep of others: W8A8 for FP8 weights scaled per column, the rows quantized
beforehand as the norm before it makes them, else bf16; whether, and in which configuration, it
would stream a few rows faster than the skinny kernels (docs/experiments.md: at one FP8 row it
reads 5-19% faster alone on an H100, in one configuration, and lost in the step in the table's).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
from tqdm import tqdm

from ..kernels import decode_linear
from ..kernels.decode_linear import MAX_ROWS, ONE_TILE_MAX_K, norm_linear
from ..kernels.few_rows import few_rows_linear, weight_rows_config
from ..kernels.fp8 import Fp8Weight, fp8_linear, quantize_rows
from ..kernels.linear import linear
from ..runtime.model import Model
from .bench_kernels import copy_bandwidth, stamp
from .bench_steps import named_mixer_weights

PRESETS = ("granite-4.0-h-micro",)
CYCLE_BYTES = 400e6
REPLAYS = 10
# the weight-rows product's (block_n, block_k, warps, stages) swept beside its table's
WEIGHT_ROWS_SWEEP = tuple(itertools.product((64, 128), (128, 256, 512), (4,), (3, 4, 6)))


def _named_weights(model: Model):
    """(name, weight, swiglu) of every 2-D weight of the blocks' mixers, in block order, then the
    LM head; swiglu: a SwiGLU MLP's up projection (a dense MLP's ``up``, a MoE's ``shared[0]``)."""
    for block in model.blocks:
        swiglu = getattr(block.mixer, "act", None) == "swiglu"
        for name, w in named_mixer_weights(block.mixer):
            if len(w.shape) == 2:
                yield name, w, swiglu and name.rsplit(".", 1)[-1] in ("up", "shared[0]")
    yield "lm_head", model.lm_head, False


def projections(model: Model) -> list[tuple[dict, object]]:
    """The distinct weight shapes the fused decode step projects through, in block order, the LM
    head last, each with one weight of that shape: (shape, weight), the shape's name (mixer and
    attribute), N, K, whether FP8, whether it reads the hidden state (a normed input) or adds
    into the residual, and whether SwiGLU follows it."""
    seen, out = set(), []
    for name, weight, swiglu in _named_weights(model):
        N, K = weight.shape
        fp8 = isinstance(weight, Fp8Weight)
        if K < 64 or (not fp8 and weight.dtype == torch.float32) or (N, K, fp8, swiglu) in seen:
            continue  # conv weights, the router's fp32 gate; a shape already listed
        seen.add((N, K, fp8, swiglu))
        out.append(({"name": name, "N": N, "K": K, "fp8": fp8, "normed": K == model.cfg.hidden_size,
                     "swiglu": swiglu}, weight))
    return out


def candidates(K: int, rows: int = 1) -> list[decode_linear._Config]:
    """The tiles swept: K streamed in tiles of 128-1024 columns over 4-32 output columns a
    program (at most 16K partial sums a tile: fewer weights as the rows grow), 2 to 4 stages;
    and, where K fits, the whole K as one register tile."""
    m = triton.next_power_of_2(rows)
    tiles = [decode_linear._Config(True, bn, bk, 4, stages)
             for bn, bk, stages in itertools.product((4, 8, 16, 32), (128, 256, 512, 1024), (2, 3, 4))
             if bn * bk * m <= 16384 and bn * bk >= 1024]
    if K <= ONE_TILE_MAX_K:
        tiles += [decode_linear._Config(False, bn, triton.next_power_of_2(K), warps, 1)
                  for bn, warps in ((2, 1), (4, 1), (8, 4), (16, 4))]
    return tiles


def _device(weight) -> torch.device:
    return weight.values.device if isinstance(weight, Fp8Weight) else weight.device


def _copies(weight, n: int) -> list:
    if isinstance(weight, Fp8Weight):
        return [Fp8Weight(weight.values.clone(), weight.scale.clone(), weight.block) for _ in range(n)]
    return [weight.clone() for _ in range(n)]


def _replay_us(calls, n: int) -> float:
    """Microseconds a call of ``calls()``'s ``n`` takes: compiled, captured in a CUDA graph, the
    median of ``REPLAYS`` replays."""
    calls()  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return sorted(times)[len(times) // 2]


def _weight_bytes(shape: dict) -> int:
    return shape["N"] * shape["K"] * (1 if shape["fp8"] else 2)


def _weight_cycle(shape: dict, weight) -> list:
    return _copies(weight, max(2, int(CYCLE_BYTES // _weight_bytes(shape))))


def time_us(shape: dict, weight, tile: decode_linear._Config | None, rows: int = 1) -> float:
    """Microseconds a call of ``rows`` rows at ``shape`` takes in ``tile`` (None: the table's), as
    the module doc says; NaN where the tile does not launch."""
    N, K = shape["N"], shape["K"]
    weights = _weight_cycle(shape, weight)
    dev, act = _device(weight), torch.bfloat16
    swiglu = shape["swiglu"]
    x = torch.randn(rows, K, device=dev, dtype=act)
    norm_w = torch.ones(K, device=dev, dtype=act) if shape["normed"] else None
    out = torch.empty(rows, N // 2 if swiglu else N, device=dev, dtype=act)
    residual = None if shape["normed"] or swiglu else torch.randn(rows, N, device=dev, dtype=act)

    def calls():
        for w in weights:
            norm_linear(x, norm_w, 1e-5, w, out=None if residual is not None else out, residual=residual,
                        swiglu=swiglu, pdl=True, unit_norm=norm_w is not None)

    table = decode_linear._config
    if tile is not None:
        decode_linear._config = lambda *args, **kwargs: tile
    try:
        return _replay_us(calls, len(weights))
    except Exception:  # noqa: BLE001 - a tile that does not compile or launch is no candidate
        return float("nan")
    finally:
        decode_linear._config = table
        torch.cuda.synchronize()


def layered_us(shape: dict, weight, rows: int = 1) -> dict:
    """Microseconds the product alone of ``rows`` rows at ``shape`` takes as a layer-by-layer step
    runs it, no norm or epilogue: through ``kernels.linear.linear`` (whatever it picks for that
    many rows: the weight-rows product, the skinny one, cuBLAS) and through cuBLAS
    (``F.linear``; FP8 weights: ``fp8_linear``, cuBLAS's FP8 tensor cores or the dequantized
    product), timed as ``time_us`` times a tile."""
    weights = _weight_cycle(shape, weight)
    x = torch.randn(rows, shape["K"], device=_device(weight), dtype=torch.bfloat16)
    cublas = fp8_linear if shape["fp8"] else F.linear
    return {name: _replay_us(lambda: [product(x, w) for w in weights], len(weights))
            for name, product in (("linear", linear), ("cuBLAS", cublas))}


def weight_rows_us(shape: dict, weight, rows: int = 1) -> dict:
    """The weight-rows product alone of ``rows`` rows at ``shape``, timed as ``layered_us``: in
    its table's configuration (``few_rows.weight_rows_config``) and the best of
    ``WEIGHT_ROWS_SWEEP`` (the table's among them), with that configuration; {} for block-scaled
    FP8 weights, which it does not take W8A8."""
    fp8 = shape["fp8"]
    if fp8 and weight.block:
        return {}
    weights = _weight_cycle(shape, weight)
    x = torch.randn(rows, shape["K"], device=_device(weight), dtype=torch.bfloat16)
    q = quantize_rows(x) if fp8 else None

    def timed(config) -> float:
        try:
            return _replay_us(lambda: [few_rows_linear(x, w, config=config, rows=q, weight_rows=not fp8)
                                       for w in weights], len(weights))
        except Exception:  # noqa: BLE001 - a configuration that does not compile or launch is no candidate
            return float("nan")
        finally:
            torch.cuda.synchronize()

    table = weight_rows_config(rows, shape["N"], fp8, x.device)
    table_us = timed(table)
    swept = [(t, config) for config in WEIGHT_ROWS_SWEEP if (t := timed(config)) == t]
    best_us, best = min(swept + [(table_us, table)])
    return {"weight_rows_us": table_us, "weight_rows_best": list(best), "weight_rows_best_us": best_us}


def bench_preset(name: str, bandwidth: float, quantization: str | None, progress: bool, rows: int = 1) -> dict:
    model = Model.from_preset(name, dtype=torch.bfloat16, device="cuda", quantization=quantization)
    shapes = projections(model)
    # a preset's first timing, discarded: it ran slow (H100, 2026-12-07: the 8B's FP8 in_proj 33.77
    # us in the table's tile, then 29.68 in the same tile within the sweep; Nano's 13.22 then 11.65),
    # where every later shape's table and sweep agreed within 2%
    time_us(*shapes[0], None, rows)
    out = []
    for shape, weight in tqdm(shapes, desc=name, disable=not progress):
        N, K, fp8 = shape["N"], shape["K"], shape["fp8"]
        table = decode_linear._config(rows, N, K, _device(weight), fp8=fp8)
        table_us = time_us(shape, weight, None, rows)
        # the best of the sweep, the table's own tile among them
        swept = [(t, tile) for tile in candidates(K, rows) if (t := time_us(shape, weight, tile, rows)) == t]
        best_us, best = min(swept + [(table_us, table)])
        layered = layered_us(shape, weight, rows)
        out.append({**shape, "floor_us": _weight_bytes(shape) / bandwidth * 1e6, "table": list(table),
                    "table_us": table_us, "best": list(best), "best_us": best_us,
                    "linear_us": layered["linear"], "cublas_us": layered["cuBLAS"],
                    **weight_rows_us(shape, weight, rows),
                    "swept": [[*tile, t] for t, tile in swept]})  # every tile that ran, to fit a rule to
    del model
    torch.cuda.empty_cache()
    return {"preset": name, "quantization": quantization, "rows": out}


def run(presets=PRESETS, progress: bool = True, quantization: str | None = None, rows: int = 1) -> dict:
    """``rows``: the decode rows through each projection (1 to ``decode_linear.MAX_ROWS``)."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"bench tiles: rows must be 1 to {MAX_ROWS}, got {rows}")
    bandwidth = copy_bandwidth()
    return {**stamp(), "copy_GB/s": bandwidth / 1e9, "decode_rows": rows,
            "presets": [bench_preset(p, bandwidth, quantization, progress, rows) for p in presets]}


def _tile(t) -> str:
    loop, bn, bk, warps, stages = t
    return f"{bn} x {bk}, {stages} stages" if loop else f"{bn} x {bk} one tile, {warps} warps"


def tables(result: dict) -> str:
    rows = result.get("decode_rows", 1)
    out = [f"{result['device']}, {result['date']}, torch {result['torch']}, copy bandwidth "
           f"{result['copy_GB/s']:.0f} GB/s; {'one row' if rows == 1 else f'{rows} rows'}, PDL, in a graph, "
           f"weights read from HBM"]
    for p in result["presets"]:
        # runs from before the weight-rows columns have none
        weight_rows = any("weight_rows_us" in r for r in p["rows"])
        extra = (" weight rows (us) | weight rows, best | best (us) |", " --- | --- | --- |") if weight_rows else ("", "")
        out += ["", f"### {p['preset']}" + (f" ({p['quantization']})" if p["quantization"] else ""), "",
                "| projection | N x K | floor (us) | table's tile | table (us) | best tile | best (us) | table/best "
                "| layered: linear (us) | layered: cuBLAS (us) |" + extra[0],
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + extra[1]]
        for r in p["rows"]:
            line = (f"| {r['name']}{' (FP8)' if r['fp8'] else ''}{' (SwiGLU)' if r.get('swiglu') else ''} | "
                    f"{r['N']} x {r['K']} | {r['floor_us']:.2f} | "
                    f"{_tile(r['table'])} | {r['table_us']:.2f} | {_tile(r['best'])} | {r['best_us']:.2f} | "
                    f"{r['table_us'] / r['best_us']:.2f}x | {r['linear_us']:.2f} | {r['cublas_us']:.2f} |")
            if weight_rows:
                line += (f" {r['weight_rows_us']:.2f} | {_product_config(r['weight_rows_best'])} | "
                         f"{r['weight_rows_best_us']:.2f} |" if "weight_rows_us" in r else " | | |")
            out.append(line)
    return "\n".join(out)


def _product_config(config) -> str:
    bn, bk, warps, stages = config
    return f"{bn} x {bk}, {stages} stages"


def print_table(result: dict) -> None:
    print("\n" + tables(result))
