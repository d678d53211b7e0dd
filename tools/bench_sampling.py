"""What the sampling features add to a decode step: whole steps (the forward, the draw, the
tokens read back on the host) at batch 1, 64 and 256 with each feature on beside the same step
greedy, every row asking for it. Features: log-probabilities of the drawn token and the top 5
(``logprobs``), presence, frequency and repetition penalties (``penalties``: the processed
variant, which also copies the processors' inputs and keeps the token counts), both, and the
same over a temperature draw. The variants of a batch are timed in turns, round after round
(median per variant), so drift hits them alike.

And ``n`` choices of one prompt through the Engine (``add_choices``: the prompt prefilled once,
its state copied into each choice's slot) beside the same n requests sent separately (each
prefilled): n = 8 from a 2,048-token prompt, 128 tokens each, sampled; the time until every
choice has its first token, and output tokens/s over the whole run (median of 3 runs each, in
turns). Presets have random weights.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

from ..graphs import Bucket, BucketSet
from ..kernels.logits_processors import MAX_BIASED
from ..runtime.engine import Engine
from ..runtime.model import Model
from ..runtime.request import SamplingParams
from ..runtime.plan import StepPlan
from ..runtime.state_pool import StatePool
from ..runtime.step_runner import StepRunner
from .bench_kernels import stamp
from .bench_steps import CONTEXT, decode_plan

BATCHES = (1, 64, 256)
PRESETS = ("nemotron-h-8b", "nemotron-3-nano-30b-a3b")
FEATURES = {  # name: (temperature, penalties, logprobs)
    "greedy": (0.0, False, False),
    "logprobs": (0.0, False, True),
    "penalties": (0.0, True, False),
    "penalties + logprobs": (0.0, True, True),
    "sampled": (0.8, False, False),
    "sampled + penalties + logprobs": (0.8, True, True),
}


def feature_plan(batch: int, temperature: float, penalties: bool, logprobs: bool) -> StepPlan:
    """``batch`` decode rows in slots 0.., each row with the feature on."""
    plan = decode_plan(batch)
    plan.temperature = np.full(batch, temperature, np.float32)
    plan.top_k = np.zeros(batch, np.int32)
    plan.top_p = np.ones(batch, np.float32)
    plan.seed = np.arange(batch, dtype=np.int64)
    plan.position = np.full(batch, 7, np.int64)
    plan.sample_slots = np.arange(batch, dtype=np.int32)
    plan.logprobs = logprobs
    if penalties:
        plan.presence = np.full(batch, 0.5, np.float32)
        plan.frequency = np.full(batch, 0.5, np.float32)
        plan.repetition = np.full(batch, 1.2, np.float32)
        plan.processor_slots = np.arange(batch, dtype=np.int32)
        plan.bias_ids = np.zeros((0, MAX_BIASED), np.int32)
        plan.bias_values = np.zeros((0, MAX_BIASED), np.float32)
        plan.bias_until = np.zeros((0, MAX_BIASED), np.int32)
    return plan


def _step_ms(runner: StepRunner, plan: StepPlan) -> float:
    t0 = time.perf_counter()
    pending = runner.launch(plan)
    pending.get()
    pending.logprobs()
    return (time.perf_counter() - t0) * 1e3


def _choices_run(engine: Engine, prompt: list[int], params: SamplingParams, n: int, forked: bool) -> tuple[float, float]:
    """(seconds until every choice has a token, output tokens/s) of one run."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if forked:
        ids = engine.add_choices(prompt, params, n)
    else:
        ids = [engine.add_request(prompt, SamplingParams(**{**_fields(params), "seed": params.seed + i}))
               for i in range(n)]
    first, tokens = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.id, time.perf_counter())
            tokens += len(out.new_tokens)
    total = time.perf_counter() - t0
    return max(first[i] for i in ids) - t0, tokens / total


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def bench_choices(model: Model, n: int = 8, prompt_tokens: int = 2048, output: int = 128, runs: int = 3) -> dict:
    buckets = BucketSet(decode=(1, 2, 4, 8, 16), mixed_decode=(0, 8), prefill=(prompt_tokens,), max_prefill_seqs=8)
    engine = Engine(model, num_slots=2 * n, max_context=prompt_tokens + output + 8, buckets=buckets, progress=False)
    prompt = torch.randint(1, model.cfg.vocab_size, (prompt_tokens,)).tolist()
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=output, ignore_eos=True)
    results = {True: [], False: []}
    for forked in (True, False):  # warm-up
        _choices_run(engine, prompt, params, n, forked)
    for _ in range(runs):
        for forked in (True, False):
            results[forked].append(_choices_run(engine, prompt, params, n, forked))
    row = {"n": n, "prompt_tokens": prompt_tokens, "output_tokens": output}
    for forked, name in ((True, "forked"), (False, "separate")):
        row[f"{name}_ttft_ms"] = statistics.median(r[0] for r in results[forked]) * 1e3
        row[f"{name}_tok_s"] = statistics.median(r[1] for r in results[forked])
    row["state_bytes_per_slot"] = engine.pool.bytes_per_slot(model.cfg, prompt_tokens + 1, model.dtype)
    return row


def bench_preset(name: str, rounds: int, progress: bool, choices: bool) -> dict:
    torch.manual_seed(0)
    model = Model.from_preset(name, dtype=torch.bfloat16, device="cuda")
    pool = StatePool(model.cfg, max(BATCHES), max_context=CONTEXT + 64, dtype=torch.bfloat16, device="cuda")
    for t in pool.tensors():
        t.normal_(0, 0.1)
    runner = StepRunner(model, pool, BucketSet(decode=BATCHES, mixed_decode=(0,), prefill=(16,), max_prefill_seqs=1))
    report = runner.capture([Bucket(b) for b in BATCHES], progress=progress)
    rows = []
    for batch in tqdm(BATCHES, desc=f"{name} sampling features", disable=not progress):
        plans = {f: feature_plan(batch, *spec) for f, spec in FEATURES.items()}
        times = {f: [] for f in plans}
        for _ in range(3):  # warm-up
            for f, plan in plans.items():
                _step_ms(runner, plan)
        for _ in range(rounds):
            for f, plan in plans.items():
                times[f].append(_step_ms(runner, plan))
        ms = {f: statistics.median(t) for f, t in times.items()}
        rows.append({"batch": batch, "ms": ms})
    del runner, pool
    result = {"preset": name, "capture": str(report), "rows": rows}
    if choices:
        result["choices"] = bench_choices(model)
    del model
    torch.cuda.empty_cache()
    return result


def run(presets=PRESETS, rounds: int = 40, progress: bool = True) -> dict:
    return {**stamp(), "presets": [bench_preset(p, rounds, progress, choices=i == 0) for i, p in enumerate(presets)]}


def tables(result: dict) -> str:
    out = [f"{result['device']}, {result['date']}, torch {result['torch']}; one synchronised step each (ms), "
           "and what the feature adds to the greedy step", ""]
    for p in result["presets"]:
        out += [f"**{p['preset']}**", "", "| batch | " + " | ".join(FEATURES) + " |",
                "| --- |" + " --- |" * len(FEATURES)]
        for row in p["rows"]:
            base = row["ms"]["greedy"]
            cells = [f"{row['ms']['greedy']:.3f}"] + [
                f"{row['ms'][f]:.3f} ({(row['ms'][f] / base - 1) * 100:+.1f}%)" for f in list(FEATURES)[1:]]
            out.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
        out.append("")
        c = p.get("choices")
        if c:
            out += [f"n = {c['n']} choices of one {c['prompt_tokens']}-token prompt, {c['output_tokens']} tokens each "
                    f"(a slot's state up to the prompt's end: {c['state_bytes_per_slot'] / 2**20:.1f} MiB, the copy "
                    "per choice)", "",
                    "| | every choice's first token (ms) | output tokens/s |", "| --- | --- | --- |",
                    f"| prefilled once, state copied | {c['forked_ttft_ms']:.1f} | {c['forked_tok_s']:.0f} |",
                    f"| {c['n']} separate requests | {c['separate_ttft_ms']:.1f} | {c['separate_tok_s']:.0f} |", ""]
    return "\n".join(out)


def print_table(result: dict) -> None:
    print()
    print(tables(result))
