"""FP8 beside bf16 on the same weights, in one run: decode steps (CUDA graphs) beside each
precision's HBM floor, a 2048-token prefill beside its FLOP floor, the main job's typical mixed
step (64 decode rows beside a 223-token prompt chunk, the chat workload's mean), and how closely
the FP8 model follows the bf16 one.

The FP8 model is the bf16 preset quantized at load time (``--quantization fp8``: per output
channel, attention and the Mamba layer before it kept in bf16, NVIDIA's recipe), so both run the
same weights. Floors count the bytes each step reads: FP8 values and their scales, the bf16
modules, the states (``bench_steps.hbm_floor_bytes``). The prefill's FLOP floor takes each
product at its own rate: FP8 products at the FP8 tensor-core rate, the rest at bf16's, both
sustained (``bench_kernels.matmul_rate``); beside it, each product at the slower of those FLOPs
and its weights' bytes (a mixture of experts reads every routed expert's weights in full at a
hundred rows an expert: bound by bytes, which the FLOP floor does not count). A
mixture-of-experts model's FP8 experts quantize their activations per row past a few pairs
(W8A8, ``MoEMixer.w8a8``, the runtime's default); the same steps with them W8A16 (the FP8 values
widened to bf16) are timed beside, at the prefill, the wide decode steps and the mixed step,
with their agreement with bf16.

A model whose state does not fit 256 rows beside it (Nemotron-3-Nano in bf16 on an 80 GB
card) is timed at the batches that fit.

Agreement: 64 random prompts of 16 tokens, then 32 decode steps each fed the bf16 model's
greedy token, so both models see the same inputs: top-1 agreement and the mean KL divergence
of the next-token distributions, KL(bf16 || FP8), over those 2,048 positions. Random weights
give flatter distributions than trained ones: the numbers gauge the numerics, not a task. A
mixture of experts' random router scores its experts nearly alike, so FP8's small differences
flip its choices and the flips compound layer after layer: there (Nemotron-3-Nano) top-1
agreement near zero, as with the experts' weights widened to bf16 (W8A16), says nothing of the
numerics; the tests hold each FP8 path to its reference (``tests/kernels/test_fp8.py``,
``tests/runtime/test_fp8_checkpoints.py``).
"""

from __future__ import annotations


import torch
from tqdm import tqdm

from ..graphs import Bucket, BucketSet
from ..kernels.fp8 import FP8_MAX
from ..runtime.model import Model
from ..runtime.plan import StepPlan
from ..runtime.state_pool import StatePool
from ..runtime.step_runner import StepRunner
from .bench_kernels import copy_bandwidth, matmul_rate, median_ms, stamp
from .bench_steps import (
    CONTEXT, _moe_mixers, decode_plan, fitting_batches, hbm_floor_bytes, mixed_plan, prefill_floor_ms, prefill_plan,
    prefill_roofline_ms, replay_ms, routed_experts, step_ms,
)

PRESETS = ("nemotron-3-nano-30b-a3b", "nemotron-h-8b", "nemotron-nano-9b-v2")
DECODE_BATCHES = (1, 2, 4, 8, 32, 64, 128, 256)
PREFILL = 2048
AGREE_ROWS, AGREE_PROMPT, AGREE_STEPS = 64, 16, 32
# the wide decode steps W8A16 experts are timed at beside W8A8's (past a few pairs: the sorted
# layout W8A8 changes)
W8A16_DECODE = (64, 256)
# the mixed step timed in both precisions: `mambastep run`'s at concurrency 64 (its decode rows
# beside a chat prompt's chunk), in a graph of the smallest bucket that holds it
MIXED_DECODE, MIXED_PREFILL, MIXED_BUCKET = 64, 223, 256
MAX_CONTEXT = CONTEXT + PREFILL + 2


def fp8_matmul_rate(n: int = 8192, settle_s: float = 2.0) -> float:
    """FP8 (e4m3) tensor-core rate in FLOP/s, n x n x n through ``torch._scaled_mm``, sustained
    (timed after ``settle_s`` seconds back to back, as ``matmul_rate``'s)."""
    a = (torch.randn(n, n, device="cuda") * 8).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    b = (torch.randn(n, n, device="cuda") * 8).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    return 2 * n**3 / (median_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                                 warmup_ms=settle_s * 1e3) * 1e-3)


def _agreement_steps(runner: StepRunner, slot0: int, feed=None):
    """Logits [AGREE_STEPS, rows, vocab] (bf16, on the device) of the agreement workload: prompts
    prefilled one a step, then decode steps fed ``feed`` [AGREE_STEPS, rows] (None: greedy)."""
    g = torch.Generator().manual_seed(7)
    vocab = runner.model.cfg.vocab_size
    for r in range(AGREE_ROWS):
        runner.logits(StepPlan.make([(torch.randint(3, vocab, (AGREE_PROMPT,), generator=g).tolist(), slot0 + r, 0)]))
    tokens, out = [], []
    nxt = torch.randint(3, vocab, (AGREE_ROWS,), generator=g).tolist() if feed is None else feed[0]
    for s in range(AGREE_STEPS):
        plan = StepPlan.make(decode=[(nxt[r], slot0 + r, AGREE_PROMPT + s) for r in range(AGREE_ROWS)])
        logits = runner.logits(plan)
        out.append(logits.to(torch.bfloat16).clone())
        tokens.append(nxt)
        if s + 1 < AGREE_STEPS:
            nxt = logits.argmax(-1).tolist() if feed is None else feed[s + 1]
    return torch.stack(out), tokens


def bench_model(model: Model, bandwidth: float, rates: tuple[float, float], progress: bool, label: str,
                batches: tuple[int, ...], feed=None) -> tuple[dict, torch.Tensor, list]:
    slots = max(batches) + AGREE_ROWS + 1
    pool = StatePool(model.cfg, slots, max_context=MAX_CONTEXT, dtype=torch.bfloat16, device="cuda")
    for t in pool.tensors():
        t.normal_(0, 0.1)
    mixed = MIXED_DECODE in batches
    buckets = _buckets(batches, mixed)
    runner = StepRunner(model, pool, buckets, overlap=True)
    report = str(runner.capture(_captured(buckets), progress=progress))
    eager = StepRunner(model, pool, buckets, overlap=False)  # never captured: eager steps
    moe = bool(_moe_mixers(model))
    rows = []
    for batch in tqdm(batches, desc=f"{label} decode", disable=not progress):
        plan = decode_plan(batch)
        routed = routed_experts(eager, plan) if moe else None
        rows.append({"kind": "decode", "batch": batch, "graph_ms": step_ms(runner, plan, rounds=20),
                     "replay_ms": replay_ms(runner, plan),
                     "floor_ms": hbm_floor_bytes(model, pool, batch, routed) / bandwidth * 1e3})
    chunk = prefill_plan(PREFILL, slots - 1)
    prefill_floor = prefill_floor_ms(model, PREFILL, *rates)
    routed = routed_experts(eager, chunk) if moe else None
    rows.append({"kind": "prefill", "tokens": PREFILL, "graph_ms": step_ms(runner, chunk, rounds=10),
                 "floor_ms": prefill_floor,
                 "roofline_ms": prefill_roofline_ms(model, PREFILL, routed, rates[0], bandwidth, fp8_rate=rates[1])})
    step = mixed_plan(MIXED_DECODE, prefill_plan(MIXED_PREFILL, slots - 1)) if mixed else None
    if mixed:
        rows.append({"kind": "mixed", "decode": MIXED_DECODE, "tokens": MIXED_PREFILL,
                     "graph_ms": step_ms(runner, step, rounds=20)})
    logits, tokens = _agreement_steps(eager, max(batches), feed)
    w8a16_logits = None
    mixers = _moe_mixers(model) if model.cfg.quantization is not None else []
    if mixers:
        # the same steps with the experts' FP8 values widened to bf16 (W8A16), in graphs of their own
        was = [m.w8a8 for m in mixers]
        for m in mixers:
            m.w8a8 = False
        try:
            wide = tuple(b for b in W8A16_DECODE if b in batches)
            at = _buckets(wide or batches[:1], mixed)
            w8a16 = StepRunner(model, pool, at, overlap=True)
            w8a16.capture(_captured(at), progress=False)
            floors = {r["batch"]: r["floor_ms"] for r in rows if r["kind"] == "decode"}
            rows += [{"kind": "decode-w8a16", "batch": b, "graph_ms": step_ms(w8a16, decode_plan(b), rounds=20),
                      "floor_ms": floors[b]} for b in wide]
            rows.append({"kind": "prefill-w8a16", "tokens": PREFILL, "graph_ms": step_ms(w8a16, chunk, rounds=10),
                         "floor_ms": prefill_floor})
            if mixed:
                rows.append({"kind": "mixed-w8a16", "decode": MIXED_DECODE, "tokens": MIXED_PREFILL,
                             "graph_ms": step_ms(w8a16, step, rounds=20)})
            del w8a16
            w8a16_logits, _ = _agreement_steps(eager, max(batches), feed)
        finally:
            for m, w in zip(mixers, was):
                m.w8a8 = w
    return {"capture": report, "rows": rows}, logits, tokens, w8a16_logits


def _buckets(batches: tuple[int, ...], mixed: bool) -> BucketSet:
    """The decode batches' buckets, the prefill's, and (``mixed``) the mixed step's."""
    return BucketSet(decode=batches, mixed_decode=(0, MIXED_DECODE) if mixed else (0,),
                     prefill=(MIXED_BUCKET, PREFILL) if mixed else (PREFILL,), max_prefill_seqs=1)


def _captured(buckets: BucketSet) -> list[Bucket]:
    """What the bench steps run in: every bucket but the mixed ones it does not time."""
    timed = {Bucket(0, PREFILL), Bucket(MIXED_DECODE, MIXED_BUCKET)}
    return [b for b in buckets.all() if not b.prefill or b in timed]


def _agreement(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Top-1 agreement and the mean KL(ref || got) of two runs' logits over the same positions."""
    p, q = ref.float().log_softmax(-1), got.float().log_softmax(-1)
    return {"top1_agreement": (p.argmax(-1) == q.argmax(-1)).float().mean().item(),
            "mean_kl": (p.exp() * (p - q)).sum(-1).mean().item(), "positions": p.shape[0] * p.shape[1]}


def bench_preset(name: str, bandwidth: float, rates: tuple[float, float], progress: bool) -> dict:
    out = {"preset": name}
    model = Model.from_preset(name, dtype=torch.bfloat16, device="cuda")
    # the batches whose slots (and the agreement's and the prefill's) fit beside the bf16 model;
    # both precisions take the same
    batches = fitting_batches(model, DECODE_BATCHES, MAX_CONTEXT, extra_slots=AGREE_ROWS + 1) or DECODE_BATCHES[:1]
    out["bf16"], ref, tokens, _ = bench_model(model, bandwidth, rates, progress, f"{name} bf16", batches)
    del model
    torch.cuda.empty_cache()
    model = Model.from_preset(name, dtype=torch.bfloat16, device="cuda", quantization="fp8")
    out["fp8"], got, _, got_w8a16 = bench_model(model, bandwidth, rates, progress, f"{name} fp8", batches,
                                                feed=tokens)
    out.update(_agreement(ref, got))
    if got_w8a16 is not None:
        out["w8a16"] = _agreement(ref, got_w8a16)
    del model, ref, got, got_w8a16
    torch.cuda.empty_cache()
    return out


def run(presets=PRESETS, progress: bool = True) -> dict:
    bandwidth = copy_bandwidth()
    rate, _ = matmul_rate()
    fp8_rate = fp8_matmul_rate()
    return {
        **stamp(), "copy_GB/s": bandwidth / 1e9, "matmul_TFLOP/s": rate / 1e12,
        "fp8_matmul_TFLOP/s": fp8_rate / 1e12,
        "presets": [bench_preset(p, bandwidth, (rate, fp8_rate), progress) for p in presets],
    }


def tables(result: dict) -> str:
    out = [f"{result['device']}, {result['date']}, torch {result['torch']}; copy {result['copy_GB/s']:.0f} GB/s, "
           f"bf16 matmul {result['matmul_TFLOP/s']:.0f} TFLOP/s, FP8 {result['fp8_matmul_TFLOP/s']:.0f} TFLOP/s "
           "(sustained)"]
    for p in result["presets"]:
        bf, f8 = ({r.get("batch", r.get("tokens")): r for r in p[k]["rows"] if r["kind"] in ("decode", "prefill")}
                  for k in ("bf16", "fp8"))
        out += ["", f"### {p['preset']}", "",
                f"FP8 against bf16 over {p['positions']} positions: top-1 agreement {p['top1_agreement']:.3f}, "
                f"mean KL {p['mean_kl']:.4f} nats"]
        if "w8a16" in p:
            out.append(f"(experts W8A16: top-1 agreement {p['w8a16']['top1_agreement']:.3f}, "
                       f"mean KL {p['w8a16']['mean_kl']:.4f} nats)")
        left = [b for b in DECODE_BATCHES if b not in bf]
        if left:  # said, not silently missing
            out.append(f"(decode x{', x'.join(map(str, left))} left out: their slots do not fit beside the bf16 "
                       "model on this card)")
        out.append("")
        if p.get("note"):  # added by hand to a result file: what changed since, or how to read it
            out += [f"Note: {p['note']}", ""]
        out += [
                "| step | bf16 (ms) | bf16 floor (ms) | bf16/floor | FP8 (ms) | FP8 floor (ms) | FP8/floor | "
                "bf16/FP8 |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for key in bf:  # the decode batches the card held, then the prefill
            a, b = bf[key], f8[key]
            out.append(_row(f"decode x{key}" if a["kind"] == "decode" else f"prefill {key} (FLOP floor)", a, b))
            if "roofline_ms" in a and "roofline_ms" in b:  # (JSON from before it was measured has none)
                out.append(_row(f"prefill {key} (each product's FLOPs or bytes, the slower)",
                                {**a, "floor_ms": a["roofline_ms"]}, {**b, "floor_ms": b["roofline_ms"]}))
        mixed = [next((r for r in p[k]["rows"] if r["kind"] == "mixed"), None) for k in ("bf16", "fp8")]
        if all(mixed):  # (JSON from before it was measured has none)
            out.append(_unfloored_row(f"mixed {mixed[0]['decode']} + {mixed[0]['tokens']}", *mixed))
        for r in p["fp8"]["rows"]:  # W8A16 experts' rows beside bf16's same step (the FP8 rows above: W8A8)
            if r["kind"] == "decode-w8a16":
                out.append(_row(f"decode x{r['batch']}, experts W8A16", bf[r["batch"]], r))
            elif r["kind"] == "prefill-w8a16":
                out.append(_row(f"prefill {PREFILL}, experts W8A16", bf[PREFILL], r))
            elif r["kind"] == "mixed-w8a16" and mixed[0]:
                out.append(_unfloored_row(f"mixed {r['decode']} + {r['tokens']}, experts W8A16", mixed[0], r))
    return "\n".join(out)


def _row(what: str, a: dict, b: dict) -> str:
    """A table row: bf16's step ``a`` beside FP8's ``b``, each against its floor."""
    return (f"| {what} | {a['graph_ms']:.3f} | {a['floor_ms']:.3f} | {a['graph_ms'] / a['floor_ms']:.2f}x | "
            f"{b['graph_ms']:.3f} | {b['floor_ms']:.3f} | {b['graph_ms'] / b['floor_ms']:.2f}x | "
            f"{a['graph_ms'] / b['graph_ms']:.2f}x |")


def _unfloored_row(what: str, a: dict, b: dict) -> str:
    """A row of a step with no floor of its own (a mixed step's parts overlap): bf16's ``a``
    beside FP8's ``b``."""
    return f"| {what} | {a['graph_ms']:.3f} | | | {b['graph_ms']:.3f} | | | {a['graph_ms'] / b['graph_ms']:.2f}x |"


def print_table(result: dict) -> None:
    print("\n" + tables(result))
