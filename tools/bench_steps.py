"""Step benchmarks: decode steps eager vs CUDA graph beside the HBM floor; a long prefill chunk
beside its FLOP floor at the matrix rate the device sustains (``bench_kernels.matmul_rate``: timed
back to back, the prefill's steps run at the power limit's clock as well) and beside each matrix
product at the slower of its FLOPs and its weights' bytes; and mixed prefill/decode steps with
and without the forked stream beside separate steps. Where the model has a fused decode path,
small decode batches are also timed layer by layer and fused without programmatic dependent
launch, each captured in its own graphs.
A mixture-of-experts model's floors count the experts the step's routing reads, layer by layer
(the bench counts them on an eager run of the same step). Where a decode step runs work beside
its critical path on a side stream (a MoE's shared expert, a parallel block's attention), it is
also timed in turn. A model whose state does not fit 256 rows beside it is timed up to the
largest batch that does.

Every number is a median of per-step wall times, each step synchronised (the latency a caller
that waits for its tokens sees), on presets with random weights; beside them, decode steps
launched back to back (the host refills step n + 1 while the device runs step n, as a decode loop
that feeds each step the tokens of the last on the device does) and the forward graph's replay
alone, between CUDA events.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from tqdm import tqdm

from ..graphs import BucketSet
from ..kernels.decode_linear import pdl_supported
from ..kernels.fp8 import Fp8Weight
from ..runtime.decode_options import DecodeOptions
from ..runtime.mixers import Mixer
from ..runtime.mixers.moe import MoEMixer
from ..runtime.model import Model
from ..runtime.plan import StepPlan
from ..runtime.state_pool import StatePool, free_device_bytes
from ..runtime.step_runner import StepRunner
from .bench_kernels import copy_bandwidth, matmul_rate, stamp

DECODE_BATCHES = (1, 2, 4, 8, 32, 64, 128, 256)
MIXED_DECODE = (16, 64)
PREFILL_CHUNKS = (223, 512, 2048)
CONTEXT = 256  # tokens already in each decode row's slot


def step_ms(runner: StepRunner, plan: StepPlan, steps: int = 1, rounds: int = 30, warmup: int = 3) -> float:
    """Wall time per step of ``steps`` steps launched without waiting for any, then synchronised
    (median of ``rounds``): one step is the synchronised step; many, steps back to back, each
    refill waiting only for the previous step's copy of the arena. (On a CPU: eager steps.)"""
    sync = torch.cuda.synchronize if runner.cuda else (lambda: None)
    for _ in range(warmup):
        runner.logits(plan)
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.logits(plan)
        sync()
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(times)


def replay_ms(runner: StepRunner, plan: StepPlan, iters: int = 30) -> float:
    """Device time of the forward graph's replay alone (CUDA events; the buffers already filled)."""
    runner.logits(plan)
    bucket = runner.bucket_for(plan)
    assert runner.graphs.captured(bucket), f"{bucket} has no graph"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start.record()
        runner.graphs.forward(bucket)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def decode_rows(batch: int, first_slot: int = 0) -> list:
    """(token, slot, context) of ``batch`` decode rows in consecutive slots."""
    return [(1 + i, first_slot + i, CONTEXT) for i in range(batch)]


def decode_plan(batch: int, first_slot: int = 0) -> StepPlan:
    return StepPlan.make(decode=decode_rows(batch, first_slot))


def mixed_plan(decode: int, chunk: StepPlan) -> StepPlan:
    """``decode`` rows in slots 0 onwards, CONTEXT tokens seen each, beside the prompt chunk of
    ``chunk`` (a ``prefill_plan``'s)."""
    return StepPlan.make([(chunk.prefill_tokens.tolist(), int(chunk.prefill_slots[0]), 0)],
                         [(1 + i, i, CONTEXT) for i in range(decode)])


def prefill_plan(tokens: int, slot: int, vocab: int = 1000) -> StepPlan:
    """A prompt chunk of ``tokens`` random ids below ``vocab`` (and 1000) into ``slot``."""
    ids = torch.randint(1, min(vocab, 1000), (tokens,)).tolist()
    return StepPlan.make([(ids, slot, 0)])


def _side_work(model: Model) -> str | None:
    """What runs on the side stream in a decode step: what the unforked column names."""
    return "shared expert" if _moe_mixers(model) else "attention" if model.cfg.has("parallel") else None


def _moe_mixers(model: Model):
    return [b.mixer for b in model.blocks if isinstance(b.mixer, MoEMixer)]


def routed_experts(runner: StepRunner, plan: StepPlan) -> dict[int, int]:
    """Distinct experts each MoE layer routes the step's rows to (an eager run of the step)."""
    bucket = runner.bucket_for(plan)
    runner.refill(plan, bucket)
    runner.buffers.upload()
    seen: dict[int, int] = {}
    runner.model.forward(runner.buffers.inputs(bucket), runner.pool,
                         observe=lambda layer, idx: seen.__setitem__(layer, int(idx.unique().numel())))
    return seen


def hbm_floor_bytes(model: Model, pool: StatePool, batch: int, routed: dict[int, int] | None = None) -> int:
    """Bytes a decode step must move: every weight once (the embedding table only for the LM
    head, when tied; else only the gathered rows) but of the routed experts only those
    ``routed`` counts per MoE layer, each row's states read and written, and each attention
    row's KV read (plus the new key and value written)."""
    cfg = model.cfg
    seen, weights = set(), 0
    for t in _weights(model):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weights += t.numel() * t.element_size()
    if not cfg.tie_word_embeddings:
        weights -= model.embed.numel() * model.embed.element_size()
    for m in _moe_mixers(model):
        weights -= _expert_bytes(m) * (m.up.shape[0] - (routed or {}).get(m.layer, m.up.shape[0]))
    state = 0
    for i in cfg.layers_of("mamba"):
        conv, ssm = pool.conv[i], pool.ssm[i]
        state += 2 * (conv[0].numel() * conv.element_size() + ssm[0].numel() * ssm.element_size())
    for i in cfg.layers_of("attention"):
        per_pos = pool.k[i][0, 0].numel() * pool.k[i].element_size() * 2
        state += per_pos * (CONTEXT + 2)
    return weights + batch * state


def _expert_bytes(m: MoEMixer) -> int:
    """Bytes of one routed expert's two weights (FP8 values and their scales, or the weights)."""
    if isinstance(m.up, Fp8Weight):
        return (m.up.nbytes + m.down.nbytes) // m.up.shape[0]
    return (m.up[0].numel() + m.down[0].numel()) * m.up.element_size()


def _prefill_products(model: Model, tokens: int, routed: dict[int, int] | None = None):
    """(FLOPs, weight bytes, FP8?) of each matrix product of a prefill chunk: every block
    projection over every token (of the routed experts, the k each token takes, reading the
    weights of the experts ``routed`` counts per MoE layer, else all), and the LM head over the
    one row whose logits the step returns."""
    head = model.lm_head
    yield 2.0 * head.numel(), head.numel() * head.element_size(), False
    for block in model.blocks:
        m = block.mixer
        # projections (2-D, plain or FP8) and the conv1d's depthwise filters ([C, 1, K]); the
        # experts' stacks ([E, ., .]) below
        for t in _mixer_weights(m):
            fp8 = isinstance(t, Fp8Weight)
            values = t.values if fp8 else t
            if values.dim() == 2 or (values.dim() == 3 and values.shape[1] == 1):
                nbytes = t.nbytes if fp8 else t.numel() * t.element_size()
                yield 2.0 * tokens * values.numel(), nbytes, fp8
        if isinstance(m, MoEMixer):
            per_expert = math.prod(m.up.shape[1:]) + math.prod(m.down.shape[1:])  # plain or FP8 alike
            read = (routed or {}).get(m.layer, m.up.shape[0])
            yield 2.0 * tokens * m.route["top_k"] * per_expert, read * _expert_bytes(m), isinstance(m.up, Fp8Weight)


def prefill_flops(model: Model, tokens: int) -> float:
    """The matrix products of a prefill chunk alone, a lower bound on its work (the SSD scan and
    attention scores come on top)."""
    return sum(flops for flops, _, _ in _prefill_products(model, tokens))


def prefill_floor_ms(model: Model, tokens: int, rate: float, fp8_rate: float) -> float:
    """``prefill_flops`` at the matrix rates: FP8 products at ``fp8_rate``, the others at ``rate``."""
    return sum(flops / (fp8_rate if fp8 else rate) for flops, _, fp8 in _prefill_products(model, tokens)) * 1e3


def prefill_roofline_ms(model: Model, tokens: int, routed: dict[int, int] | None, rate: float,
                        bandwidth: float, fp8_rate: float | None = None) -> float:
    """A prefill chunk's matrix products, each at the slower of its FLOPs at the matrix rate (FP8
    products at ``fp8_rate``, where given) and its weights' bytes at copy bandwidth: above the
    FLOP floor where a product reads more than it computes, as the routed experts at a hundred
    rows an expert, each read in full."""
    return sum(max(flops / (fp8_rate if fp8 and fp8_rate else rate), nbytes / bandwidth)
               for flops, nbytes, fp8 in _prefill_products(model, tokens, routed)) * 1e3


def named_mixer_weights(mixer, prefix: str = ""):
    """(name, weight) of a mixer's weights: its tensor and FP8 fields, those of its tuple fields
    (``attr[i]``) and of the mixers it holds (a parallel block's, ``attr.field``)."""
    prefix = prefix or type(mixer).__name__.removesuffix("Mixer")
    for attr, v in vars(mixer).items():
        if isinstance(v, (torch.Tensor, Fp8Weight)):
            yield f"{prefix}.{attr}", v
        elif isinstance(v, Mixer):
            yield from named_mixer_weights(v, f"{prefix}.{attr}")
        elif isinstance(v, tuple):
            yield from ((f"{prefix}.{attr}[{i}]", t) for i, t in enumerate(v)
                        if isinstance(t, (torch.Tensor, Fp8Weight)))


def _mixer_weights(mixer):
    """A mixer's weights (``named_mixer_weights`` without the names)."""
    return (w for _, w in named_mixer_weights(mixer))


def _mixer_tensors(mixer):
    """The tensors of a mixer's weights (an FP8 weight's values and scales)."""
    for w in _mixer_weights(mixer):
        yield from ([w] if isinstance(w, torch.Tensor) else (t for t in w if isinstance(t, torch.Tensor)))


def _weights(model: Model):
    yield model.embed
    yield model.lm_head
    yield from (block.norm.weight for block in model.blocks)
    yield model.final_norm.weight
    for block in model.blocks:
        yield from _mixer_tensors(block.mixer)


def captured_with(model: Model, pool: StatePool, buckets: list, progress: bool, **options) -> StepRunner:
    """A runner whose graphs of ``buckets`` run ``model``'s weights with other decode options
    (forked as the default runner: a MoE layer's shared expert on the auxiliary stream)."""
    variant = model.with_options(DecodeOptions(**options))
    runner = StepRunner(variant, pool, BucketSet(decode=tuple(b.decode for b in buckets), mixed_decode=(0,),
                                                 prefill=(16,), max_prefill_seqs=1), overlap=True)
    runner.capture(buckets, progress=progress)
    return runner


def fitting_batches(model: Model, batches: tuple[int, ...], max_context: int, extra_slots: int) -> tuple[int, ...]:
    """The decode batches whose slots, ``extra_slots`` more beside them, fit half the memory the
    loaded ``model`` leaves on the device (the rest: graphs and activations); bf16 states."""
    per_slot = StatePool.bytes_per_slot(model.cfg, max_context, torch.bfloat16)
    free = free_device_bytes(model.device) // 2
    return tuple(b for b in batches if (b + extra_slots) * per_slot <= free)


def bench_preset(name: str, bandwidth: float, rate: float, progress: bool) -> dict:
    torch.manual_seed(0)
    model = Model.from_preset(name, dtype=torch.bfloat16, device="cuda")
    # a large model's state (Granite-4.0-H-Small: 0.2 GB a slot) may not fit 256 rows beside it
    max_context = CONTEXT + 2 * max(PREFILL_CHUNKS)
    batches = fitting_batches(model, DECODE_BATCHES, max_context, extra_slots=1)
    slots = max(batches) + 1  # decode rows take slots from 0, a prefill chunk the last
    prefill_slot = slots - 1
    mixed_decode = tuple(d for d in MIXED_DECODE if d <= prefill_slot)  # decode rows below the chunk's slot
    pool = StatePool(model.cfg, slots, max_context=max_context, dtype=torch.bfloat16, device="cuda")
    for t in pool.tensors():
        t.normal_(0, 0.1)
    buckets = BucketSet(decode=batches, mixed_decode=(0, *mixed_decode), prefill=(256, 512, 2048),
                        max_prefill_seqs=1)
    eager = StepRunner(model, pool, buckets, overlap=False)
    forked = StepRunner(model, pool, buckets, overlap=True)
    unforked = StepRunner(model, pool, buckets, overlap=False)
    moe = bool(_moe_mixers(model))
    # work beside the critical path on the side stream (a MoE's shared expert, a parallel block's
    # attention), timed in turn too
    side_work = _side_work(model)
    side = side_work is not None
    reports = [str(forked.capture(progress=progress)),  # unforked: the mixed steps' (and side work's all)
               str(unforked.capture([b for b in buckets.all() if b.prefill or side], progress=progress))]
    variants = {}
    opts = model.options
    if opts.fused:
        small = [b for b in buckets.all() if not b.prefill and b.decode <= opts.max_rows]
        variants = {"layered_ms": captured_with(model, pool, small, progress, fused=False)}
        if pdl_supported(model.device):  # the launch mode the model's default leaves out
            other = "no_pdl_ms" if opts.pdl else "pdl_ms"
            variants[other] = captured_with(model, pool, small, progress, pdl=not opts.pdl)
    rows = []
    for batch in tqdm(batches, desc=f"{name} decode", disable=not progress):
        plan = decode_plan(batch)
        routed = routed_experts(eager, plan) if moe else None
        e, g = step_ms(eager, plan), step_ms(forked, plan)
        floor = hbm_floor_bytes(model, pool, batch, routed) / bandwidth * 1e3
        row = {"kind": "decode", "batch": batch, "eager_ms": e, "graph_ms": g, "floor_ms": floor,
               "back_to_back_ms": step_ms(forked, plan, steps=50, rounds=5), "replay_ms": replay_ms(forked, plan)}
        if moe:
            row["experts_per_layer"] = sum(routed.values()) / len(routed)
        if side:
            row["unforked_ms"] = step_ms(unforked, plan)
        if batch <= opts.max_rows:
            row.update({k: step_ms(r, plan) for k, r in variants.items()})
        rows.append(row)
    tokens = max(PREFILL_CHUNKS)
    chunk = prefill_plan(tokens, prefill_slot)
    rows.append({"kind": "prefill", "tokens": tokens, "graph_ms": step_ms(forked, chunk),
                 "floor_ms": prefill_flops(model, tokens) / rate * 1e3,
                 "roofline_ms": prefill_roofline_ms(model, tokens, routed_experts(eager, chunk) if moe else None, rate,
                                                    bandwidth),
                 **({"unforked_ms": step_ms(unforked, chunk)} if side else {})})
    for d in tqdm(mixed_decode, desc=f"{name} mixed", disable=not progress):
        for c in PREFILL_CHUNKS:
            pre = prefill_plan(c, prefill_slot)
            mixed = mixed_plan(d, pre)
            rows.append({
                "kind": "mixed", "decode": d, "prefill": c,
                "forked_ms": step_ms(forked, mixed), "unforked_ms": step_ms(unforked, mixed),
                "separate_ms": step_ms(forked, decode_plan(d)) + step_ms(forked, pre),
            })
    del eager, forked, unforked, variants, pool, model
    torch.cuda.empty_cache()
    return {"preset": name, "capture": reports, "rows": rows, "side": side_work}


def run(presets=("mamba2-130m", "nemotron-h-8b"), progress: bool = True) -> dict:
    bandwidth = copy_bandwidth()
    rate, idle_rate = matmul_rate()
    return {
        **stamp(), "copy_GB/s": bandwidth / 1e9, "matmul_TFLOP/s": rate / 1e12,
        "matmul_idle_TFLOP/s": idle_rate / 1e12,
        "presets": [bench_preset(p, bandwidth, rate, progress) for p in presets],
    }


def _rate_note(result: dict) -> str:
    """The FLOP floors' matrix rate as the header gives it: sustained, and from idle beside it
    (results from before the sustained rate was measured hold only the rate from idle)."""
    rate, idle = result.get("matmul_TFLOP/s"), result.get("matmul_idle_TFLOP/s")
    if rate is None:
        return ""
    if idle is None:
        return f", bf16 matmul {rate:.0f} TFLOP/s from idle"
    return f", bf16 matmul {rate:.0f} TFLOP/s sustained ({idle:.0f} from idle)"


def tables(result: dict) -> str:
    """The result's tables in markdown, per preset: decode steps, the fused path's variants, and
    mixed steps."""
    out = [f"{result['device']}, {result['date']}, torch {result['torch']}, "
           f"copy bandwidth {result['copy_GB/s']:.0f} GB/s{_rate_note(result)}; bf16 weights, fp32 SSM state, "
           f"context {CONTEXT}"]
    for p in result["presets"]:
        out += ["", f"{p['preset']}: " + "; ".join(p["capture"]), ""]
        moe = any("experts_per_layer" in r for r in p["rows"])
        # a MoE or parallel model's runs timed unforked too (older results may lack them)
        unforked = any("unforked_ms" in r for r in p["rows"] if r["kind"] != "mixed")
        side = p.get("side") or "shared expert"
        out += ["| decode batch | eager (ms) | graph (ms) | eager/graph | graph, back to back (ms) "
                "| replay on device (ms) | HBM floor (ms) | graph/floor |" + (" experts read a layer |" if moe else "")
                + (f" graph, {side} in turn (ms) |" if unforked else ""),
                "| --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if moe else "")
                + (" --- |" if unforked else "")]
        for r in p["rows"]:
            if r["kind"] == "decode":
                out.append(f"| {r['batch']} | {r['eager_ms']:.3f} | {r['graph_ms']:.3f} | "
                           f"{r['eager_ms'] / r['graph_ms']:.1f}x | {r['back_to_back_ms']:.3f} | "
                           f"{r['replay_ms']:.3f} | {r['floor_ms']:.3f} | {r['graph_ms'] / r['floor_ms']:.2f}x |"
                           + (f" {r['experts_per_layer']:.1f} |" if moe else "")
                           + (f" {r['unforked_ms']:.3f} |" if unforked else ""))
        for r in p["rows"]:
            if r["kind"] == "prefill":
                roof = "roofline_ms" in r  # (JSON from before it was measured has none)
                out += ["", "| prefill chunk (tokens) | graph (ms) | FLOP floor of its matrix products (ms) | "
                        "graph/floor |" + (" each product's FLOPs or weight bytes, the slower (ms) | graph/that |"
                                           if roof else "") + (f" {side} in turn (ms) |" if unforked else ""),
                        "| --- | --- | --- | --- |" + (" --- | --- |" if roof else "") + (" --- |" if unforked else ""),
                        f"| {r['tokens']} | {r['graph_ms']:.2f} | {r['floor_ms']:.2f} | {r['graph_ms'] / r['floor_ms']:.2f}x |"
                        + (f" {r['roofline_ms']:.2f} | {r['graph_ms'] / r['roofline_ms']:.2f}x |" if roof else "")
                        + (f" {r['unforked_ms']:.2f} |" if unforked else "")]
        fused = [r for r in p["rows"] if "layered_ms" in r]
        if fused:
            # graph_ms is the model's default launch mode; the other one is timed where supported
            out += ["", "| decode batch | fused, PDL (ms) | fused, no PDL (ms) | layer by layer (ms) | layered/fused |",
                    "| --- | --- | --- | --- | --- |"]
            for r in fused:
                times = {"pdl_ms": r.get("pdl_ms"), "no_pdl_ms": r.get("no_pdl_ms")}
                times["pdl_ms" if "no_pdl_ms" in r else "no_pdl_ms"] = r["graph_ms"]
                cells = [f"{t:.3f}" if t is not None else "n/a" for t in times.values()]
                out.append(f"| {r['batch']} | {cells[0]} | {cells[1]} | {r['layered_ms']:.3f} | "
                           f"{r['layered_ms'] / r['graph_ms']:.2f}x |")
        mixed = [r for r in p["rows"] if r["kind"] == "mixed"]  # none where 16 rows' slots did not fit
        if mixed:
            out += ["", "| decode + prefill chunk | forked (ms) | unforked (ms) | fork gain | separate steps (ms) |",
                    "| --- | --- | --- | --- | --- |"]
        for r in mixed:
            gain = 1 - r["forked_ms"] / r["unforked_ms"]
            out.append(f"| {r['decode']} + {r['prefill']} | {r['forked_ms']:.3f} | {r['unforked_ms']:.3f} | "
                       f"{100 * gain:.0f}% | {r['separate_ms']:.3f} |")
    return "\n".join(out)


def print_table(result: dict) -> None:
    print("\n" + tables(result))
