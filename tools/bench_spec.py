"""Speculative decoding on one model, side by side with plain decoding (``runtime.speculative``).

Verify steps: B sequences of 1 + k tokens (each its last token and k drafts, nothing accepted
to replay) from slots holding ``CONTEXT`` tokens (fewer where the pool is shorter), in a graph captured for exactly that shape,
beside a decode step of B rows; per step, synchronised, median (as ``bench steps``).

Tokens/s: one request alone (a ``prompt_tokens`` random prompt, ``max_tokens`` greedy tokens) on
one engine, plain (the request opts out) and speculating with k = ``num_drafts``. Random weights
make any real drafter's acceptance meaningless, so the acceptance length is set: the drafter
proposes the plain run's own tokens, each replaced by a wrong one with probability ``wrong``
(``Oracle``), and the table says what each run accepted. Beside them prompt lookup
(``NgramDrafter``) on a repetitive prompt, for what it is worth on a random model. And at
concurrency ``wide``, requests that may speculate beside requests that do not, with a drafter
that is always wrong: the engine speculates only up to ``Speculative.max_batch`` requests.
Every speculating run's tokens are compared with the plain run's.
"""

from __future__ import annotations

import datetime
import time

import numpy as np
import torch

from ..graphs import Bucket, BucketSet
from ..runtime.engine import Engine
from ..runtime.model import Model
from ..runtime.ngram_drafter import NgramDrafter
from ..runtime.plan import StepPlan
from ..runtime.request import SamplingParams
from ..runtime.speculative import Speculative
from ..runtime.step_runner import StepRunner
from .bench_steps import CONTEXT, step_ms

PRESETS = ("nemotron-h-8b", "nemotron-3-nano-30b-a3b")
BATCHES = (1, 8, 64)
DRAFTS = (1, 2, 4, 8)
WRONG = (1.0, 0.6, 0.4, 0.25, 0.1, 0.0)


def verify_plan(batch: int, k: int, vocab: int, context: int) -> StepPlan:
    """``batch`` verify sequences of 1 + k tokens in slots 0.., each after ``context`` tokens."""
    rng = np.random.default_rng(0)
    i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
    return StepPlan(prefill_tokens=rng.integers(1, vocab, batch * (1 + k)), prefill_lens=i32([1 + k] * batch),
                    prefill_slots=i32(range(batch)), prefill_context=i32([context] * batch),
                    snapshot_slots=i32(range(batch)), snapshot_tokens=i32([1] * batch),
                    final_slots=i32([-1] * batch), prefill_logits=i32([1 + k] * batch))


def verify_steps(model: Model, pool, progress: bool) -> list[dict]:
    """Verify step and decode step times (ms) for each batch in ``BATCHES`` (that the pool has
    slots for) and k in ``DRAFTS``; in CUDA graphs (on a CPU, eager)."""
    rows = []
    cuda = model.device.type == "cuda"
    context = min(CONTEXT, pool.max_context - 1 - max(DRAFTS))
    for batch in BATCHES:
        if batch > pool.num_slots:
            continue
        plain = StepRunner(model, pool, BucketSet(decode=(batch,), mixed_decode=(0,), prefill=(16,)))
        if cuda:
            plain.capture([Bucket(batch)], progress=False)
        decode = StepPlan.make(decode=[(1 + i, i, context) for i in range(batch)])
        row = {"batch": batch, "context": context, "decode_ms": step_ms(plain, decode), "verify_ms": {}}
        del plain
        for k in DRAFTS:
            tokens = batch * (1 + k)
            buckets = BucketSet(decode=(1,), mixed_decode=(0,), prefill=(tokens,), max_prefill_seqs=batch, drafts=k,
                                verify=(tokens,))
            runner = StepRunner(model, pool, buckets)
            if cuda:
                runner.capture([Bucket(0, tokens, k)], progress=False)
            row["verify_ms"][k] = step_ms(runner, verify_plan(batch, k, model.cfg.vocab_size, context))
            del runner
        rows.append(row)
        if progress:
            print(f"  batch {batch}: decode {row['decode_ms']:.3f} ms, verify "
                  + ", ".join(f"k={k} {v:.3f}" for k, v in row["verify_ms"].items()), flush=True)
    return rows


class Oracle:
    """Drafts the plain run's tokens (``script``: the context's prompt -> what it drew), each
    wrong with probability ``state["wrong"]``; prompt lookup where ``state["ngram"]``."""

    def __init__(self, state: dict):
        self.state, self.rng, self.ngram = state, np.random.default_rng(0), NgramDrafter()

    def draft(self, context, k):
        if self.state["ngram"]:
            return self.ngram.draft(context, k)
        n = len(self.state["prompt"])
        if len(context) < n:
            return []
        drafts = self.state["script"][len(context) - n :][:k]
        vocab = self.state["vocab"]
        return [(t + 1) % vocab if self.rng.random() < self.state["wrong"] else t for t in drafts]


def _alone(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], float]:
    """A request alone: its tokens and their rate (tokens/s from its first token's step on)."""
    rid = engine.add_request(prompt, params)
    tokens, t0 = [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.id == rid:
                if t0 is None:
                    t0 = time.perf_counter()
                    first = len(o.new_tokens)
                tokens += o.new_tokens
    return tokens, (len(tokens) - first) / (time.perf_counter() - t0)


def _wide(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float]:
    """All requests at once: their tokens and the output tokens/s of the whole run."""
    ids = [engine.add_request(p, params) for p in prompts]
    out = {i: [] for i in ids}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            out[o.id] += o.new_tokens
    seconds = time.perf_counter() - t0
    return [out[i] for i in ids], sum(len(v) for v in out.values()) / seconds


def bench_preset(name: str, *, prompt_tokens: int = 512, max_tokens: int = 256, num_drafts: int = 4, wide: int = 64,
                 device: str = "cuda", progress: bool = True) -> dict:
    torch.manual_seed(0)
    gpu = device.startswith("cuda")
    model = Model.from_preset(name, dtype=torch.bfloat16 if gpu else torch.float32, device=device)
    vocab = model.cfg.vocab_size
    state = {"wrong": 1.0, "ngram": False, "vocab": vocab}
    spec = Speculative(drafter=lambda: Oracle(state), num_drafts=num_drafts)
    buckets = BucketSet(decode=(1, 2, 4, 8, 16, 32, 64), mixed_decode=(0, 64), prefill=(128, 512),
                        max_prefill_seqs=8)
    engine = Engine(model, num_slots=wide, max_context=prompt_tokens + max_tokens + 16, buckets=buckets,
                    speculative=spec, use_graphs=gpu, progress=progress)
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, vocab, prompt_tokens).tolist()
    greedy = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain_tokens, plain_rate = _alone(engine, prompt, SamplingParams(**greedy, speculative=False))
    state.update(prompt=prompt, script=plain_tokens)
    runs = [{"drafter": "none", "tokens_per_s": plain_rate, "acceptance_length": 1.0, "equal": True}]

    def measured(label: str, prompt: list[int], plain: list[int], rate: float | None = None) -> dict:
        before = dict(engine.speculative_stats)
        tokens, tps = _alone(engine, prompt, SamplingParams(**greedy, speculative=True))
        s = {k: v - before[k] for k, v in engine.speculative_stats.items()}
        run = {"drafter": label, "wrong": rate, "tokens_per_s": tps,
               "acceptance_length": 1 + s["accepted"] / max(1, s["verified"]), "equal": tokens == plain}
        if progress:
            print(f"  {label} wrong={rate}: {tps:.0f} tokens/s, acceptance length {run['acceptance_length']:.2f}, "
                  f"equal {run['equal']}", flush=True)
        return run

    for wrong in WRONG:
        state["wrong"] = wrong
        runs.append(measured("oracle", prompt, plain_tokens, wrong))
    # prompt lookup on a prompt that repeats one block (of 64 tokens, or an eighth of it)
    block = rng.integers(1, vocab, min(64, max(1, prompt_tokens // 8))).tolist()
    repeated = (block * -(-prompt_tokens // len(block)))[:prompt_tokens]
    state["ngram"] = False
    repeated_plain, repeated_rate = _alone(engine, repeated, SamplingParams(**greedy, speculative=False))
    state["ngram"] = True
    ngram = measured("ngram", repeated, repeated_plain)
    ngram["plain_tokens_per_s"] = repeated_rate
    runs.append(ngram)
    state.update(ngram=False, wrong=1.0)

    # at concurrency ``wide``: above max_batch the engine does not speculate
    prompts = [rng.integers(1, vocab, min(128, prompt_tokens)).tolist() for _ in range(wide)]
    short = dict(greedy, max_tokens=min(128, max_tokens))
    wide_plain, wide_plain_rate = _wide(engine, prompts, SamplingParams(**short, speculative=False))
    wide_spec, wide_spec_rate = _wide(engine, prompts, SamplingParams(**short, speculative=True))
    wide_run = {"concurrency": wide, "plain_tokens_per_s": wide_plain_rate, "spec_tokens_per_s": wide_spec_rate,
                "equal": wide_spec == wide_plain}
    steps = verify_steps(model, engine.pool, progress)
    return {"preset": name, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "num_drafts": num_drafts,
            "max_batch": spec.max_batch, "steps": steps, "alone": runs, "wide": wide_run}


def run(presets=PRESETS, progress: bool = True, **kw) -> dict:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return {"date": datetime.date.today().isoformat(), "device": device, "torch": torch.__version__,
            "presets": [bench_preset(p, progress=progress, **kw) for p in presets]}


def tables(result: dict) -> str:
    out = [f"{result['device']}, {result['date']}, torch {result['torch']}; random weights, greedy"]
    for p in result["presets"]:
        ks = list(p["steps"][0]["verify_ms"]) if p["steps"] else []
        context = p["steps"][0]["context"] if p["steps"] else 0
        out += ["", f"{p['preset']}: verify steps of 1 + k tokens a sequence beside a decode step, "
                    f"{context} tokens in each slot (ms)", "",
                "| batch | decode | " + " | ".join(f"verify k={k}" for k in ks) + " |",
                "| --- | --- | " + " | ".join("---" for _ in ks) + " |"]
        for s in p["steps"]:
            out.append(f"| {s['batch']} | {s['decode_ms']:.3f} | "
                       + " | ".join(f"{s['verify_ms'][k]:.3f} ({s['verify_ms'][k] / s['decode_ms']:.2f}x)" for k in ks)
                       + " |")
        out += ["", f"{p['preset']}: one request alone, a {p['prompt_tokens']}-token prompt, {p['max_tokens']} greedy "
                    f"tokens, k = {p['num_drafts']}", "",
                "| drafter | drafts wrong | acceptance length | tokens/s | speed-up | tokens equal to plain |",
                "| --- | --- | --- | --- | --- | --- |"]
        plain = p["alone"][0]["tokens_per_s"]
        for r in p["alone"]:
            base = r.get("plain_tokens_per_s", plain)
            wrong = "-" if r.get("wrong") is None else f"{r['wrong']:.0%}"
            out.append(f"| {r['drafter']} | {wrong} | {r['acceptance_length']:.2f} | {r['tokens_per_s']:.0f} | "
                       f"{r['tokens_per_s'] / base:.2f}x | {'yes' if r['equal'] else 'NO'} |")
        w = p["wide"]
        out += ["", f"Concurrency {w['concurrency']}, every draft wrong (speculating while at most {p['max_batch']} "
                    f"requests decode): {w['spec_tokens_per_s']:.0f} output tokens/s with it allowed, "
                    f"{w['plain_tokens_per_s']:.0f} "
                    f"without ({w['spec_tokens_per_s'] / w['plain_tokens_per_s'] - 1:+.1%}); tokens equal: "
                    f"{'yes' if w['equal'] else 'NO'}."]
    return "\n".join(out)


def print_table(result: dict) -> None:
    print(tables(result))
