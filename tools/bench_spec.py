"""Speculative decoding on one model, side by side with plain decoding (``runtime.speculative``).

Verify steps: B sequences of 1 + k tokens (each its last token and k drafts, nothing accepted
to replay) from slots holding ``CONTEXT`` tokens (fewer where the pool is shorter), in a graph
captured for exactly that shape, beside a decode step of B rows; per step, synchronised, median
(as ``bench steps``); each beside its HBM floor (``bench_steps.hbm_floor_bytes``: the weights
once, of the routed experts those the step's tokens route to, the sequences' states). A MoE's
verify sequence reads each of its tokens' experts, so the floors bound what speculation can
give: at an acceptance length a, at most a x the decode floor / the verify floor.

Tokens/s: one request alone (a ``prompt_tokens`` random prompt, ``max_tokens`` greedy tokens) on
one engine, plain (the request opts out) and speculating with k = ``num_drafts``, and on an engine
whose gate chooses between decoding and 1, 2, 4 or 8 drafts (``speculative.Gate``); where the preset
has MTP layers, also drafted by them (``Speculative(mtp=True)``, on an engine of its own), which
puts their cost (an MTP step after each step, k - 1 chained ones before a verify step) beside. Random weights
make a real drafter's acceptance meaningless, and so do bf16 kernels: drafts of the plain run's
own greedy tokens are kept for a few tokens only, since the verify step's kernels round
otherwise than the decode step's and a random model's near-tied tokens flip (in fp32 the tests
find the tokens equal). So the acceptance is set (``SetAcceptance``): each draft is kept with a
given chance while those before it were, which is the work of a run at that acceptance whatever
the tokens (random ones, ``RandomDrafts``, so a MoE reads the experts real drafts would). Beside
them prompt lookup (``NgramDrafter``), its drafts checked, on a prompt that repeats one block,
for what it is worth on a random model, and how many of its tokens lead equal to plain
decoding's. And at concurrency ``wide``, prompt lookup on random prompts beside
no speculation: the engine speculates only while at most ``Speculative.max_batch`` requests
decode; with MTP layers, the same drafted by them, which follow every step (their cost at a
batch that does not speculate).
"""

from __future__ import annotations

import gc
import time

import numpy as np
import torch

from ..graphs import Bucket, BucketSet
from ..runtime.engine import Engine
from ..runtime.model import Model
from ..runtime.ngram_drafter import NgramDrafter
from ..runtime.plan import StepPlan
from ..runtime.presets import preset_config
from ..runtime.request import SamplingParams
from ..runtime.speculative import Gate, Speculative, draft_ladder
from ..runtime.state_pool import StatePool
from ..runtime.step_runner import StepRunner
from .bench_kernels import copy_bandwidth, stamp
from .bench_steps import CONTEXT, hbm_floor_bytes, routed_experts, step_ms

PRESETS = ("nemotron-h-8b", "nemotron-3-nano-30b-a3b", "nemotron-3.5-lightning-30b-a3b")
MTP_KEEP = (0.0, 0.75, 1.0)  # the MTP layers' rows: nothing kept, an acceptance length near 3 (k = 4), all
BATCHES = (1, 8, 64)
DRAFTS = (1, 2, 4, 8)
KEEP = (0.0, 0.4, 0.6, 0.75, 0.9, 1.0)  # each draft's chance to be kept, the ones before it kept
GATE_KEEP = (0.6, 0.75, 0.9)  # the same with the gate choosing decoding or 1, 2, 4, 8 drafts


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
    slots for) and k in ``DRAFTS``, and their HBM floors' bytes (the experts each routes to
    counted from an eager run of it); in CUDA graphs (on a CPU, eager)."""
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
        row = {"batch": batch, "context": context, "decode_ms": step_ms(plain, decode), "verify_ms": {},
               "decode_floor_bytes": hbm_floor_bytes(model, pool, batch, routed_experts(plain, decode)),
               "verify_floor_bytes": {}}
        del plain
        for k in DRAFTS:
            tokens = batch * (1 + k)
            buckets = BucketSet(decode=(1,), mixed_decode=(0,), prefill=(tokens,), max_prefill_seqs=batch, drafts=k,
                                verify=(tokens,))
            runner = StepRunner(model, pool, buckets)
            if cuda:
                runner.capture([Bucket(0, tokens, k)], progress=False)
            plan = verify_plan(batch, k, model.cfg.vocab_size, context)
            row["verify_ms"][k] = step_ms(runner, plan)
            row["verify_floor_bytes"][k] = hbm_floor_bytes(model, pool, batch, routed_experts(runner, plan))
            del runner
        rows.append(row)
        if progress:
            print(f"  batch {batch}: decode {row['decode_ms']:.3f} ms, verify "
                  + ", ".join(f"k={k} {v:.3f}" for k, v in row["verify_ms"].items()), flush=True)
    return rows


class SetAcceptance(Engine):
    """An engine whose verify steps keep their drafts as if they matched, each with probability
    ``keep`` while the ones before it were kept (None: drafts are checked as usual): exactly the
    work of a run at that acceptance, whatever tokens the drafts and draws are."""

    keep: float | None = None
    _rng = np.random.default_rng(0)

    def _accepted(self, drafts, drawn):
        if self.keep is None:
            return super()._accepted(drafts, drawn)
        n = 0
        while n < len(drafts) and self._rng.random() < self.keep:
            n += 1
        return n


class RandomDrafts:
    """Drafts k random tokens (what they are does not matter to SetAcceptance, but a MoE routes
    each to its own experts as real drafts would be: a token repeated k times routes alike, and
    made Nano's verify of 1 + 8 tokens 8.0-8.3 ms in the engine against 9.2 in an exact graph of
    random drafts). Seeded by the context's length, so a run repeats."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def draft(self, context, k):
        return np.random.default_rng(len(context)).integers(1, self.vocab, k).tolist()


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


def _leading_equal(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def bench_preset(name: str, *, prompt_tokens: int = 512, max_tokens: int = 256, num_drafts: int = 4, wide: int = 64,
                 device: str = "cuda", progress: bool = True) -> dict:
    torch.manual_seed(0)
    gpu = device.startswith("cuda")
    mtp = bool(preset_config(name).mtp_layer_types)
    model = Model.from_preset(name, dtype=torch.bfloat16 if gpu else torch.float32, device=device, mtp=mtp)
    vocab = model.cfg.vocab_size
    drafter = {"make": lambda: RandomDrafts(vocab)}
    # not adaptive: every row measures verify steps at its acceptance, paying or not
    spec = Speculative(drafter=lambda: drafter["make"](), num_drafts=num_drafts, adaptive=False)
    buckets = BucketSet(decode=(1, 2, 4, 8, 16, 32, 64), mixed_decode=(0, 64), prefill=(128, 512),
                        max_prefill_seqs=8)
    engine = SetAcceptance(model, num_slots=wide, max_context=prompt_tokens + max_tokens + 16, buckets=buckets,
                           speculative=spec, use_graphs=gpu, progress=progress)
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, vocab, prompt_tokens).tolist()
    greedy = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    _, plain_rate = _alone(engine, prompt, SamplingParams(**greedy, speculative=False))
    runs = [{"drafter": "none", "keep": None, "tokens_per_s": plain_rate, "acceptance_length": 1.0}]

    def measured(label: str, prompt: list[int], keep: float | None, on: Engine = engine) -> tuple[dict, list[int]]:
        on.keep = keep
        before = dict(on.speculative_stats)
        tokens, tps = _alone(on, prompt, SamplingParams(**greedy, speculative=True))
        s = {k: v - before[k] for k, v in on.speculative_stats.items()}
        run = {"drafter": label, "keep": keep, "tokens_per_s": tps,
               "acceptance_length": 1 + s["accepted"] / max(1, s["verified"]),
               "drafts": s["drafts"] / max(1, s["verified"])}
        if progress:
            print(f"  {label} keep={keep}: {tps:.0f} tokens/s, acceptance length {run['acceptance_length']:.2f}",
                  flush=True)
        return run, tokens

    for keep in KEEP:
        runs.append(measured("set", prompt, keep)[0])
    # the adaptive gate (``speculative.Gate``) on an engine of its own, choosing the drafts
    gated = SetAcceptance(model, num_slots=2, max_context=prompt_tokens + max_tokens + 16, buckets=buckets,
                          speculative=Speculative(drafter=lambda: RandomDrafts(vocab), num_drafts=max(DRAFTS)),
                          use_graphs=gpu, progress=progress)
    for keep in GATE_KEEP:  # each from a fresh gate: what it finds at that acceptance, not after the last one's
        gated.scheduler.gate = Gate(draft_ladder(max(DRAFTS)))
        runs.append(measured("gate", prompt, keep, gated)[0])
    del gated
    mtp_engine = None
    if mtp:  # the checkpoint's MTP layers drafting (random: what they cost), at a set acceptance
        mtp_engine = SetAcceptance(model, num_slots=wide, max_context=prompt_tokens + max_tokens + 16, buckets=buckets,
                                   speculative=Speculative(mtp=True, num_drafts=num_drafts, adaptive=False),
                                   use_graphs=gpu, progress=progress)
        for keep in MTP_KEEP:
            runs.append(measured("mtp", prompt, keep, mtp_engine)[0])
    # prompt lookup, its drafts checked, on a prompt that repeats one block (of 64 tokens, or an
    # eighth of it)
    block = rng.integers(1, vocab, min(64, max(1, prompt_tokens // 8))).tolist()
    repeated = (block * -(-prompt_tokens // len(block)))[:prompt_tokens]
    repeated_plain, repeated_rate = _alone(engine, repeated, SamplingParams(**greedy, speculative=False))
    drafter["make"] = NgramDrafter
    ngram, ngram_tokens = measured("ngram", repeated, None)
    ngram.update(plain_tokens_per_s=repeated_rate, leading_equal=_leading_equal(ngram_tokens, repeated_plain))
    runs.append(ngram)

    # at concurrency ``wide``, drafts checked (prompt lookup, on random prompts: few kept):
    # above max_batch the engine does not speculate
    prompts = [rng.integers(1, vocab, min(128, prompt_tokens)).tolist() for _ in range(wide)]
    short = dict(greedy, max_tokens=min(128, max_tokens))
    wide_plain, wide_plain_rate = _wide(engine, prompts, SamplingParams(**short, speculative=False))
    wide_spec, wide_spec_rate = _wide(engine, prompts, SamplingParams(**short, speculative=True))
    wide_run = {"concurrency": wide, "plain_tokens_per_s": wide_plain_rate, "spec_tokens_per_s": wide_spec_rate,
                "requests_equal": sum(a == b for a, b in zip(wide_spec, wide_plain))}
    if mtp_engine is not None:  # the MTP following every request (a step after each) where none verifies
        mtp_engine.keep = None
        wide_mtp, wide_run["mtp_tokens_per_s"] = _wide(mtp_engine, prompts, SamplingParams(**short, speculative=True))
        wide_run["mtp_requests_equal"] = sum(a == b for a, b in zip(wide_mtp, wide_plain))
        del mtp_engine
    # the step timings on a pool of their own, which records up to the largest k's drafts
    slots, max_context = engine.pool.num_slots, engine.pool.max_context
    del engine, measured
    gc.collect()
    pool = StatePool(model.cfg, slots, max_context, dtype=model.dtype, device=model.device, drafts=max(DRAFTS))
    steps = verify_steps(model, pool, progress)
    return {"preset": name, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "num_drafts": num_drafts,
            "max_batch": spec.max_batch, "steps": steps, "alone": runs, "wide": wide_run}


def run(presets=PRESETS, progress: bool = True, **kw) -> dict:
    bandwidth = copy_bandwidth() if torch.cuda.is_available() and kw.get("device", "cuda").startswith("cuda") else None
    return {**stamp(), "copy_GB/s": bandwidth and bandwidth / 1e9,
            "presets": [bench_preset(p, progress=progress, **kw) for p in presets]}


def floor_bound(step: dict, k: int, length: float) -> float:
    """The most speculation can give at an acceptance length ``length`` with k drafts, at the
    HBM floors: that many tokens for the verify step's bytes, against one for the decode step's."""
    return length * step["decode_floor_bytes"] / step["verify_floor_bytes"][k]


def tables(result: dict) -> str:
    out = [f"{result['device']}, {result['date']}, torch {result['torch']}; random weights, greedy"]
    rate = result.get("copy_GB/s")  # floors in ms where measured (bytes / the copy bandwidth)

    def cell(ms: float, base: float | None, nbytes: int | None) -> str:
        """A step's time (against the decode step's, ``base``), and its floor where measured."""
        notes = [f"{ms / base:.2f}x"] if base else []
        if rate and nbytes is not None:
            notes.append(f"floor {nbytes / rate / 1e6:.3f}")
        return f"{ms:.3f} ({', '.join(notes)})" if notes else f"{ms:.3f}"

    for p in result["presets"]:
        # k as a number whether the result was made here or read from its JSON (keys as strings)
        by_k = ("verify_ms", "verify_floor_bytes")
        p = dict(p, steps=[dict(s, **{f: {int(k): v for k, v in s[f].items()} for f in by_k if f in s})
                           for s in p["steps"]])
        ks = list(p["steps"][0]["verify_ms"]) if p["steps"] else []
        context = p["steps"][0]["context"] if p["steps"] else 0
        floored = rate and any("decode_floor_bytes" in s for s in p["steps"])
        out += ["", f"{p['preset']}: verify steps of 1 + k tokens a sequence beside a decode step, "
                    f"{context} tokens in each slot (ms{'; its HBM floor beside each' if floored else ''})", "",
                "| batch | decode | " + " | ".join(f"verify k={k}" for k in ks) + " |",
                "| --- | --- | " + " | ".join("---" for _ in ks) + " |"]
        for s in p["steps"]:
            floors = s.get("verify_floor_bytes", {})
            out.append(f"| {s['batch']} | {cell(s['decode_ms'], None, s.get('decode_floor_bytes'))} | "
                       + " | ".join(cell(s["verify_ms"][k], s["decode_ms"], floors.get(k)) for k in ks) + " |")
        one = next((s for s in p["steps"] if s["batch"] == 1 and "verify_floor_bytes" in s), None)
        if one and 2 in one["verify_floor_bytes"] and p["num_drafts"] in one["verify_floor_bytes"]:
            out += ["", f"At the HBM floors, one sequence: an acceptance length of 3 gives at most "
                        f"{floor_bound(one, 2, 3.0):.2f}x plain decoding with k = 2 (the fewest drafts it takes), "
                        f"{floor_bound(one, p['num_drafts'], 3.0):.2f}x with k = {p['num_drafts']}."]
        out += ["", f"{p['preset']}: one request alone, a {p['prompt_tokens']}-token prompt, {p['max_tokens']} greedy "
                    f"tokens, k = {p['num_drafts']}", "",
                "| drafts | kept | acceptance length | tokens/s | speed-up | a step (ms) |",
                "| --- | --- | --- | --- | --- | --- |"]
        plain = p["alone"][0]["tokens_per_s"]
        for r in p["alone"]:
            label = {"none": "none (plain decoding)", "set": "set acceptance",
                     "mtp": "the MTP layers, set acceptance", "ngram": "prompt lookup, repeating prompt",
                     "gate": f"set acceptance, the gate choosing up to {max(DRAFTS)} "
                             f"({r.get('drafts', 0):.1f} a verify step)"}[r["drafter"]]
            kept = "checked" if r["keep"] is None else f"{r['keep']:.0%} each"
            kept = "-" if r["drafter"] == "none" else kept
            out.append(f"| {label} | {kept} | {r['acceptance_length']:.2f} | {r['tokens_per_s']:.0f} | "
                       f"{r['tokens_per_s'] / r.get('plain_tokens_per_s', plain):.2f}x | {_cycle_ms(r):.3f} |")
        out += _beside_the_steps(p)
        ngram = next((r for r in p["alone"] if r["drafter"] == "ngram"), None)
        if ngram:
            out += ["", "Prompt lookup beside plain decoding of the repeating prompt "
                        f"({ngram['plain_tokens_per_s']:.0f} tokens/s): its first {ngram['leading_equal']} of "
                        f"{p['max_tokens']} tokens equal."]
        if p.get("note"):
            out += ["", p["note"]]
        w = p["wide"]
        out += ["", f"Concurrency {w['concurrency']}, prompt lookup on random prompts (speculating while at most "
                    f"{p['max_batch']} requests decode): {w['spec_tokens_per_s']:.0f} output tokens/s with it allowed, "
                    f"{w['plain_tokens_per_s']:.0f} without "
                    f"({w['spec_tokens_per_s'] / w['plain_tokens_per_s'] - 1:+.1%}); "
                    f"{w['requests_equal']} of {w['concurrency']} requests' tokens equal."]
        if "mtp_tokens_per_s" in w:
            out += ["", f"The same with the MTP layers drafting (`Speculative(mtp=True)`, none verifying at this "
                        f"batch): "
                        f"{w['mtp_tokens_per_s']:.0f} output tokens/s "
                        f"({w['mtp_tokens_per_s'] / w['plain_tokens_per_s'] - 1:+.1%} against none); "
                        f"{w['mtp_requests_equal']} of {w['concurrency']} requests' tokens equal."]
    return "\n".join(out)


def _cycle_ms(run: dict) -> float:
    """The engine's time a step of a run alone (a verify cycle, or a plain decode step): its
    acceptance length (tokens a step) over its tokens/s."""
    return 1e3 * run["acceptance_length"] / run["tokens_per_s"]


def _beside_the_steps(p: dict) -> list[str]:
    """What a step of the engine alone took beyond the same step timed in an exact graph: the
    host's refill, scheduling and read-back, and the engine's bucket padding. Plain decoding
    beside the decode step of one row; no draft kept beside the verify step of 1 + k (every
    verify sequence then 1 + k tokens, nothing replayed)."""
    one = next((s for s in p["steps"] if s["batch"] == 1), None)
    plain = next((r for r in p["alone"] if r["drafter"] == "none"), None)
    none_kept = next((r for r in p["alone"] if r["drafter"] == "set" and r["keep"] == 0), None)
    if one is None or plain is None or none_kept is None or p["num_drafts"] not in one["verify_ms"]:
        return []
    decode, verify = one["decode_ms"], one["verify_ms"][p["num_drafts"]]
    return ["", f"A step alone beyond the same step in an exact graph (the host's refill, scheduling and read-back, "
                f"and the engine's bucket padding): plain decoding {_cycle_ms(plain) - decode:+.3f} ms "
                f"({_cycle_ms(plain):.3f} against {decode:.3f}); a verify step of 1 + {p['num_drafts']} with no draft "
                f"kept {_cycle_ms(none_kept) - verify:+.3f} ms ({_cycle_ms(none_kept):.3f} against {verify:.3f})."]


def print_table(result: dict) -> None:
    print(tables(result))
